"""Where a GPU rank's MLX peak goes (for admission's GPU terms): one process, one model, the
single-device engine, `mx.get_peak_memory()` reset before each step.

    python -m bench.gpu_peak_probe --model random:llama-3.2-1b --out probe.json

Steps: the weights alone; causal SDPA of one chunk alone; a prefill per (prompt, chunk)."""

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

from jobs.model_catalog import resolve_model
from ring_worker.engine import Engine
from ring_worker.models import load_model

MIB = 1024**2


def peak_of(step) -> int:
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    step()
    mx.synchronize()
    return mx.get_peak_memory()


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
        sdpa = peak_of(sdpa_step(model, chunk, pp - chunk)) - mx.get_active_memory()
        prefill = peak_of(lambda pp=pp, chunk=chunk: engine.prefill([1] * pp, chunk))
        row: dict[str, object] = {"pp": pp, "chunk": chunk, "sdpa_extra_bytes": sdpa}
        row["prefill_peak_bytes"] = prefill
        row["prefill_extra_mib"] = (prefill - weights) / MIB
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
