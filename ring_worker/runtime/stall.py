"""Stalled ranks, as their node agent sees them.

A rank's own watchdog (ring_worker/runtime/watchdog.py) cannot fire when its whole process is
stopped (SIGSTOP, a frozen VM), and in a group of one no peer notices either. So once a job has
started on a group, what its rank reports (state and progress) must change within
RINGQ_STALL_TIMEOUT_S (while loading, the watchdog's loading limit). Past the limit the agent
reports the group lost through jobs.recovery and kills it, after WATCHDOG_GRACE_S more for a rank
that still runs, so that the rank's own watchdog reports first, with its thread stacks.

Changes are timed on the agent's own monotonic clock, so clock skew between machines does not
matter."""

import logging
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jobs.lifecycle import JobState
from jobs.recovery import group_job_ids, live_on_group, lose_group_jobs
from jobs.schemas import GroupSpec, JobRecord
from jobs.settings import Settings
from jobs.store import JobStore
from ring_worker.runtime.watchdog import loading_timeout_s

log = logging.getLogger(__name__)
STARTED_STATES = frozenset({JobState.LOADING, JobState.PREFILL, JobState.DECODE})
WATCHDOG_GRACE_S = 5.0


@dataclass(frozen=True)
class _Seen:
    mark: tuple[object, ...]  # what a rank's report changes
    since_s: float  # when the agent first saw this mark


class StallWatch:
    """One per node agent: check() each live rank on every monitor pass."""

    def __init__(
        self,
        store: JobStore,
        settings: Settings,
        node: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.settings, self.node, self.clock = store, settings, node, clock
        self._seen: dict[str, _Seen] = {}

    def check(self, group: GroupSpec) -> str | None:
        """Why `group` (a rank of it runs here) counts as stalled, or None."""
        job_ids = group_job_ids(self.store.conn, group.group_id, group.job_id)
        records = live_on_group(self.store, job_ids, group.group_id)
        return self.check_records(group.group_id, records)

    def check_records(self, group_id: str, records: list[JobRecord]) -> str | None:
        """A group with several jobs (a batch) progresses while any of them does."""
        started = [r for r in records if _started_on(r, group_id)]
        if not started:
            self._seen.pop(group_id, None)
            return None
        mark = tuple((r.id, r.state, r.updated_at, r.progress.model_dump_json()) for r in started)
        record = min(started, key=lambda r: r.state != JobState.LOADING)
        now = self.clock()
        seen = self._seen.get(group_id)
        if seen is None or seen.mark != mark:
            self._seen[group_id] = _Seen(mark, now)
            return None
        limit_s = self.settings.stall_timeout_s
        if record.state == JobState.LOADING:
            limit_s = loading_timeout_s(limit_s)
        quiet_s = now - seen.since_s
        if quiet_s <= limit_s + WATCHDOG_GRACE_S:
            return None
        return (
            f"reported no progress for {quiet_s:.0f} s in {record.state} (limit {limit_s:g} s, "
            "RINGQ_STALL_TIMEOUT_S): stalled or stopped"
        )

    def retain(self, group_ids: Iterable[str]) -> None:
        """Forget groups that no longer have a rank here."""
        keep = set(group_ids)
        self._seen = {g: seen for g, seen in self._seen.items() if g in keep}

    def lose(self, group: GroupSpec, rank: int, process: subprocess.Popen, reason: str) -> None:
        """Report the group lost (the job is retried or failed), then kill the rank: SIGKILL,
        which a stopped process cannot defer. Its exit is then reaped as already handled."""
        why = f"rank {rank} on node {self.node} {reason}"
        outcomes = lose_group_jobs(self.store.conn, self.settings, group, why)
        for job_id, outcome in outcomes.items() or [(group.job_id, None)]:
            log.warning("job %s rank %d: %s (%s)", job_id, rank, why, outcome or "already handled")
        process.kill()
        self._seen.pop(group.group_id, None)


def _started_on(record: JobRecord, group_id: str) -> bool:
    return (
        record.state in STARTED_STATES
        and record.placement is not None
        and record.placement.group_id == group_id
    )
