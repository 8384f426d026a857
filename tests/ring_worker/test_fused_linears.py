"""Fused q/k/v and gate/up (ring_worker/engine/fused_linears.py). A decode batch over fused layers
matches each sequence alone through plain mlx-lm (logits within 1e-4, float32, CPU, over the
fidelity schedule); the projections keep their weights, as views of the fused array (no second
copy); what cannot share one matmul is left as it was."""

import gc

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ring_worker.engine import fused_linears
from ring_worker.engine.engines import Engine
from ring_worker.engine.fused_linears import FusedMLP, fuse, fuse_layers
from ring_worker.engine.rows_attention import install_rows_attention, reference_attention
from tests.ring_worker.batch_rank import run_schedule
from tests.ring_worker.test_batch_decode import check_against_alone
from tests.ring_worker.tiny import load_tiny


def test_a_fused_batch_matches_each_sequence_alone(tiny_model_dir, monkeypatch):
    model = load_tiny(tiny_model_dir)
    install_rows_attention(model, attend=reference_attention)
    assert fuse_layers(model)
    assert all(isinstance(layer.mlp, FusedMLP) for layer in model.layers)
    calls = []
    fused_call = fused_linears.Fused.__call__

    def counted(self, x, **kwargs):
        calls.append(x.shape)
        return fused_call(self, x, **kwargs)

    monkeypatch.setattr(fused_linears.Fused, "__call__", counted)
    seen, results = run_schedule(Engine(model))
    check_against_alone(tiny_model_dir, seen, {r.key: r.tokens for r in results})
    assert calls and all(shape[1] == 1 for shape in calls)  # decode steps only,
    assert all(shape[0] > 1 for shape in calls)  # of several rows


def test_fusing_keeps_every_weight_and_copies_none(tiny_model_dir):
    model = load_tiny(tiny_model_dir)
    before = dict(tree_flatten(model.parameters()))
    assert fuse_layers(model) and fuse_layers(model)  # again: nothing more to do
    after = {k.replace(".inner", ""): v for k, v in tree_flatten(model.parameters())}
    assert after.keys() == before.keys()
    assert all(mx.array_equal(after[k], before[k]).item() for k in before)

    linears = [nn.Linear(512, 1024, bias=True) for _ in range(3)]
    mx.eval([linear.parameters() for linear in linears])
    gc.collect()
    held_bytes = mx.get_active_memory()
    fused = fuse(linears)
    gc.collect()
    assert fused is not None and fused.weight.shape == (3072, 512)
    assert mx.get_active_memory() - held_bytes < 64 * 1024  # the 6 MiB of weights: not twice
    x = mx.random.normal((3, 1, 512))
    for have, linear in zip(fused(x), linears, strict=True):
        assert mx.allclose(have, linear(x), atol=1e-5).item()


def test_what_cannot_share_a_matmul_is_left_alone(tiny_model_dir):
    assert fuse([nn.Linear(8, 8, bias=True), nn.Linear(8, 8, bias=False)]) is None
    model = load_tiny(tiny_model_dir)
    nn.quantize(model, group_size=32)
    assert not fuse_layers(model)
    assert not any(isinstance(layer.mlp, FusedMLP) for layer in model.layers)
