"""The chaos soak, short: 20 jobs through `ringq up --nodes 2` while the dispatcher, a node agent
and a rank are killed and Redis is restarted; every invariant of the full soak must hold. Its
pure parts (RSS growth, the fault mix) by table."""

import random
import shutil

import pytest

from bench.chaos.soak import Progress, SoakConfig, next_kind, rss_growth, run_soak
from tests.helpers import short_tmp_dir


@pytest.mark.slow
def test_a_short_chaos_soak_loses_nothing():
    home = short_tmp_dir("ringq-chaos-")
    config = SoakConfig(
        # 20 jobs with seed 2 still draw every distinct job of the pool (single, ring-2 and
        # pipeline-2 prefill and generate, batch lines of either kind) and one cancel; a
        # recovery waits for a job to finish, not for the load's size.
        jobs=20,
        faults=4,
        fault_kinds=("dispatcher-kill", "rank-kill", "agent-kill", "redis-restart"),
        seed=2,
        fault_gap_s=(0.5, 2.0),
        smollm2_share=0.0,
        documents_tokens=(200,),
        timeout_s=600,
        sample_s=2.0,
    )
    try:
        # Two small groups per node at a time: fewer processes started, more warm groups reused.
        env = {"RINGQ_RANK_PORT_BASE": "33900", "RINGQ_NODE_MEMORY_LIMIT_GIB": "0.6"}
        result = run_soak(config, home, env)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert result["faults_injected"] == 4, result["faults"]
    failed = {name: ok for name, ok in result["invariants"].items() if not ok}
    assert not failed, (failed, result["problems"], result["rss_growth"], result["faults"])


def sample(t_s: float, final: int, **processes: tuple[int, int]) -> dict:
    """A soak sample: each service's (pid, RSS in MB)."""
    return {
        "t_s": t_s,
        "final": final,
        "rss": {label: mb << 20 for label, (_, mb) in processes.items()},
        "pids": {label: pid for label, (pid, _) in processes.items()},
    }


def test_rss_growth_compares_each_process_with_its_own_early_samples():
    samples = [
        sample(0, 0, dispatcher=(1, 110), agent=(2, 60)),
        sample(40, 20, dispatcher=(1, 112), agent=(2, 61)),
        sample(50, 30, dispatcher=(3, 50), agent=(2, 70)),  # dispatcher restarted: cold
        sample(70, 40, dispatcher=(3, 100), agent=(2, 80)),  # still in its first 30 s
        sample(120, 90, dispatcher=(3, 105), agent=(2, 90)),
    ]
    growth = rss_growth(samples, total=100)
    assert growth == pytest.approx({"dispatcher": 105 / 100, "agent": 90 / 60})
    assert rss_growth(samples[:1], total=100) == {}  # nothing after the early part


def test_a_drawn_fault_kind_is_kept_until_a_fault_of_it_is_injected():
    config, progress = SoakConfig(jobs=10, faults=50), Progress(ids=[], cancel_at={})
    rng = random.Random(3)
    first = next_kind(config, progress, rng, now_s=0.0)
    assert [next_kind(config, progress, rng, now_s=t) for t in (1.0, 2.0, 3.0)] == [first] * 3
    assert progress.drawn_at_s == 0.0
