"""The chaos soak's faults, injected into a running `ringq up`: kill -9 of a rank, a node agent or
the dispatcher, Redis stopped (it fsyncs its AOF) and restarted by `up`'s supervisor, a rank
SIGSTOPped for good. Each fault knows when the service has recovered from it."""

import os
import random
import signal
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from jobs.lifecycle import JobState
from jobs.overview import RUNNING_STATES, running_jobs
from jobs.service_status import ServiceState, read_service_statuses
from jobs.store import JobStore

KINDS = {  # kind -> weight
    "rank-kill": 3,
    "rank-stop": 2,
    "agent-kill": 2,
    "dispatcher-kill": 2,
    "redis-restart": 1,
}
RECOVERY_TIMEOUT_S = 180.0
RANK_POLL_S = 0.05  # how often a rank fault looks for a busy group while it may wait for one


@dataclass(frozen=True)
class RankProcess:
    pid: int
    group_id: str
    rank: int


def rank_processes(home: Path) -> list[RankProcess]:
    """Every live rank process of this home's services (a stopped one included)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        argv = proc.info["cmdline"] or []
        if "ring_worker.rank_main" not in argv or str(home) not in " ".join(argv):
            continue
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        spec_path = Path(argv[argv.index("--group") + 1])
        found.append(
            RankProcess(proc.pid, spec_path.parent.name, int(argv[argv.index("--rank") + 1]))
        )
    return found


@dataclass
class Fault:
    kind: str
    at_s: float  # monotonic time of injection
    target: str  # the service label or "group/rank"
    pid: int
    job_id: str | None = None  # the job the killed or stopped rank was running
    group_id: str | None = None
    restarts_before: int = 0
    finished_before: int = 0
    recovered_s: float | None = None  # seconds from injection until recovered
    notes: list[str] = field(default_factory=list)

    def report(self) -> dict:
        return {
            "kind": self.kind,
            "target": self.target,
            "pid": self.pid,
            "job": self.job_id,
            "recovered_s": self.recovered_s,
            "notes": self.notes,
        }


class Injector:
    def __init__(
        self, conn: redis.Redis, home: Path, rng: random.Random, rank_patience_s: float = 0.0
    ):
        """`rank_patience_s`: how long a rank fault may look for a group in prefill or decode
        (every RANK_POLL_S) before it reports nothing to hit: small jobs spend most of their
        time starting or loading, and are in prefill or decode for a fraction of a second."""
        self.conn, self.home, self.rng = conn, home, rng
        self.rank_patience_s = rank_patience_s
        self.stopped_pids: list[int] = []

    def inject(self, kind: str, finished_before: int) -> Fault | None:
        """Inject one fault of `kind`; None when there is nothing to hit right now."""
        fault = {
            "rank-kill": lambda: self._rank_fault(kind, signal.SIGKILL, min_ranks=1),
            "rank-stop": lambda: self._rank_fault(kind, signal.SIGSTOP, min_ranks=2),
            "agent-kill": lambda: self._service_fault(kind, "node-", signal.SIGKILL),
            "dispatcher-kill": lambda: self._service_fault(kind, "dispatcher", signal.SIGKILL),
            "redis-restart": lambda: self._service_fault(kind, "redis", signal.SIGTERM),
        }[kind]()
        if fault is not None:
            fault.finished_before = finished_before
        return fault

    def _rank_fault(self, kind: str, sig: signal.Signals, min_ranks: int) -> Fault | None:
        """Hit a rank of a group that is running a job (with at least `min_ranks` ranks: a
        stopped rank is noticed by its peers' stall watchdogs)."""
        deadline_s = time.monotonic() + self.rank_patience_s
        while True:
            busy = self._busy_groups(min_ranks)  # a Redis read: cheap to repeat
            ranks = [r for r in rank_processes(self.home) if r.group_id in busy] if busy else []
            if ranks:
                break
            if time.monotonic() >= deadline_s:
                return None
            time.sleep(RANK_POLL_S)
        victim = self.rng.choice(ranks)
        try:
            os.kill(victim.pid, sig)
        except ProcessLookupError:
            return None
        if sig == signal.SIGSTOP:
            self.stopped_pids.append(victim.pid)
        target = f"{victim.group_id}/rank{victim.rank}"
        job_id = busy[victim.group_id]
        return Fault(kind, time.monotonic(), target, victim.pid, job_id, victim.group_id)

    def _busy_groups(self, min_ranks: int) -> dict[str, str]:
        """group id -> job id of the groups of at least `min_ranks` ranks in prefill or decode."""
        return {
            j.placement.group_id: j.id
            for j in running_jobs(self.conn)
            if j.placement is not None
            and len(j.placement.nodes) >= min_ranks
            and j.state in (JobState.PREFILL, JobState.DECODE)
        }

    def _service_fault(self, kind: str, label_prefix: str, sig: signal.Signals) -> Fault | None:
        statuses = [
            s
            for s in read_service_statuses(self.conn)
            if s.label.startswith(label_prefix) and s.state == ServiceState.RUNNING and s.pid
        ]
        if not statuses:
            return None
        victim = self.rng.choice(statuses)
        assert victim.pid is not None
        try:
            os.kill(victim.pid, sig)
        except ProcessLookupError:
            return None
        return Fault(
            kind, time.monotonic(), victim.label, victim.pid, restarts_before=victim.restarts
        )

    def recovered(self, fault: Fault, finished_now: int, pending: bool) -> bool:
        """The faulted part is back (service restarted; the rank's job placed again or ended)
        and, while jobs remain, one more has finished since the injection."""
        try:
            back = self._part_back(fault)
        except redis.RedisError:
            return False
        return back and (finished_now > fault.finished_before or not pending)

    def _part_back(self, fault: Fault) -> bool:
        if fault.job_id is None:
            statuses = {s.label: s for s in read_service_statuses(self.conn)}
            status = statuses.get(fault.target)
            live = (
                fault.target == "redis"
                or not fault.target.startswith("node-")
                or any(n.name == fault.target for n in JobStore(self.conn).live_nodes())
            )
            return (
                status is not None
                and status.restarts > fault.restarts_before
                and status.state == ServiceState.RUNNING
                and live
            )
        record = JobStore(self.conn).get(fault.job_id)
        moved = record.placement is not None and record.placement.group_id != fault.group_id
        return record.state.is_final or (moved and record.state in RUNNING_STATES)

    def release_stopped(self) -> list[int]:
        """SIGCONT every rank this soak stopped that still exists (its group should have killed
        it): the pids that were left behind."""
        left = []
        for pid in self.stopped_pids:
            with suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
                    os.kill(pid, signal.SIGCONT)
        return left


def pick_kind(rng: random.Random, allowed: Callable[[str], bool] = lambda _: True) -> str:
    kinds = [k for k in KINDS if allowed(k)]
    return rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
