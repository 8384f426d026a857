"""Compiled decode steps (ring_worker/engine/compiled_step.py) against the same steps built op by
op,
on one device: the same prefilled rows of different lengths decode `--steps` greedy tokens both
ways, with a row leaving and another joining halfway; prints the largest logit difference per
step, whether the tokens agree, and each way's pipelined step time (medians of alternating
rounds). The CPU fidelity tests hold float32 to 1e-4; this is the check on the GPU, in the
model's own dtype.

    python -m bench.probes.compiled_step --model random:llama-3.1-8b --rows 8
"""

import json
import statistics
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import click
import mlx.core as mx

from bench.decode_throughput import make_prompts
from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
from ring_worker.engine.devices import cap_device_memory
from ring_worker.engine.engines import Engine, PrefillResult
from ring_worker.engine.fused_linears import fuse_layers
from ring_worker.engine.models import load_for_this_device
from ring_worker.engine.rows_attention import install_rows_attention, reference_attention


def decode(
    engine: Engine, prefills: list[PrefillResult], joiner: PrefillResult, steps: int,
    way: str,
) -> dict[str, Any]:  # fmt: skip
    """Rows 0..n-1 decode; row 0 leaves at steps // 2, when `joiner` joins. `way`: "eager" or
    "compiled"."""
    logits: dict[str, list[mx.array]] = {}

    def record(keys: list[str], step_logits: mx.array) -> None:
        for row, key in enumerate(keys):
            logits.setdefault(key, []).append(step_logits[row])

    decoder = BatchDecoder(engine, on_logits=record, compiled=way != "eager")
    for row, prefill in enumerate(prefills):
        decoder.add(DecodeRequest(str(row), steps // 2 if row == 0 else steps), prefill)
    ends, tokens = [], {}
    for step in range(steps + 2):
        if step == steps // 2 + 1:
            decoder.add(DecodeRequest("joiner", steps // 2), joiner)
        for result in decoder.step():
            tokens[result.key] = result.tokens
        ends.append(time.perf_counter())
    tokens.update({key: [] for key in decoder.members})
    step_s = statistics.median(b - a for a, b in zip(ends[4:], ends[5:], strict=False))
    return {"logits": logits, "tokens": tokens, "step_s": step_s}


WAYS = ("compiled",)  # against eager (a third, "split", ran while "compiled" was one function)


def worst_difference(run: dict[str, Any], eager: dict[str, Any]) -> float:
    differences = [
        mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
        for key in eager["logits"]
        for a, b in zip(run["logits"][key], eager["logits"][key], strict=True)
    ]
    worst = mx.stack(differences).max().item()
    assert isinstance(worst, float)
    return worst


@click.command()
@click.option("--model", default="smollm2")
@click.option("--rows", default=8, show_default=True)
@click.option("--prompt-tokens", default=4096, show_default=True)
@click.option("--steps", default=32, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--out", type=click.Path(path_type=Path))
def main(model: str, rows: int, prompt_tokens: int, steps: int, rounds: int, out: Path | None):
    cap_device_memory()
    path = resolve_model(model, allowed_dirs=None)
    engine = Engine(load_for_this_device(path))
    if not install_rows_attention(engine.model):  # no CUDA kernels: MLX ops in their place
        install_rows_attention(engine.model, attend=reference_attention)
        fuse_layers(engine.model)
    document = load_tokenizer(path).encode(files("cli").joinpath("demo/document.md").read_text())
    prompts = make_prompts(document, rows + 1, prompt_tokens, equal=False)
    prefills = [engine.prefill(p, prompt_tokens) for p in prompts]
    timed: dict[str, list[float]] = {"compiled": [], "eager": []}
    runs = {}
    for _ in range(rounds):
        for name in timed:
            runs[name] = decode(engine, prefills[:rows], prefills[rows], steps, name)
            timed[name].append(runs[name]["step_s"])
    eager = runs["eager"]
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": model,
        "backend": "cuda" if mx.cuda.is_available() else "cpu",
        "rows": rows,
        "steps": steps,
        "max_abs_logit_diff": {way: worst_difference(runs[way], eager) for way in WAYS},
        "tokens_agree": {
            way: sum(runs[way]["tokens"][k] == eager["tokens"][k] for k in eager["tokens"])
            for way in WAYS
        },
        "sequences": len(eager["tokens"]),
        "step_ms": {name: [round(1e3 * s, 3) for s in values] for name, values in timed.items()},
        "median_step_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in timed.items()},
    }
    for way in WAYS:
        report[f"{way}_over_eager"] = round(
            report["median_step_ms"][way] / report["median_step_ms"]["eager"], 3
        )
    print(json.dumps(report))
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
