"""`ringq demo` on CPU, as a new user runs it, with the tiny random model: its ring of 2 local
nodes answers, exits 0, and says which nodes and devices the ring used. Its own RINGQ_HOME
(embedded Redis) and rank ports, like tests/cli/test_up.py."""

import os
import shutil
import subprocess
import sys

import pytest

from jobs.redis_server import shutdown_embedded
from jobs.settings import Settings
from tests.helpers import short_tmp_dir

DEMO_TIMEOUT_S = 120


@pytest.mark.slow
def test_demo_rings_over_two_cpu_nodes_and_says_so():
    home = short_tmp_dir("ringq-demo-")
    env = {k: v for k, v in os.environ.items() if k != "RINGQ_REDIS_URL"}
    env.update(
        RINGQ_HOME=str(home),
        RINGQ_RANK_PORT_BASE="36300",  # apart from the other clusters' ranks
        RINGQ_BACKEND="cpu",
        # the demo's document is 11,814 tokens: 4096-token chunks prefill it in ~20 s on two
        # loaded cores, the CPU default of 512 in ~28 s
        RINGQ_PREFILL_CHUNK_TOKENS="4096",
    )
    try:
        demo = subprocess.run(
            [sys.executable, "-m", "cli.main", "demo", "--model", "random:tiny-llama"]
            + ["--max-tokens", "4"],
            env=env,
            capture_output=True,
            text=True,
            timeout=DEMO_TIMEOUT_S,
        )
    finally:
        shutdown_embedded(Settings(home=home, redis_url=None))  # only if a failure left it up
        shutil.rmtree(home, ignore_errors=True)
    said = " ".join((demo.stdout + demo.stderr).split())  # rich wraps long lines
    assert demo.returncode == 0, said
    assert "2 node(s): demo-0, demo-1" in said
    assert "ring-2 on demo-0, demo-1 (cpu, cpu)" in said


@pytest.mark.parametrize(
    ("gpus", "backend", "ranks"),
    [((), "auto", 2), (("0",), "auto", 1), (("0", "1"), "auto", 2),
     (tuple("0123456789"), "auto", 8), (("0", "1"), "cpu", 2)],
)  # fmt: skip
def test_the_demo_uses_the_gpus_it_finds(monkeypatch, gpus, backend, ranks):
    """One GPU: single on it; several: a ring over them; none (or the CPU asked for): a ring of
    two CPU nodes."""
    from cli import services
    from jobs.settings import Settings

    monkeypatch.setattr(services, "installed_gpus", lambda: gpus)
    assert services.demo_ranks(Settings(backend=backend)) == ranks
