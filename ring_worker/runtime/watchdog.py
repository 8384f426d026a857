"""The stall watchdog of a rank process. A rank that makes no progress (a peer stopped, a
collective that never completes, a deadlock) would hang its group forever; instead, past its
timeout the watchdog dumps every thread's stack to the rank's log, reports why through the job,
and exits the process, so the job fails with a reason and the node agent tears the group down."""

import faulthandler
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
STALL_EXIT_CODE = 124  # like timeout(1)
MIN_LOADING_TIMEOUT_S = 600.0  # joining the group and loading weights may be slow
REPORT_TIMEOUT_S = 10.0  # how long a stalled rank tries to record why before it exits
BACKSTOP_GRACE_S = 30.0  # faulthandler's own timer fires this much later, even without the GIL
BACKSTOP_REARM_S = 1.0


def loading_timeout_s(stall_timeout_s: float) -> float:
    return max(stall_timeout_s, MIN_LOADING_TIMEOUT_S)


@dataclass(frozen=True)
class _Watch:
    phase: str
    limit_s: float
    kicked_at_s: float


class Watchdog:
    """kick() on every unit of progress; past the phase's limit without one, `on_stall(reason)`
    is called (best effort, bounded) and the process exits with STALL_EXIT_CODE."""

    def __init__(
        self,
        job_id: str,
        rank: int,
        timeout_s: float,
        on_stall: Callable[[str], None],
        exit_process: Callable[[int], object] = os._exit,
    ):
        if timeout_s <= 0:
            raise ValueError(f"stall timeout must be positive, got {timeout_s}")
        self.job_id, self.rank, self.timeout_s = job_id, rank, timeout_s
        self.on_stall, self.exit_process = on_stall, exit_process
        self._watch = _Watch("starting", timeout_s, time.monotonic())
        self._backstop_at_s = -math.inf
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ringq-watchdog")

    def start(self, phase: str, timeout_s: float | None = None) -> "Watchdog":
        self.kick(phase, timeout_s)
        self._thread.start()
        return self

    def kick(self, phase: str | None = None, timeout_s: float | None = None) -> None:
        """Progress was made. A phase resets the limit to `timeout_s` (default: the stall one)."""
        now = time.monotonic()
        watch = self._watch
        if phase is None:
            self._watch = _Watch(watch.phase, watch.limit_s, now)
        else:
            self._watch = _Watch(phase, self.timeout_s if timeout_s is None else timeout_s, now)
        if now - self._backstop_at_s >= BACKSTOP_REARM_S:
            self._backstop_at_s = now
            limit_s = self._watch.limit_s + BACKSTOP_GRACE_S
            faulthandler.dump_traceback_later(limit_s, exit=True, file=sys.stderr)

    def stop(self) -> None:
        self._done.set()
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        poll_s = min(1.0, self.timeout_s / 4)
        while not self._done.wait(poll_s):
            watch = self._watch
            stalled_s = time.monotonic() - watch.kicked_at_s
            if stalled_s > watch.limit_s:
                self._fire(watch, stalled_s)
                return

    def _fire(self, watch: _Watch, stalled_s: float) -> None:
        log.error(
            "job %s rank %d: no progress for %.1f s in %s; every thread's stack follows",
            self.job_id,
            self.rank,
            stalled_s,
            watch.phase,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        reason = (
            f"stalled for {stalled_s:.0f} s in {watch.phase}: no progress within its "
            f"{watch.limit_s:g} s limit (RINGQ_STALL_TIMEOUT_S); thread stacks are in the rank log"
        )
        log.error("job %s rank %d: %s", self.job_id, self.rank, reason)
        self._report(reason)
        sys.stderr.flush()
        self.exit_process(STALL_EXIT_CODE)

    def _report(self, reason: str) -> None:
        """on_stall in its own thread: whatever it waits on (Redis) cannot keep the rank alive."""

        def report() -> None:
            try:
                self.on_stall(reason)
            except Exception:  # best effort: the exit code and the log still say why
                log.exception("job %s rank %d: could not record the stall", self.job_id, self.rank)

        reporter = threading.Thread(target=report, daemon=True, name="ringq-watchdog-report")
        reporter.start()
        reporter.join(REPORT_TIMEOUT_S)
