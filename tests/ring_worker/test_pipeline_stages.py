"""How the pipeline strategy splits a model (pure; the multi-process runs are in
test_ring_equivalence.py)."""

import pytest

from admission.partition import split_layers
from jobs.model_catalog import resolve_model
from ring_worker.engine.models import load_model
from ring_worker.engine.pipeline import keep_stage


@pytest.mark.parametrize(
    ("layers", "size", "ranges"),
    [
        (4, 2, [(0, 2), (2, 4)]),
        (5, 2, [(0, 3), (3, 5)]),
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
        (7, 1, [(0, 7)]),
    ],
)
def test_split_layers_is_contiguous_and_even(layers, size, ranges):
    assert [(r.start, r.stop) for r in split_layers(layers, size)] == ranges


@pytest.mark.parametrize(("layers", "size"), [(2, 3), (4, 0)])
def test_split_layers_refuses_impossible_pipelines(layers, size):
    with pytest.raises(ValueError, match="needs at least"):
        split_layers(layers, size)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_each_stage_keeps_only_what_it_runs(rank):
    model = load_model(
        resolve_model("random:tiny-llama", allowed_dirs=None),
        prune=lambda m: keep_stage(m, rank, 3),
    )
    layers = keep_stage(model, rank, 3)  # idempotent for the same stage
    assert len(model.model.layers) == len(layers) == (2 if rank == 0 else 1)
    tied = model.args.tie_word_embeddings
    assert ("embed_tokens" in model.model) == (rank == 0 or (rank == 2 and tied))
    with pytest.raises(ValueError, match="already holds layers"):
        keep_stage(model, (rank + 1) % 3, 3)
