"""Where a rank reads its job and reports back: Redis (the service) or files (`ringq run`)."""

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Protocol

import redis

from admission.group_plan import CPU_CHUNK_TOKENS
from jobs.cancel import cancel_requested, mark_cancelled
from jobs.checkpoint_marks import clear_checkpoint, mark_checkpoint, mark_for
from jobs.errors import IllegalTransitionError, InvalidJobError, JobNotFoundError
from jobs.job_text import TextDelta, append_text, end_text, expire_at_job
from jobs.lifecycle import JobState
from jobs.recovery import report_group_failure
from jobs.schemas import GroupSpec, JobResult, JobSpec, Placement, Progress
from jobs.store import JobStore
from jobs.warm_groups import WarmGroups

log = logging.getLogger(__name__)
CANCEL_POLL_INTERVAL_S = 0.2  # Redis is asked at most this often (every rank, chunk and step)
PLACEMENT_WAIT_S = 10.0  # a warm group's job is handed over just before its placement is written


class JobIO(Protocol):
    """Everything a rank reads or reports about its jobs goes through this."""

    job_id: str

    def spec(self) -> JobSpec: ...
    def tokens(self) -> list[int]: ...
    def chunk_tokens(self) -> int: ...
    def placement(self) -> Placement | None: ...
    def prefix_conn(self) -> redis.Redis | None: ...
    def kept_tokens(self, job_id: str) -> list[int]: ...
    def next_job(
        self, group: GroupSpec, rank: int, kick: Callable[[], None]
    ) -> Optional["JobIO"]: ...
    def await_placement(self) -> bool: ...
    def joined(
        self,
        group: GroupSpec,
        rank: int,
        agree: Callable[[int], int],
    ) -> list["JobIO"]: ...
    def batch_started(self, group: GroupSpec) -> None: ...
    def batch_ended(self, group: GroupSpec) -> None: ...
    def enter(self, phase: JobState, total: int) -> None: ...
    def progress(self, progress: Progress) -> None: ...
    def text(self, delta: str) -> None: ...
    def finish(self, result: JobResult) -> None: ...
    def fail(self, reason: str, retry: bool = True) -> None: ...
    def should_stop(self) -> bool: ...
    def cancelled(self, reason: str, partial: JobResult | None = None) -> None: ...
    def checkpointed(self, group: GroupSpec, rank: int, tokens: int) -> None: ...


class RedisJobIO:
    """A rank of group `group_id`: every write is checked to still be that group's job (a rank
    of a lost group gets StaleGroupError and stops). Failures are reported for the group, and
    its node agent retries or fails the job (jobs.recovery)."""

    def __init__(self, store: JobStore, job_id: str, group_id: str):
        self.store = store
        self.job_id = job_id
        self.group_id = group_id
        self._stop = False
        self._polled_at_s = -math.inf
        self._text_chars = 0  # of generated text appended to the job's text stream
        self._text_expire_at_ms: int | None = None

    def spec(self) -> JobSpec:
        return self.store.get(self.job_id).spec

    def tokens(self) -> list[int]:
        return self.store.get_tokens(self.job_id)

    def chunk_tokens(self) -> int:
        placement = self.placement()
        return (placement.chunk_tokens if placement else None) or CPU_CHUNK_TOKENS

    def placement(self) -> Placement | None:
        """What the dispatcher recorded for the job (None until it is placed)."""
        return self.store.get(self.job_id).placement

    def prefix_conn(self) -> redis.Redis:
        """Where kept prefixes are indexed (jobs/prefix_index.py): the service's Redis."""
        return self.store.conn

    def kept_tokens(self, job_id: str) -> list[int]:
        return self.store.get_tokens(job_id)

    def next_job(
        self, group: GroupSpec, rank: int, kick: Callable[[], None]
    ) -> "RedisJobIO | None":
        """The group's next job (jobs.warm_groups); rank 0 first offers the group again."""
        warm = WarmGroups(self.store.conn)
        if rank == 0:
            placement = self.store.get(self.job_id).placement
            if placement is None:
                warm.offer(group, 0)
            else:
                warm.offer(group, placement.bytes_per_node, placement.chunk_tokens)
        job_id = warm.wait_for_job(group, rank, group.idle_s, kick=kick)
        return None if job_id is None else RedisJobIO(self.store, job_id, self.group_id)

    def joined(
        self,
        group: GroupSpec,
        rank: int,
        agree: Callable[[int], int],
    ) -> list["JobIO"]:
        """Between decode steps, every rank: the jobs handed to the busy group since (the same
        on every rank; `agree` is a collective: jobs.warm_groups.WarmGroups.joined)."""
        found = WarmGroups(self.store.conn).joined(group, rank, agree)
        return [RedisJobIO(self.store, job_id, self.group_id) for job_id in found]

    def batch_started(self, group: GroupSpec) -> None:
        """Rank 0: the job is in the group's batch (what a lost group's retry covers)."""
        WarmGroups(self.store.conn).started(group, self.job_id)

    def batch_ended(self, group: GroupSpec) -> None:
        """Rank 0: the job left the batch; the bytes its joining reserved are given back."""
        WarmGroups(self.store.conn).ended(group, self.job_id)

    def await_placement(self) -> bool:
        """Whether the job is placed on this group, once the dispatcher has recorded it (False
        when the job ended or went elsewhere first)."""
        deadline = time.monotonic() + PLACEMENT_WAIT_S
        while True:
            try:
                record = self.store.get(self.job_id)
            except JobNotFoundError:
                return False
            placement = record.placement
            if placement is not None and placement.group_id == self.group_id:
                return record.state == JobState.ADMITTED
            if record.state.is_final or time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def enter(self, phase: JobState, total: int) -> None:
        """Move the job to `phase`; a job cancelled meanwhile stays cancelled (its ranks stop at
        their next agreement, since the cancel flag is set before the state changes)."""
        processed = total if phase == JobState.DECODE else 0
        progress = Progress(phase=phase, processed=processed, total=total)
        try:
            self.store.transition(self.job_id, phase, group_id=self.group_id, progress=progress)
        except IllegalTransitionError:
            state = self.store.get(self.job_id).state
            if state == phase:  # the client retried a write whose reply a Redis restart lost
                log.info("job %s: already in %s", self.job_id, phase)
                return
            if state != JobState.CANCELLED:
                raise
            log.info("job %s: cancelled, not entering %s", self.job_id, phase)

    def progress(self, progress: Progress) -> None:
        self.store.set_progress(self.job_id, progress, group_id=self.group_id)

    def text(self, delta: str) -> None:
        """Append generated text to the job's text stream (jobs/job_text.py), which expires
        when the job's record does."""
        if self._text_expire_at_ms is None:
            self._text_expire_at_ms = expire_at_job(
                self.store.conn, self.job_id, self.store.job_ttl_s
            )
        entry = TextDelta(group=self.group_id, offset=self._text_chars, text=delta)
        append_text(self.store.conn, self.job_id, entry, self._text_expire_at_ms)
        self._text_chars += len(delta)

    def finish(self, result: JobResult) -> None:
        last = self.store.get(self.job_id).progress
        # a generate job ends with its generated count (the last decode step may not have been
        # written: progress is throttled), a prefill job with its prompt's
        count = result.generated_tokens or last.processed
        done = Progress(phase=JobState.FINISHED, processed=count, total=count)
        self.store.transition(
            self.job_id, JobState.FINISHED, group_id=self.group_id, result=result, progress=done
        )
        end_text(self.store.conn, self.job_id)

    def fail(self, reason: str, retry: bool = True) -> None:
        report_group_failure(self.store.conn, self.group_id, reason, retry)

    def should_stop(self) -> bool:
        """Whether cancel was asked; reads Redis at most every CANCEL_POLL_INTERVAL_S."""
        now = time.monotonic()
        if not self._stop and now - self._polled_at_s >= CANCEL_POLL_INTERVAL_S:
            self._polled_at_s = now
            self._stop = cancel_requested(self.store.conn, self.job_id)
        return self._stop

    def cancelled(self, reason: str, partial: JobResult | None = None) -> None:
        mark_cancelled(self.store, self.job_id, reason, partial)
        end_text(self.store.conn, self.job_id)

    def checkpointed(self, group: GroupSpec, rank: int, tokens: int) -> None:
        """Record where this rank's checkpoint part is (0 tokens: it was deleted), so that a
        retry is placed where it can continue (jobs/checkpoint_marks.py)."""
        conn = self.store.conn
        if tokens:
            mark = mark_for(group, rank, tokens)
            mark_checkpoint(conn, self.job_id, rank, mark, self.store.job_ttl_s)
        else:
            clear_checkpoint(conn, self.job_id, rank)


class FileJobIO:
    """Job from a JSON file {id, spec, tokens}; events appended as JSON lines for the parent.
    Nothing cancels a file job (Ctrl-C on `ringq run` ends its ranks)."""

    def __init__(self, job_path: Path, events_path: Path):
        job = json.loads(job_path.read_text())
        self.job_id = job["id"]
        self._spec = JobSpec.model_validate(job["spec"])
        self._tokens = job["tokens"]
        self._chunk_tokens = int(job.get("chunk_tokens") or CPU_CHUNK_TOKENS)
        self.events_path = events_path

    def spec(self) -> JobSpec:
        return self._spec

    def tokens(self) -> list[int]:
        return self._tokens

    def chunk_tokens(self) -> int:
        return self._chunk_tokens

    def placement(self) -> None:
        return None  # no dispatcher, no reservation

    def prefix_conn(self) -> None:
        return None  # `ringq run` keeps and matches no prefixes

    def kept_tokens(self, job_id: str) -> list[int]:
        raise InvalidJobError("cache_from needs the service (ringq submit)")

    def next_job(self, group: GroupSpec, rank: int, kick: Callable[[], None]) -> None:
        return None  # `ringq run` runs one job

    def await_placement(self) -> bool:
        return True

    def joined(
        self,
        group: GroupSpec,
        rank: int,
        agree: Callable[[int], int],
    ) -> list[JobIO]:
        return []

    def batch_started(self, group: GroupSpec) -> None:
        pass

    def batch_ended(self, group: GroupSpec) -> None:
        pass

    def enter(self, phase: JobState, total: int) -> None:
        self._write("progress", Progress(phase=phase, total=total).model_dump(mode="json"))

    def progress(self, progress: Progress) -> None:
        self._write("progress", progress.model_dump(mode="json"))

    def text(self, delta: str) -> None:
        self._write("text", delta)

    def finish(self, result: JobResult) -> None:
        self._write("result", result.model_dump(mode="json"))

    def fail(self, reason: str, retry: bool = True) -> None:
        self._write("error", reason)

    def should_stop(self) -> bool:
        return False

    def cancelled(self, reason: str, partial: JobResult | None = None) -> None:
        self._write("error", reason)

    def checkpointed(self, group: GroupSpec, rank: int, tokens: int) -> None:
        return None  # `ringq run` does not retry

    def _write(self, event: str, data: object) -> None:
        with self.events_path.open("a") as out:
            out.write(json.dumps({"event": event, "data": data}) + "\n")
