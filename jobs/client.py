"""The Python client: what the `ringq` CLI does, for scripts, without importing internals.

    from jobs.client import Client

    client = Client()  # RINGQ_REDIS_URL, else the embedded Redis of `ringq up` (RINGQ_HOME)
    job = client.submit(Path("report.txt"), prompt="Summarise", max_tokens=200)
    for record in client.watch(job.id):  # a JobRecord each time its progress changes
        print(record.progress.phase, record.progress.processed, record.progress.total)
    print(client.result(job.id).text)

Every method talks to Redis only (no model, no MLX): a job runs once `ringq up` (or a
dispatcher and node agents) serve the same Redis. Errors are jobs.errors.RingqError subclasses
with a message a user can act on; a Redis that cannot be reached raises RedisUnavailableError."""

import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import redis

from admission.vocabulary import StrategyChoice
from jobs.errors import InvalidJobError, JobFailedError, JobNotFinishedError, RedisUnavailableError
from jobs.lifecycle import JobState
from jobs.listing import BatchSummary, JobSummary, list_batches, list_jobs
from jobs.schemas import BatchRecord, JobKind, JobRecord, JobResult, JobSpec, NodeInfo
from jobs.settings import Settings, get_settings
from jobs.store import JobStore

if TYPE_CHECKING:
    from jobs.batch_input import ParsedBatch

WATCH_INTERVAL_S = 0.25


def default_redis_url(settings: Settings) -> str:
    """RINGQ_REDIS_URL, else the embedded server's unix socket under RINGQ_HOME."""
    from jobs.redis_server import SOCKET_NAME, redis_data_dir, unix_url

    return settings.redis_url or unix_url(redis_data_dir(settings) / SOCKET_NAME)


def connect_client(redis_url: str | None = None, settings: Settings | None = None) -> redis.Redis:
    """A checked connection (one PING); a clear RedisUnavailableError when nothing answers."""
    from jobs.redis_server import connect

    settings = settings or get_settings()
    if redis_url or settings.redis_url:
        return connect(redis_url or settings.redis_url or "")
    try:
        return connect(default_redis_url(settings), timeout_s=1.0)
    except RedisUnavailableError:
        raise RedisUnavailableError(
            f"no Redis: start ringq with `ringq up` (embedded Redis under {settings.home}) "
            "or set RINGQ_REDIS_URL"
        ) from None


class Client:
    """Submit jobs and batches, follow them, read results, list and cancel them."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        conn: redis.Redis | None = None,
        settings: Settings | None = None,
    ):
        """`settings`: RINGQ_* of this process when not given, read once here."""
        self.settings = settings or get_settings()
        self.conn = conn if conn is not None else connect_client(redis_url, self.settings)
        self.store = JobStore(self.conn, self.settings.job_ttl_s)

    # -- jobs ------------------------------------------------------------------------------

    def submit(
        self,
        path: os.PathLike[str] | None = None,
        *,
        document: str | None = None,
        kind: JobKind | Literal["prefill", "generate"] = JobKind.GENERATE,
        prompt: str | None = None,
        model: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        ranks: int | Literal["auto"] = "auto",
        strategy: StrategyChoice = "auto",
        job_id: str | None = None,
        keep_cache: bool = False,
        cache_from: str | None = None,
        ring_size: int | Literal["auto"] | None = None,
        sharding: StrategyChoice | None = None,
    ) -> JobRecord:
        """Enqueue one job; returns its record (state queued). Its document is a file to read
        (`path`, a pathlib.Path / os.PathLike) or the text itself (`document=`); a str
        `path` is refused rather than guessed at. A generate job without
        `prompt` summarises the document (schemas.DEFAULT_GENERATE_PROMPT). `ring_size` and
        `sharding` are the deprecated names of `ranks` and `strategy`."""
        from jobs.submit import submit_job  # imports rq: only the commands that enqueue pay

        text, name = _document(path, document, self.settings.max_document_bytes)
        spec = JobSpec(
            kind=JobKind(kind),
            document=text,
            document_name=name,
            model=model or self.settings.default_model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            stop=stop or [],
            seed=seed,
            ranks=_renamed("ring_size", ring_size, "ranks", ranks),
            strategy=_renamed("sharding", sharding, "strategy", strategy),
            keep_cache=keep_cache,
            cache_from=cache_from,
        )
        return submit_job(self.conn, spec, job_id, self.settings)

    def submit_spec(self, spec: JobSpec, job_id: str | None = None) -> JobRecord:
        """Enqueue a JobSpec built by the caller."""
        from jobs.submit import submit_job

        return submit_job(self.conn, spec, job_id, self.settings)

    def status(self, job_id: str) -> JobRecord:
        """The job's record: state, progress, placement, result, error."""
        return self.store.get(job_id)

    def wait(self, job_id: str, timeout_s: float | None = None) -> JobRecord:
        """The job's record once it has ended, or when `timeout_s` (None: no limit) passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        record = self.store.get(job_id)
        while not record.state.is_final:
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(WATCH_INTERVAL_S)
            record = self.store.get(job_id)
        return record

    def result(self, job_id: str, wait: float | None = None) -> JobResult:
        """The finished job's result, waiting up to `wait` seconds (None: do not wait, inf:
        until it ends). JobFailedError for a failed or cancelled job (its `record` holds the
        partial result of a cancelled one); JobNotFinishedError when it is still running."""
        record = self.wait(job_id, wait if wait != float("inf") else None) if wait else None
        record = record or self.store.get(job_id)
        if record.state == JobState.FINISHED and record.result is not None:
            return record.result
        if record.state.is_final:
            raise JobFailedError(f"job {job_id} {record.state}: {record.error}", record)
        raise JobNotFinishedError(
            f"job {job_id} is {record.state}, not finished yet (wait for it: --wait)", record
        )

    def watch(self, job_id: str, interval_s: float = WATCH_INTERVAL_S) -> Iterator[JobRecord]:
        """The job's record now and each time its state or progress changes, until it ends
        (the last one yielded is final)."""
        seen: tuple[Any, ...] | None = None
        while True:
            record = self.store.get(job_id)
            mark = (record.state, record.progress, record.waiting_reason)
            if mark != seen:
                seen = mark
                yield record
            if record.state.is_final:
                return
            time.sleep(interval_s)

    def cancel(self, job_id: str) -> JobRecord:
        """Cancel a job: a queued one ends at once, a running one at its next chunk or decode
        step (its record says `cancelled` then). IllegalTransitionError if it already ended."""
        from jobs.cancel import cancel_job

        return cancel_job(self.store, job_id)

    def jobs(
        self, state: JobState | str | None = None, batch: str | None = None, limit: int = 50
    ) -> list[JobSummary]:
        """The newest `limit` jobs (a batch's in input order), of one state when given."""
        return list_jobs(self.conn, state=state, batch_id=batch, limit=limit)

    def nodes(self) -> list[NodeInfo]:
        """Live node agents."""
        return self.store.live_nodes()

    # -- batches ---------------------------------------------------------------------------

    def batch_submit(
        self,
        path: str | os.PathLike[str],
        *,
        model: str | None = None,
        max_tokens: int = 256,
        skip_invalid: bool = False,
        batch_id: str | None = None,
    ) -> BatchRecord:
        """Check every line of a JSONL file (OpenAI Batch or plain lines) and enqueue them as
        one batch. BatchInputError names the bad lines; with `skip_invalid` the good ones are
        enqueued and the record's `skipped` lists the others (they go to the errors file of
        batch_results). `model` overrides every line's."""
        from jobs.batch_input import Defaults, parse_batch_file

        defaults = Defaults.of(self.settings, model, max_tokens)
        parsed = parse_batch_file(Path(path), defaults, self.settings)
        return self.batch_submit_parsed(parsed, skip_invalid=skip_invalid, batch_id=batch_id)

    def batch_submit_parsed(
        self, parsed: "ParsedBatch", *, skip_invalid: bool = False, batch_id: str | None = None
    ) -> BatchRecord:
        """Enqueue a batch file already read by jobs.batch_input.parse_batch_file (whose errors
        and hint the caller may show), as batch_submit does."""
        from jobs.batch import submit_batch
        from jobs.batch_input import require_valid

        items = require_valid(parsed, skip_invalid)
        skipped = [error.skipped() for error in parsed.errors]
        return submit_batch(
            self.conn, items, parsed.input_name, batch_id=batch_id, skipped=skipped,
            settings=self.settings,
        )  # fmt: skip

    def batch_status(self, batch_id: str) -> Any:
        """jobs.batch.BatchCounts: total, queued, running, completed, failed, cancelled."""
        from jobs.batch import batch_counts, get_batch

        return batch_counts(self.conn, get_batch(self.conn, batch_id))

    def batch_results(self, batch_id: str) -> Any:
        """jobs.batch.BatchResults: OpenAI Batch output lines of finished requests, error
        lines (failed, cancelled, expired, skipped), and how many are still pending."""
        from jobs.batch import batch_results

        return batch_results(self.conn, batch_id)

    def batch_cancel(self, batch_id: str) -> Any:
        """jobs.batch.BatchCancel: how many were cancelled, are stopping, had already ended."""
        from jobs.batch import cancel_batch

        return cancel_batch(self.conn, batch_id)

    def batch(self, batch_id: str) -> BatchRecord:
        from jobs.batch import get_batch

        return get_batch(self.conn, batch_id)

    def batches(self, limit: int = 50) -> list[BatchSummary]:
        """The newest `limit` batches."""
        return list_batches(self.conn, limit)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _document(given: object, document: str | None, max_bytes: int) -> tuple[str, str]:
    """(text, name) of the job's document: `given` a file path, or `document` the text."""
    if isinstance(given, str):
        raise InvalidJobError(
            f"Client.submit({given[:40]!r}): a str is neither a file nor text here; pass "
            "pathlib.Path(...) to read a file, or document=... for the text itself"
        )
    if (given is None) == (document is None):
        raise InvalidJobError("Client.submit takes a file path or document=..., one of them")
    if document is not None:
        return document, "-"
    from jobs.files import printable_name, read_at_most

    if not isinstance(given, os.PathLike):
        raise InvalidJobError(f"Client.submit: {type(given).__name__} is not a file path")
    path = Path(given)
    try:
        data = read_at_most(path, max_bytes)
    except OSError as exc:
        raise InvalidJobError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise InvalidJobError(f"{path}: over the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8-sig"), printable_name(path)
    except UnicodeDecodeError as exc:
        raise InvalidJobError(f"{path}: not UTF-8 text (byte {exc.start})") from None


Value = TypeVar("Value")


def _renamed(old: str, old_value: Value | None, new: str, value: Value) -> Value:
    """A keyword argument under its old name: it still works, with a DeprecationWarning."""
    if old_value is None:
        return value
    message = f"Client.submit({old}=...) is deprecated, use {new}=..."
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    return old_value
