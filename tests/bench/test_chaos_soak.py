"""The chaos soak, short: 40 jobs through `ringq up --nodes 2` while the dispatcher, a node agent
and a rank are killed and Redis is restarted; every invariant of the full soak must hold."""

import shutil

import pytest

from bench.chaos_soak import SoakConfig, run_soak
from tests.helpers import short_tmp_dir


@pytest.mark.slow
def test_a_short_chaos_soak_loses_nothing():
    home = short_tmp_dir("ringq-chaos-")
    config = SoakConfig(
        jobs=40,
        faults=4,
        fault_kinds=("dispatcher-kill", "rank-kill", "agent-kill", "redis-restart"),
        seed=1,
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
