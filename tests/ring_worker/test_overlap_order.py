"""Regression test for the rotate exchange's overlap: every receive is posted (async) before the
eval that waits on the current block's attention, and that eval waits on both together."""

import json

import pytest

from ring_worker.engine.group import free_loopback_ports
from ring_worker.runtime.processes import rank_environment, spawn_rank, wait_all
from tests.ring_worker.tiny import save_tiny


@pytest.mark.parametrize("size", [2, 3])
def test_receives_are_posted_before_compute_is_awaited(tmp_path, size):
    model_dir = save_tiny(tmp_path / "model", "llama")
    addresses = json.dumps([f"127.0.0.1:{p}" for p in free_loopback_ports(size)])
    procs = [
        spawn_rank(
            [
                "-m",
                "tests.ring_worker.order_rank",
                str(model_dir),
                str(r),
                addresses,
                str(tmp_path),
            ],
            rank_environment(threads=1),
        )
        for r in range(size)
    ]
    assert wait_all(procs, timeout_s=120) == [0] * size
    layers = 2
    for rank in range(size):
        events = json.loads((tmp_path / f"events-rank{rank}.json").read_text())
        recvs = [i for i, e in enumerate(events) if e["op"] == "recv"]
        assert len(recvs) == 2 * (size - 1) * layers  # k and v, every step but the last, per layer
        for index in recvs:
            received = events[index]["out"]
            posted = next(j for j in range(index, len(events)) if events[j]["op"] == "async_eval")
            assert received in events[posted]["ids"], "receive not posted asynchronously"
            waited = next(
                j
                for j in range(posted, len(events))
                if received in events[j]["ids"] and events[j]["op"] == "eval"
            )
            between = [e["op"] for e in events[posted + 1 : waited]]
            assert "eval" not in between, f"rank {rank}: something waited before the receive"
            assert len(events[waited]["ids"]) > 4, "the wait holds no compute to overlap with"
