"""Plain mlx-lm on one device, the baseline `ringq bench` measures ringq against (its `mlx-lm`
cells): the same weights and dtype a rank would load, prefilled and decoded by mlx-lm's own
`generate_step`, timed the way mlx-lm's `stream_generate` times it (prompt: until the first token;
generation: the tokens after it)."""

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step

from jobs.model_catalog import resolve_model
from jobs.schemas import JobResult
from ring_worker.engine.devices import cap_device_memory
from ring_worker.engine.models import load_for_this_device


def measure(model_name: str, tokens: list[int], max_tokens: int, chunk_tokens: int) -> JobResult:
    cap_device_memory()
    started = time.perf_counter()
    # `ringq bench` checked the model against RINGQ_ALLOWED_DIRS before it started this process
    model = load_for_this_device(resolve_model(model_name, allowed_dirs=None))
    load_s = time.perf_counter() - started
    steps = generate_step(
        mx.array(tokens), model, max_tokens=max(max_tokens, 1), prefill_step_size=chunk_tokens
    )
    started = time.perf_counter()
    prefill_s, generated = 0.0, 0
    for generated, _ in enumerate(steps, start=1):
        if generated == 1:
            prefill_s = time.perf_counter() - started
            started = time.perf_counter()
    decode_s = time.perf_counter() - started
    decoded = max(generated - 1, 0)
    return JobResult(
        prompt_tokens=len(tokens),
        generated_tokens=generated if max_tokens else 0,
        prompt_tps=len(tokens) / prefill_s,
        generation_tps=decoded / decode_s if decoded else 0.0,
        load_s=load_s,
        prefill_s=prefill_s,
        decode_s=decode_s,
        peak_memory_bytes=[mx.get_peak_memory()],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ring_worker.engine.baseline")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens-file", type=Path, required=True, help="JSON list of token ids")
    parser.add_argument("--max-tokens", type=int, default=0)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, required=True, help="where the JobResult JSON goes")
    args = parser.parse_args(argv)
    tokens = json.loads(args.tokens_file.read_text())
    result = measure(args.model, tokens, args.max_tokens, args.chunk_tokens)
    args.out.write_text(result.model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
