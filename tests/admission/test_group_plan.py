"""The group plan: one pure function decides transport, exchange, devices, dtype and chunk."""

import pytest

from admission.estimate import Layout
from admission.group_plan import NodeFacts, chunk_candidates, plan_group

CPU = NodeFacts("c0", "cpu")
CPU1 = NodeFacts("c1", "cpu")
GPU0 = NodeFacts("g0", "cuda", "hostA/0")
GPU1 = NodeFacts("g1", "cuda", "hostA/1")
GPU0_SHARED = NodeFacts("g2", "cuda", "hostA/0")  # a second node on hostA's GPU 0
REMOTE0 = NodeFacts("r0", "cuda", "hostB/0")  # same index, another host: another GPU
RING2 = Layout("ring", 2)


@pytest.mark.parametrize(
    ("layout", "nodes", "exchange", "transport", "dtype", "devices"),
    [
        (Layout("single"), [CPU], "rotate", "ring", "float32", ("cpu",)),
        (Layout("single"), [GPU0], "allgather", "ring", "bfloat16", ("cuda:hostA/0",)),
        (RING2, [CPU, CPU1], "rotate", "ring", "float32", ("cpu", "cpu")),
        # a GPU per rank: all-gather over NCCL
        (RING2, [GPU0, GPU1], "allgather", "nccl", "bfloat16", ("cuda:hostA/0", "cuda:hostA/1")),
        (RING2, [GPU0, REMOTE0], "allgather", "nccl", "bfloat16", ("cuda:hostA/0", "cuda:hostB/0")),
        # two ranks on one GPU: never NCCL; the group computes on CPU (see shares_a_gpu)
        (RING2, [GPU0, GPU0_SHARED], "rotate", "ring", "float32", ("cpu", "cpu")),
        # a CPU rank in the group: the same
        (RING2, [GPU0, CPU], "rotate", "ring", "float32", ("cpu", "cpu")),
        # pipelines need send/recv: MLX's ring backend even on GPUs
        (Layout("pipeline", 2), [GPU0, GPU1], "allgather", "ring", "bfloat16", None),
    ],
)
def test_plan_table(layout, nodes, exchange, transport, dtype, devices):
    plan = plan_group(layout, nodes, model_dtype="bfloat16", chunk_tokens=512)
    assert (plan.exchange, plan.transport, plan.compute_dtype) == (exchange, transport, dtype)
    assert plan.nodes == tuple(n.name for n in nodes) and plan.ranks == layout.size
    if devices is not None:
        assert plan.devices == devices


def test_a_forced_exchange_is_kept_and_rotation_never_uses_nccl():
    plan = plan_group(
        RING2, [GPU0, GPU1], model_dtype="bfloat16", chunk_tokens=512, exchange="rotate"
    )
    assert (plan.exchange, plan.transport) == ("rotate", "ring")


def test_a_group_that_shares_a_gpu_runs_cpu_chunks():
    plan = plan_group(RING2, [GPU0, GPU0_SHARED], model_dtype="bfloat16", chunk_tokens=16384)
    assert plan.chunk_tokens == 512 and plan.nodes == ("g0", "g2")
    alone = plan_group(Layout("single"), [GPU0], model_dtype="bfloat16", chunk_tokens=16384)
    assert alone.chunk_tokens == 16384


def test_the_plan_needs_one_node_per_rank():
    with pytest.raises(ValueError, match="needs 2 nodes"):
        plan_group(RING2, [GPU0], model_dtype="bfloat16", chunk_tokens=512)


@pytest.mark.parametrize(
    ("device", "forced", "expected"),
    [
        ("cpu", None, [512]),
        ("cuda", None, [16384, 8192, 4096, 2048, 1024, 512]),
        ("metal", None, [16384, 8192, 4096, 2048, 1024, 512]),
        ("cuda", 131072, [131072]),  # RINGQ_PREFILL_CHUNK_TOKENS overrides
        ("cpu", 128, [128]),
    ],
)
def test_chunk_follows_the_device(device, forced, expected):
    assert chunk_candidates(device, forced) == expected
