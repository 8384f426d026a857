"""Mixed-length decode attention (ring_worker/engine/rows_attention.py).

On the CPU the wrapper runs with `reference_attention` (MLX ops) in place of the CUDA kernels:
that checks everything around them (Q/K/V, RoPE at per-row offsets, the K/V each row stores, the
output projection) against plain mlx-lm, one sequence alone, over the fidelity schedule. The
kernels themselves are compared with the masked reference where CUDA runs (skipped elsewhere;
bench/probes/rows_attention.py does the same on the device and records it)."""

import mlx.core as mx
import pytest

from ring_worker.engine.engines import Engine
from ring_worker.engine.rows_attention import (
    RowsAttention,
    install_rows_attention,
    kernel_attention,
    kernels_available,
    reference_attention,
    split_count,
)
from tests.ring_worker.batch_rank import run_schedule
from tests.ring_worker.test_batch_decode import check_against_alone
from tests.ring_worker.tiny import load_tiny


def test_the_routed_path_matches_each_sequence_alone(tiny_model_dir):
    model = load_tiny(tiny_model_dir)
    assert install_rows_attention(model, attend=reference_attention)
    calls = []

    def attend(*args):
        calls.append(args[3].tolist())
        return reference_attention(*args)

    install_rows_attention(model, attend=attend)  # a second install re-routes, never re-wraps
    assert all(type(layer.self_attn.inner).__name__ == "Attention" for layer in model.layers)
    seen, results = run_schedule(Engine(model))
    check_against_alone(tiny_model_dir, seen, {r.key: r.tokens for r in results})
    assert calls, "the schedule's rows differ in length: the routed path must have run"
    assert any(len(set(lengths)) > 1 for lengths in calls)


def test_without_cuda_nothing_is_routed(tiny_model_dir):
    model = load_tiny(tiny_model_dir)
    routed = install_rows_attention(model)
    assert routed == kernels_available()
    assert not any(isinstance(layer.self_attn, RowsAttention) for layer in model.layers) or routed


@pytest.mark.parametrize(
    ("blocks", "longest", "splits"),
    [
        (256, 4352, 2),  # 32 rows x 8 KV heads at 4K: two splits reach 512 blocks
        (512, 4352, 1),  # already enough blocks
        (16, 131072, 32),  # 2 rows at 128K: split until 512 blocks
        (16, 1024, 4),  # short rows: no split under 256 keys
        (16, 300, 1),
    ],
)
def test_split_count(blocks, longest, splits):
    assert split_count(blocks, longest) == splits


@pytest.mark.skipif(not kernels_available(), reason="the kernels run on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_kernels_match_the_masked_reference(dtype):
    rows, heads, kv_heads, dim, capacity = 5, 8, 2, 128, 1280
    lengths = mx.array([1, 7, 300, 1100, 1201], dtype=mx.int32)
    starts = 1250 - lengths  # rows aligned at their ends, as a decode batch holds them
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    keys = mx.random.normal((rows + 2, kv_heads, capacity, dim)).astype(dtype)
    values = mx.random.normal((rows + 2, kv_heads, capacity, dim)).astype(dtype)
    args = (q, keys, values, starts, lengths, 1201, dim**-0.5)
    want = reference_attention(*args).astype(mx.float32)
    have = kernel_attention(*args).astype(mx.float32)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.abs(have - want).max().item() <= tolerance
