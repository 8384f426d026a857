from dataclasses import replace

import pytest

from admission.estimate import Layout, activation_bytes, estimate_node_bytes
from admission.model_shape import ModelShape
from admission.placement import CannotPlace, NodeCapacity, PlacementRequest, plan_placement

GIB = 1024**3
SHAPE = ModelShape(
    architecture="llama",
    layers=30,
    hidden_size=576,
    intermediate_size=1536,
    q_heads=9,
    kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    context_length=8192,
    weight_bytes=100 * 1024**2,
    dense_weight_bytes=540 * 1024**2,
    compute_dtype_bytes=4,
)


def request(tokens=2000, ranks=None, strategy="auto", kv_layout="auto"):
    return PlacementRequest(
        prompt_tokens=tokens,
        max_new_tokens=100,
        chunk_tokens=512,
        ranks=ranks,
        strategy=strategy,
        ring_min_tokens=1024,
        kv_layout=kv_layout,
    )


def nodes(*gib):
    return [NodeCapacity(f"n{i}", int(g * GIB), dense_weights=True) for i, g in enumerate(gib)]


def gpus(*gib):
    return [NodeCapacity(f"g{i}", int(g * GIB), dense_weights=False) for i, g in enumerate(gib)]


def test_kv_bytes_follow_the_formula():
    est = estimate_node_bytes(SHAPE, 1000, 24, Layout("ring", 2), 512, dense_weights=True)
    assert est.kv_bytes == 2 * 30 * 3 * 64 * 4 * 1024
    assert est.weights_bytes == SHAPE.dense_weight_bytes


def test_quantized_nodes_count_stored_weights():
    est = estimate_node_bytes(SHAPE, 1000, 0, Layout("single"), 512, dense_weights=False)
    assert est.weights_bytes == SHAPE.weight_bytes


@pytest.mark.parametrize(
    ("req", "live", "strategy", "count"),
    [
        (request(tokens=100), nodes(8, 8), "single", 1),  # short prompt: one node
        (request(tokens=4000), nodes(8, 8), "ring", 2),  # long prompt: every live node
        (request(tokens=4000), nodes(8, 0.1), "single", 1),  # only one node has room
        (request(ranks=2), nodes(8, 8, 8), "ring", 2),
        (request(strategy="single", tokens=4000), nodes(8, 8), "single", 1),
        (request(strategy="ring", tokens=10), nodes(8, 8, 8), "ring", 2),  # fewest that fit
        (request(strategy="pipeline", ranks=3), nodes(8, 8, 8), "pipeline", 3),
        (request(strategy="pipeline"), nodes(8, 8), "pipeline", 2),
    ],
)
def test_plans(req, live, strategy, count):
    plan = plan_placement(SHAPE, req, live)
    assert plan.strategy == strategy and len(plan.nodes) == count


def test_pipeline_ranks_hold_their_share_of_weights_and_kv():
    ring = estimate_node_bytes(SHAPE, 1000, 24, Layout("ring", 3), 512, dense_weights=True)
    pipeline = estimate_node_bytes(SHAPE, 1000, 24, Layout("pipeline", 3), 512, dense_weights=True)
    # a third of the layers, plus the embedding (rank 0; the last rank too, the head is tied)
    embedding_bytes = 4 * SHAPE.embedding_parameters
    layer_share = (SHAPE.dense_weight_bytes - embedding_bytes) * 10 // 30
    assert pipeline.weights_bytes == pytest.approx(layer_share + embedding_bytes, 1e-3)
    assert pipeline.kv_bytes == ring.kv_bytes * 10 // 30
    assert pipeline.activation_bytes > ring.activation_bytes  # whole chunks, not 1/N of them


def test_a_pipeline_longer_than_the_model_is_refused():
    with pytest.raises(CannotPlace, match="a pipeline of 31 needs 31 layers; the model has 30"):
        plan_placement(SHAPE, request(strategy="pipeline", ranks=31), nodes(*[8] * 31))


def test_largest_nodes_first():
    plan = plan_placement(SHAPE, request(ranks=1), nodes(2, 8, 4))
    assert plan.nodes == ("n1",)


def test_preferred_nodes_first_among_those_that_fit():
    """A node holding the job's kept prefix goes first, if it fits."""
    prefer = replace(request(ranks=1), preferred_nodes=("n2",))
    assert plan_placement(SHAPE, prefer, nodes(2, 8, 4)).nodes == ("n2",)
    too_small = replace(request(ranks=1), preferred_nodes=("n0",))
    assert plan_placement(SHAPE, too_small, nodes(0.01, 8, 4)).nodes == ("n1",)


@pytest.mark.parametrize(
    ("req", "live", "message"),
    [
        (request(), [], "no live nodes"),
        (request(ranks=3), nodes(8, 8), "needs 3 nodes; 2 live"),
        (request(kv_layout="replicated"), nodes(0.2, 0.3), r"tried ring-2 \(replicated KV\)"),
        (request(strategy="ring"), nodes(8), "at least 2 nodes"),
        (request(), nodes(0.2, 0.3), r"n0: needs .* GiB .* has 0.20 GiB"),
    ],
)
def test_cannot_place(req, live, message):
    with pytest.raises(CannotPlace, match=message):
        plan_placement(SHAPE, req, live)


# A 8 GiB-weights model with a big KV: 2 · 32 layers · 8 heads · 128 · 2 bytes = 128 KiB/token.
BIG = ModelShape(
    architecture="llama",
    layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    context_length=131072,
    weight_bytes=8 * GIB,
    dense_weight_bytes=8 * GIB,
    compute_dtype_bytes=2,
)


@pytest.mark.parametrize(
    ("tokens", "live", "label"),
    [
        (100_000, gpus(40, 40), "ring-2 (replicated KV)"),  # 8 + 12.2 GiB KV fit everywhere
        (100_000, gpus(20, 20), "ring-2 (sharded KV)"),  # the whole KV does not, half does
        (100_000, gpus(15, 15), "pipeline-2"),  # weights + half the KV: only split by layers
        (100_000, gpus(10, 10, 10, 10), "pipeline-4"),  # no ring of 4 fits, 1/4 of the layers does
        (100, gpus(40, 40), "single"),  # short prompt: the fewest nodes
    ],
)
def test_layout_follows_memory(tokens, live, label):
    req = PlacementRequest(tokens, 0, 2048, None, "auto", 1024)
    assert plan_placement(BIG, req, live).layout.label == label


def test_cpu_nodes_count_the_attention_scores_they_materialise():
    """MLX's CPU attention holds q_heads x chunk x keys float32 scores; GPU attention is fused."""
    cpu = activation_bytes(BIG, Layout("single"), 100_000, 2048, cpu=True)
    gpu = activation_bytes(BIG, Layout("single"), 100_000, 2048, cpu=False)
    assert cpu - gpu >= 32 * 2048 * 100_000 * 4


def test_sharded_kv_is_about_one_nth():
    replicated = estimate_node_bytes(BIG, 100_000, 0, Layout("ring", 4), 2048, dense_weights=True)
    sharded = estimate_node_bytes(
        BIG, 100_000, 0, Layout("ring", 4, "sharded"), 2048, dense_weights=True
    )
    assert replicated.kv_bytes / 4 <= sharded.kv_bytes <= replicated.kv_bytes / 4 * 1.1
