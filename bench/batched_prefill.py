"""Short documents prefilled together or one after another (issue 14: "short ones batched
together where that is faster"), side by side in one process, rounds alternated:
- "together": mlx-lm's `batch_generate` prefilling every prompt in one batch (left-padded, one
  forward pass a chunk), 1 token each;
- "one by one": the same call prefilling one prompt at a time (`prefill_batch_size=1`);
- "engine": ringq's `Engine.prefill`, one prompt after another, as a batching group prefills its
  joiners (ring_worker/runtime/batch_serve.py).
Prefill tok/s = prompt tokens / prompt seconds (mlx-lm's own stats; the engine's summed prefill
times). The prompts are windows of the bundled document, 3 tokens apart in length.

    uv run python -m bench.batched_prefill                  # CPU: SmolLM2, 8 x 128 and 8 x 500
    python -m bench.batched_prefill --model random:llama-3.1-8b --lengths 256,1024,4096  # a GPU

Writes bench/results/batched-prefill-<backend>.json (--out to change).
"""

import argparse
import json
import statistics
import sys
import time
from importlib.resources import files
from pathlib import Path

from bench.decode_throughput import backend_name, make_prompts, mlx_lm_batch, reexec_with_openblas

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("together", "one_by_one", "engine")


def main() -> int:
    args = parse_args()
    reexec_with_openblas("bench.batched_prefill")
    from admission.group_plan import CPU_CHUNK_TOKENS
    from jobs.model_catalog import resolve_model
    from jobs.tokenizer import load_tokenizer
    from ring_worker.engine.devices import cap_device_memory
    from ring_worker.engine.engines import Engine
    from ring_worker.engine.models import load_for_this_device

    cap_device_memory()
    backend = backend_name()
    resolved = resolve_model(args.model, allowed_dirs=None)
    model = load_for_this_device(resolved)
    document = load_tokenizer(resolved).encode(
        files("cli").joinpath("demo/document.md").read_text()
    )
    engine, chunk_tokens = Engine(model), args.chunk_tokens or CPU_CHUNK_TOKENS
    cells = []
    for length in [int(n) for n in args.lengths.split(",")]:
        prompts = make_prompts(document, args.prompts, length, equal=False)
        mlx_lm_batch(model, prompts[:2], 1)  # kernels and shapes seen once, untimed
        engine.prefill(prompts[0], chunk_tokens)
        rounds: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            rounds["together"].append(
                mlx_lm_batch(model, prompts, 1, prefill_batch=len(prompts))["prompt_tps"]
            )
            rounds["one_by_one"].append(
                mlx_lm_batch(model, prompts, 1, prefill_batch=1)["prompt_tps"]
            )
            seconds = sum(engine.prefill(p, chunk_tokens).seconds for p in prompts)
            rounds["engine"].append(sum(map(len, prompts)) / seconds)
        tps = {name: statistics.median(values) for name, values in rounds.items()}
        cell = {
            "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts],
            "prefill_tok_s": tps,
            "together_vs_one_by_one": tps["together"] / tps["one_by_one"],
            "together_vs_engine": tps["together"] / tps["engine"],
            "rounds": rounds,
        }
        print(json.dumps({k: cell[k] for k in ("prompts", "prefill_tok_s", "together_vs_engine")}),
              file=sys.stderr, flush=True)  # fmt: skip
        cells.append(cell)
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.batched_prefill", *sys.argv[1:]]),
        "model": args.model,
        "backend": backend,
        "chunk_tokens": chunk_tokens,
        "cells": cells,
    }
    out = args.out or RESULTS / f"batched-prefill-{backend}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--lengths", default="128,500", help="prompt tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=0, help="the engine's (0: the CPU's)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
