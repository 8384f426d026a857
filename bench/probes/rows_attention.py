"""The mixed-length decode attention kernels (ring_worker/engine/rows_attention.py) on a CUDA
device:
their error against the masked reference, and their time against it and against fused SDPA over
rows of one length (the best case the mask defeats), side by side in one run.

    python -m bench.probes.rows_attention --out bench/results/h200-service/rows-attention.json

First, in a fresh process, what a batch growing from 1 to 32 rows of the 8B shape (bf16, ~4K
keys) pays on each row count's first call against its second: a new split count is a new
template variant, compiled (NVRTC) on first use, and a batch meets every one as it grows.

Cells: the 8B shape's attention (32 query heads, 8 KV heads, dim 128) at 32 rows x ~4K and
2 rows x ~128K, and SmolLM2's (9 / 3, dim 64) at 8 rows x ~500; float32 and bfloat16. Times are
the median of 5 blocks of 50 calls, each block evaluated once (one layer's attention per call).
"""

import argparse
import json
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx

from ring_worker.engine import rows_attention
from ring_worker.engine.rows_attention import kernel_attention, reference_attention, split_count

CELLS = [  # rows, heads, kv_heads, dim, shortest, longest
    (32, 32, 8, 128, 3900, 4400),
    (2, 32, 8, 128, 128000, 131000),
    (8, 9, 3, 64, 450, 520),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("rows_attention_probe: needs MLX's CUDA backend")
    from cli.bench_machine import source_revision

    first_calls = [first_call(rows) for rows in range(1, 33)]
    cells = [cell(*shape, dtype) for shape in CELLS for dtype in (mx.float32, mx.bfloat16)]
    sweep = [split_sweep(*shape) for shape in CELLS]
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "source": source_revision(),
        "mlx": version("mlx"),
        "first_calls": first_calls,
        "cells": cells,
        "split_sweep": sweep,
    }
    text = json.dumps(report, indent=1)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text)
    return 0


def inputs(rows, heads, kv_heads, dim, shortest, longest, dtype) -> tuple[mx.array, ...]:
    """A cell's queries, KV buffers (capacity rounded up to 256), rows' first columns (aligned
    at their ends, as a decode batch holds them) and lengths, from seed 0."""
    mx.random.seed(0)
    capacity = (longest + 255) // 256 * 256
    lengths = mx.linspace(shortest, longest, rows).astype(mx.int32)
    lengths[-1] = longest
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    keys = mx.random.normal((rows, kv_heads, capacity, dim)).astype(dtype)
    values = mx.random.normal((rows, kv_heads, capacity, dim)).astype(dtype)
    starts = longest - lengths
    mx.eval(q, keys, values, starts, lengths)
    return q, keys, values, starts, lengths


def cell(rows, heads, kv_heads, dim, shortest, longest, dtype) -> dict[str, Any]:
    q, keys, values, starts, lengths = inputs(rows, heads, kv_heads, dim, shortest, longest, dtype)
    scale = dim**-0.5
    want = reference_attention(q, keys, values, starts, lengths, longest, scale)
    have = kernel_attention(q, keys, values, starts, lengths, longest, scale)
    error = mx.abs(have.astype(mx.float32) - want.astype(mx.float32)).max().item()

    def fused_equal(*_: Any) -> mx.array:
        k, v = keys[:, :, :longest], values[:, :, :longest]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    times = {
        name: timed(lambda f=f: f(q, keys, values, starts, lengths, longest, scale))
        for name, f in (
            ("kernel", kernel_attention),
            ("masked", reference_attention),
            ("fused_one_length", fused_equal),
        )
    }
    result = {
        "rows": rows,
        "heads": heads,
        "kv_heads": kv_heads,
        "dim": dim,
        "dtype": str(dtype),
        "lengths": [shortest, longest],
        "splits": split_count(rows * kv_heads, longest),
        "max_abs_error": error,
        "ms_per_call": times,
        "masked_over_kernel": times["masked"] / times["kernel"],
        "kernel_over_fused_one_length": times["kernel"] / times["fused_one_length"],
    }
    print(json.dumps(result), flush=True)
    return result


def split_sweep(rows, heads, kv_heads, dim, shortest, longest) -> dict[str, Any]:
    """The bf16 kernel's time per call by split policy (TARGET_BLOCKS, MIN_SPLIT_KEYS), the
    module's own policy restored after."""
    shape = (rows, heads, kv_heads, dim, shortest, longest)
    q, keys, values, starts, lengths = inputs(*shape, mx.bfloat16)
    policy = rows_attention.TARGET_BLOCKS, rows_attention.MIN_SPLIT_KEYS
    found: dict[str, Any] = {"rows": rows, "dim": dim, "longest": longest, "ms": {}}
    try:
        for target in (512, 1024, 2048, 4096):
            for least in (64, 256):
                rows_attention.TARGET_BLOCKS, rows_attention.MIN_SPLIT_KEYS = target, least
                splits = split_count(rows * kv_heads, longest)
                ms = timed(
                    lambda: kernel_attention(q, keys, values, starts, lengths, longest, dim**-0.5)
                )
                found["ms"][f"{target}/{least}"] = {"splits": splits, "ms": ms}
    finally:
        rows_attention.TARGET_BLOCKS, rows_attention.MIN_SPLIT_KEYS = policy
    print(json.dumps(found), flush=True)
    return found


def first_call(rows: int, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict[str, Any]:
    """One call at `rows` rows, timed, then the same call again."""
    sizes = [4096 + 7 * r for r in range(rows)]
    lengths = mx.array(sizes, dtype=mx.int32)
    starts = max(sizes) - lengths
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    keys = mx.random.normal((rows, kv_heads, 4352, dim)).astype(mx.bfloat16)
    values = mx.random.normal((rows, kv_heads, 4352, dim)).astype(mx.bfloat16)
    mx.eval(q, keys, values, lengths)
    longest = max(sizes)
    found: dict[str, Any] = {"rows": rows, "splits": split_count(rows * kv_heads, longest)}
    for name in ("first_ms", "second_ms"):
        start = time.perf_counter()
        mx.eval(kernel_attention(q, keys, values, starts, lengths, longest, dim**-0.5))
        found[name] = (time.perf_counter() - start) * 1e3
    print(json.dumps(found), flush=True)
    return found


def timed(call: Any, calls: int = 50, blocks: int = 5) -> float:
    mx.eval(call())
    samples = []
    for _ in range(blocks):
        start = time.perf_counter()
        mx.eval([call() for _ in range(calls)])
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


if __name__ == "__main__":
    raise SystemExit(main())
