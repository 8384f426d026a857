"""The rows matmul kernel (ring_worker/rows_matmul.py) against MLX's matmul, product by product,
at the 8B Llama's decode shapes (bf16): for each weight and row count, `--calls` independent
products are queued and evaluated together, so a call's time is the larger of its host dispatch
and its device time, as in a pipelined decode step. Medians of `--rounds` alternating rounds;
also the time to queue them (`queue_ms`: the host side), and the largest difference from MLX's
matmul, relative to the largest output. CUDA only.

    python -m bench.rows_matmul_probe --out rows-matmul-probe.json
"""

import json
import statistics
import time
from pathlib import Path

import click
import mlx.core as mx

from ring_worker.rows_matmul import kernel_fits, kernel_matmul

SHAPES = {  # outputs, inputs: the 8B's fused q/k/v, o_proj, fused gate/up, down_proj, lm_head
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def timed(product, x: mx.array, weight: mx.array, calls: int) -> tuple[float, float]:
    """Seconds per call (queued and evaluated together) and seconds to queue them, per call."""
    mx.synchronize()
    began = time.perf_counter()
    outs = [product(x * (1 + i * 1e-3), weight) for i in range(calls)]
    mx.async_eval(outs)
    queued = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    done = time.perf_counter()
    return (done - began) / calls, (queued - began) / calls


@click.command()
@click.option("--rows", default="1,2,4,8,16", show_default=True)
@click.option("--calls", default=64, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--out", type=click.Path(path_type=Path))
def main(rows: str, calls: int, rounds: int, out: Path | None) -> None:
    if not mx.cuda.is_available():
        raise click.ClickException("the rows matmul kernel runs on MLX's CUDA backend only")

    def cublas(x: mx.array, w: mx.array) -> mx.array:
        return x @ w.T

    cells = []
    for name, (outputs, inputs) in SHAPES.items():
        weight = (mx.random.normal((outputs, inputs)) * inputs**-0.5).astype(mx.bfloat16)
        for count in (int(r) for r in rows.split(",")):
            x = mx.random.normal((count, inputs)).astype(mx.bfloat16)
            ways = {"matmul": cublas}
            if kernel_fits(count, weight, x.dtype):
                ways["kernel"] = kernel_matmul
            times: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
            for _ in range(rounds + 1):  # the first round warms up (and compiles the kernel)
                for way, product in ways.items():
                    times[way].append(timed(product, x, weight, calls))
            cell = {"weight": name, "shape": [outputs, inputs], "rows": count}
            for way, found in times.items():
                cell[f"{way}_us"] = round(1e6 * statistics.median(t for t, _ in found[1:]), 1)
                cell[f"{way}_queue_us"] = round(1e6 * statistics.median(q for _, q in found[1:]), 1)
            if "kernel" in ways:
                want, have = cublas(x, weight), kernel_matmul(x, weight)
                scale = mx.abs(want.astype(mx.float32)).max()
                diff = mx.abs(have.astype(mx.float32) - want.astype(mx.float32)).max() / scale
                cell["max_rel_diff"] = round(diff.item(), 5)
                cell["kernel_over_matmul"] = round(cell["kernel_us"] / cell["matmul_us"], 3)
            print(json.dumps(cell), flush=True)
            cells.append(cell)
    if out:
        out.write_text(json.dumps({"when": time.strftime("%F %T %Z"), "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
