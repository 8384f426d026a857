"""Could a joiner's prefill run beside a batch's decode steps, not between them? (issue 14)

Today a job joins a running batch between two steps: its prefill runs whole, and every member
waits for it (~0.12 s for a 4K-token prompt of the 8B shape on an H200, ten steps). On the
GPU a decode step of a few rows is host-bound (the device finishes it before the host has built
the next), so the device idles most of each step. This probe, in one process, puts the joiner's
prefill on a second stream of the same device (`mx.new_stream`) and steps the batch on the
default one meanwhile, against the two one after the other, in alternating rounds:

- `steps_s`: --steps decode steps of a batch of --rows rows (~--prompt-tokens each) alone;
- `prefill_s`: the joiner's prefill (--joiner-tokens) alone, as the service runs it;
- `overlapped_s`: the prefill queued on the second stream, the same steps on the default one,
  then the prefill waited for.

`saved_s` is steps + prefill - overlapped (the median round's), and the JSON says whether the
overlapped prefill's last logits equal the serial one's (max abs difference). Nothing in the
service does this yet: this measures whether it would pay.

    bash bench/gpu_run.sh overlap   # the H200: 2, 8 and 24 rows of ~4K tokens
"""

import json
import statistics
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import cast

import click

from bench.decode_throughput import backend_name, reexec_with_openblas


@click.command()
@click.option("--model", default="random:tiny-llama", show_default=True)
@click.option("--rows", default=4, show_default=True)
@click.option("--prompt-tokens", default=4096, show_default=True)
@click.option("--joiner-tokens", default=4096, show_default=True)
@click.option("--steps", default=16, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--chunk-tokens", default=16384, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    model: str,
    rows: int,
    prompt_tokens: int,
    joiner_tokens: int,
    steps: int,
    rounds: int,
    chunk_tokens: int,
    out: Path | None,
) -> None:
    reexec_with_openblas("bench.probes.overlap")
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import make_prompt_cache

    from jobs.model_catalog import resolve_model
    from jobs.tokenizer import load_tokenizer
    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.devices import cap_device_memory
    from ring_worker.engine.engines import Engine
    from ring_worker.engine.models import load_for_this_device

    cap_device_memory()
    resolved = resolve_model(model, allowed_dirs=None)
    loaded = load_for_this_device(resolved)
    text = files("cli").joinpath("demo/document.md").read_text()
    ids = load_tokenizer(resolved).encode(text)
    ids = ids * -(-(prompt_tokens * rows + joiner_tokens) // len(ids))
    engine = Engine(loaded)
    decoder = BatchDecoder(engine, max_batch=rows)
    for row in range(rows):  # rows of different lengths, as a service batch's
        prompt = ids[row * 97 : row * 97 + prompt_tokens - 3 * row]
        # three phases step the batch each round and three in the untimed warm-up, plus one spare
        long_enough = DecodeRequest(str(row), max_tokens=steps * (3 * rounds + 4))
        decoder.add(long_enough, engine.prefill(prompt, chunk_tokens))
    joiner = ids[-joiner_tokens:]
    side = mx.new_stream(mx.default_device())

    def timed_steps() -> float:
        if len(decoder.members) != rows:  # a row that ended (its max or a stop) voids the round
            raise click.ClickException(f"{rows - len(decoder.members)} rows left the batch")
        began = time.perf_counter()
        for _ in range(steps):
            decoder.step()
        return time.perf_counter() - began

    def timed_prefill() -> tuple[float, mx.array]:
        began = time.perf_counter()
        found = engine.prefill(joiner, chunk_tokens).logits
        return time.perf_counter() - began, found

    def timed_overlap() -> tuple[float, mx.array]:
        began = time.perf_counter()
        with mx.stream(side):
            cache = make_prompt_cache(loaded)
            logits = loaded(mx.array(joiner)[None], cache=cache)[0, -1].astype(mx.float32)
            mx.async_eval(logits, [c.state for c in cache])
        for _ in range(steps):
            decoder.step()
        mx.eval(logits)
        return time.perf_counter() - began, logits

    def timed_sliced() -> tuple[float, mx.array]:
        """One stream: the prefill's layers queued a few at a time, each slice before a decode
        step, so the device runs it while the host builds the step (Llama-shaped models)."""
        began = time.perf_counter()
        inner, cache = loaded.model, make_prompt_cache(loaded)
        h = inner.embed_tokens(mx.array(joiner)[None])
        mask = create_attention_mask(h, cache[0])
        layers = list(zip(inner.layers, cache, strict=True))
        per_step = -(-len(layers) // steps)
        for step in range(steps):
            for layer, layer_cache in layers[step * per_step : (step + 1) * per_step]:
                h = layer(h, mask, cache=layer_cache)
            mx.async_eval(h)
            decoder.step()
        out = inner.norm(h[:, -1:])
        logits = (
            loaded.lm_head(out) if hasattr(loaded, "lm_head") else inner.embed_tokens.as_linear(out)
        )
        logits = logits[0, -1].astype(mx.float32)
        mx.eval(logits)
        return time.perf_counter() - began, logits

    timed_steps(), timed_prefill(), timed_overlap(), timed_sliced()  # compile kernels: untimed
    found: dict[str, list[float]] = {
        "steps_s": [],
        "prefill_s": [],
        "overlapped_s": [],
        "sliced_s": [],
    }
    diffs = []
    for _ in range(rounds):
        found["steps_s"].append(timed_steps())
        prefill_s, serial = timed_prefill()
        found["prefill_s"].append(prefill_s)
        overlapped_s, overlapped = timed_overlap()
        found["overlapped_s"].append(overlapped_s)
        sliced_s, sliced = timed_sliced()
        found["sliced_s"].append(sliced_s)
        for other in (overlapped, sliced):
            diffs.append(cast(float, mx.abs(serial.reshape(-1) - other.reshape(-1)).max().item()))
    median = {key: statistics.median(values) for key, values in found.items()}
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.probes.overlap", *sys.argv[1:]]),
        "backend": backend_name(),
        "model": model,
        "rows": rows,
        "steps": steps,
        "rounds": found,
        "median": median,
        "step_ms": 1e3 * median["steps_s"] / steps,
        "saved_s": median["steps_s"] + median["prefill_s"] - median["overlapped_s"],
        "sliced_saved_s": median["steps_s"] + median["prefill_s"] - median["sliced_s"],
        "hidden_share_of_prefill": (
            (median["steps_s"] + median["prefill_s"] - median["overlapped_s"]) / median["prefill_s"]
        ),
        "max_abs_logit_diff": max(diffs),
    }
    print(json.dumps(report, indent=1))
    if out is not None:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
