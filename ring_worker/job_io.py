"""Where a rank reads its job and reports back: Redis (the service) or files (`ringq run`)."""

import json
import logging
import math
import time
from pathlib import Path
from typing import Protocol

from jobs.cancel import cancel_requested, mark_cancelled
from jobs.errors import IllegalTransitionError
from jobs.lifecycle import JobState
from jobs.recovery import report_group_failure
from jobs.schemas import JobResult, JobSpec, Progress
from jobs.store import JobStore

log = logging.getLogger(__name__)
CANCEL_POLL_INTERVAL_S = 0.2  # Redis is asked at most this often (every rank, chunk and step)


class JobIO(Protocol):
    job_id: str

    def spec(self) -> JobSpec: ...
    def tokens(self) -> list[int]: ...
    def enter(self, phase: JobState, total: int) -> None: ...
    def progress(self, progress: Progress) -> None: ...
    def finish(self, result: JobResult) -> None: ...
    def fail(self, reason: str, retry: bool = True) -> None: ...
    def should_stop(self) -> bool: ...
    def cancelled(self, reason: str, partial: JobResult | None = None) -> None: ...


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

    def spec(self) -> JobSpec:
        return self.store.get(self.job_id).spec

    def tokens(self) -> list[int]:
        return self.store.get_tokens(self.job_id)

    def enter(self, phase: JobState, total: int) -> None:
        """Move the job to `phase`; a job cancelled meanwhile stays cancelled (its ranks stop at
        their next agreement, since the cancel flag is set before the state changes)."""
        processed = total if phase == JobState.DECODE else 0
        progress = Progress(phase=phase, processed=processed, total=total)
        try:
            self.store.transition(self.job_id, phase, group_id=self.group_id, progress=progress)
        except IllegalTransitionError:
            if self.store.get(self.job_id).state != JobState.CANCELLED:
                raise
            log.info("job %s: cancelled, not entering %s", self.job_id, phase)

    def progress(self, progress: Progress) -> None:
        self.store.set_progress(self.job_id, progress, group_id=self.group_id)

    def finish(self, result: JobResult) -> None:
        last = self.store.get(self.job_id).progress
        # a generate job ends with its generated count (the last decode step may not have been
        # written: progress is throttled), a prefill job with its prompt's
        count = result.generated_tokens or last.processed
        done = Progress(phase=JobState.FINISHED, processed=count, total=count)
        self.store.transition(
            self.job_id, JobState.FINISHED, group_id=self.group_id, result=result, progress=done
        )

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


class FileJobIO:
    """Job from a JSON file {id, spec, tokens}; events appended as JSON lines for the parent.
    Nothing cancels a file job (Ctrl-C on `ringq run` ends its ranks)."""

    def __init__(self, job_path: Path, events_path: Path):
        job = json.loads(job_path.read_text())
        self.job_id = job["id"]
        self._spec = JobSpec.model_validate(job["spec"])
        self._tokens = job["tokens"]
        self.events_path = events_path

    def spec(self) -> JobSpec:
        return self._spec

    def tokens(self) -> list[int]:
        return self._tokens

    def enter(self, phase: JobState, total: int) -> None:
        self._write("progress", Progress(phase=phase, total=total).model_dump(mode="json"))

    def progress(self, progress: Progress) -> None:
        self._write("progress", progress.model_dump(mode="json"))

    def finish(self, result: JobResult) -> None:
        self._write("result", result.model_dump(mode="json"))

    def fail(self, reason: str, retry: bool = True) -> None:
        self._write("error", reason)

    def should_stop(self) -> bool:
        return False

    def cancelled(self, reason: str, partial: JobResult | None = None) -> None:
        self._write("error", reason)

    def _write(self, event: str, data: object) -> None:
        with self.events_path.open("a") as out:
            out.write(json.dumps({"event": event, "data": data}) + "\n")
