"""The stall watchdog: in-process with an injected exit, then for real: a service whose ring
loses a rank to SIGSTOP mid-prefill must fail the job with a reason and leave no process."""

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import suppress

import pytest

from cli.services import LocalCluster
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from ring_worker.runtime.watchdog import STALL_EXIT_CODE, Watchdog
from tests.helpers import (
    LONG_DOCUMENT,
    final_record,
    in_prefill,
    private_cluster,
    rank_pid,
    rank_processes,
    wait_for,
)

STALL_TIMEOUT_S = 3


class Recorder:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.exit_codes: list[int] = []
        self.exited = threading.Event()

    def exit(self, code: int) -> None:
        self.exit_codes.append(code)
        self.exited.set()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    yield Recorder()


def test_watchdog_without_kicks_dumps_threads_reports_and_exits(recorder, capfd):
    watchdog = Watchdog("job-1", 1, 0.3, recorder.reasons.append, recorder.exit)
    try:
        watchdog.start("prefill")
        assert recorder.exited.wait(5)
    finally:
        watchdog.stop()
    assert recorder.exit_codes == [STALL_EXIT_CODE]
    assert len(recorder.reasons) == 1 and recorder.reasons[0].startswith(
        "stalled for 0 s in prefill"
    )
    err = capfd.readouterr().err
    assert "most recent call first" in err and "test_watchdog.py" in err  # this thread, waiting


def test_kicks_keep_the_watchdog_quiet_and_a_phase_has_its_own_limit(recorder):
    # A 1 s limit against kicks every 0.1 s: a loaded machine may stretch the gaps 10x.
    watchdog = Watchdog("job-1", 0, 1.0, recorder.reasons.append, recorder.exit)
    try:
        watchdog.start("loading", timeout_s=30)
        time.sleep(1.5)  # past the stall limit, within the loading one (the time is the test)
        for _ in range(12):
            watchdog.kick("prefill")
            time.sleep(0.1)
        assert not recorder.exited.is_set()
        assert recorder.exited.wait(5)  # no more kicks: the prefill limit applies
    finally:
        watchdog.stop()
    assert "in prefill" in recorder.reasons[0]


def test_watchdog_rejects_a_non_positive_timeout(recorder):
    with pytest.raises(ValueError, match="got 0"):
        Watchdog("job-1", 0, 0, recorder.reasons.append, recorder.exit)


@pytest.fixture(scope="module")
def stall_cluster() -> Iterator[LocalCluster]:
    """Ranks inherit a short RINGQ_STALL_TIMEOUT_S from their node agents."""
    env = {
        "RINGQ_STALL_TIMEOUT_S": str(STALL_TIMEOUT_S),
        "RINGQ_PREFILL_CHUNK_TOKENS": "64",
        "RINGQ_RANK_PORT_BASE": "31700",  # apart from the other clusters' ranks
        # Heartbeats as tests/jobs/test_crash_recovery.py's: the retry is placed once a node
        # lost with the group would be stale, 2.5 s after the stall rather than 7 s.
        "RINGQ_NODE_HEARTBEAT_S": "0.5",
        "RINGQ_NODE_TTL_S": "3",
    }
    with private_cluster("stall", env) as running:
        yield running


def test_a_stopped_peer_is_found_by_the_stall_watchdog_and_the_job_retried(
    stall_cluster, tiny_llama_dir
):
    store = JobStore(connect(stall_cluster.url))
    spec = JobSpec(kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(tiny_llama_dir), ranks=2)
    record = submit_job(store.conn, spec)
    record = wait_for(lambda: in_prefill(store.get(record.id)), "prefill to start")
    group_id = record.placement.group_id
    peer = rank_pid(group_id, 1)
    os.kill(peer, signal.SIGSTOP)  # rank 0 blocks in its next ring exchange
    try:
        wait_for(lambda: store.get(record.id).attempt == 1, "the stall to be found")
        wait_for(lambda: not rank_processes(group_id), "the node agents to end the ranks")
    finally:
        with suppress(ProcessLookupError):
            os.kill(peer, signal.SIGCONT)
    final = wait_for(lambda: final_record(store, record.id), "the retry to end", timeout_s=120)
    assert final.state == JobState.FINISHED, final.error
    [reason] = final.retry_reasons
    stall = re.match(r"rank 0 \(stall-\d\): stalled for (\d+) s in prefill", reason)
    assert stall and STALL_TIMEOUT_S <= int(stall[1]) <= 2 * STALL_TIMEOUT_S, reason
    log = (stall_cluster.settings.home / "logs" / f"{group_id}-rank0.log").read_text()
    assert "every thread's stack follows" in log and "most recent call first" in log
    assert "ring_worker/engine/engines.py" in log  # the main thread's stack: where it was stuck
