"""Where a GPU rank's MLX peak goes (for admission's GPU terms): one process, one model, the
single-device engine, `mx.get_peak_memory()` reset before each step.

    python -m bench.probes.gpu_peak --model random:llama-3.2-1b --out probe.json
    python -m bench.probes.gpu_peak --model random:llama-3.1-8b --paced 0,2 \
        --cells 8192:8192,32768:16384,131072:16384 --out probe-paced.json

Steps: the weights alone; causal SDPA of one chunk alone; a prefill per (prompt, chunk) and per
pacing depth (`--paced`: layers in flight, ring_worker/engine/pacing.py; 0 = one graph per chunk),
with
its peak and seconds side by side (each prefill runs twice, the second timed and measured)."""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import cast

import mlx.core as mx

from jobs.model_catalog import resolve_model
from ring_worker.engine.engines import Engine
from ring_worker.engine.models import load_model
from ring_worker.engine.pacing import LAYERS_IN_FLIGHT

MIB = 1024**2


def peak_of(step) -> int:
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    step()
    mx.synchronize()
    return mx.get_peak_memory()


def measured_prefill(engine: Engine, pp: int, chunk: int) -> dict[str, object]:
    """Peak, seconds and the longest chunk's seconds of one prefill of `pp` tokens."""
    marks: list[float] = []
    started = time.perf_counter()
    peak = peak_of(
        lambda: engine.prefill(
            [1] * pp, chunk, on_progress=lambda *_: marks.append(time.perf_counter())
        )
    )
    chunk_s = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {
        "prefill_peak_bytes": peak,
        "prefill_s": round(time.perf_counter() - started, 3),
        "max_chunk_s": round(max(chunk_s), 3),
    }


def sdpa_step(model, chunk: int, past: int):
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads

    def step() -> None:
        q = mx.zeros((1, heads, chunk, head_dim), dtype=mx.bfloat16)
        k = mx.zeros((1, kv_heads, past + chunk, head_dim), dtype=mx.bfloat16)
        out = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask="causal")
        mx.eval(out)

    return step


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3.2-1b")
    parser.add_argument(
        "--cells", default="8192:4096,8192:16384,32768:4096,32768:16384,65536:16384"
    )
    parser.add_argument("--paced", default=str(LAYERS_IN_FLIGHT), help="depths, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    mx.reset_peak_memory()
    model = load_model(resolve_model(args.model, allowed_dirs=None))
    weights = mx.get_active_memory()
    rows.append({"step": "weights", "active_bytes": weights, "peak_bytes": mx.get_peak_memory()})
    engine = Engine(model)
    for cell in args.cells.split(","):
        pp, chunk = (int(v) for v in cell.split(":"))
        sdpa = peak_of(sdpa_step(model, chunk, max(pp - chunk, 0))) - mx.get_active_memory()
        for depth in (int(d) for d in args.paced.split(",")):
            engine.paced_layers = depth
            engine.prefill([1] * pp, chunk)  # shapes warm
            row: dict[str, object] = {"pp": pp, "chunk": chunk, "paced": depth}
            row |= {"sdpa_extra_bytes": sdpa, **measured_prefill(engine, pp, chunk)}
            prefill = cast(int, row["prefill_peak_bytes"])
            row["prefill_extra_mib"] = (prefill - weights) / MIB
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
