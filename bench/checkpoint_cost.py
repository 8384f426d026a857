"""What a prefill checkpoint costs against the prefill it protects, to choose the default
RINGQ_CHECKPOINT_TOKENS (one process, one device, mlx-lm's own chunked prefill).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        uv run python -m bench.checkpoint_cost --model smollm2 --tokens 8192

At every chunk boundary: the chunk's prefill time, then (outside that time) what a checkpoint
segment of that chunk costs: `snapshot` (on the compute path: evaluated copies of the chunk's
new KV) and the write (the writer thread's work: the segment's `save`).
Checkpoints write only what was added since the last (ring_worker/engine/checkpoint.py), so one
every
E tokens writes the same bytes as E / chunk of these segments, in fewer files: summing them is
an upper bound of its cost. From those, for each interval E and prompt length L: the
checkpoints' cost over the prefill's, with the write counted in full (on a CPU node the writer
shares the cores) and without (a GPU's compute does not wait for the disk). Writes
bench/results/checkpoint-cost-<model>-<tokens>.json.
"""

import json
import os
import tempfile
import time
from pathlib import Path

import click
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from jobs.model_catalog import resolve_model
from ring_worker.engine.checkpoint import snapshot
from ring_worker.engine.models import load_for_this_device

OUT = Path(__file__).parent / "results"
INTERVALS = (512, 1024, 2048, 4096, 8192, 16384)


def measure(model_name: str, tokens: int, chunk_tokens: int, folder: Path) -> list[dict]:
    """Per chunk boundary: position, chunk prefill s, and its segment's snapshot s, write s and
    bytes."""
    model = load_for_this_device(resolve_model(model_name, allowed_dirs=None))
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (tokens,), key=mx.random.key(0))
    cache = make_prompt_cache(model)
    path = folder / "segment.safetensors"
    rows, offset = [], 0
    for start in range(0, tokens, chunk_tokens):
        chunk = prompt[start : start + chunk_tokens][None]
        started = time.perf_counter()
        mx.eval(model(chunk, cache=cache)[:, -1, :], [c.state for c in cache])
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        segment = snapshot(cache, offset)
        offset = cache[0].offset
        snapshot_s = time.perf_counter() - started
        started = time.perf_counter()
        segment.save(path, {"tokens": str(start + chunk.shape[1])})
        write_s = time.perf_counter() - started
        rows.append(
            {
                "tokens": start + chunk.shape[1],
                "prefill_s": prefill_s,
                "snapshot_s": snapshot_s,
                "write_s": write_s,
                "bytes": path.stat().st_size,
            }
        )
    return rows


def overhead(rows: list[dict], every: int, upto: int, with_write: bool) -> float:
    """Checkpoint cost over prefill time for a prompt of `upto` tokens, one every `every`
    (none after the last: a finished prefill needs none): the segments up to the last
    checkpoint, an upper bound (see the module docstring)."""
    prefill = sum(r["prefill_s"] for r in rows if r["tokens"] <= upto)
    last = max((r["tokens"] for r in rows if r["tokens"] % every == 0 and r["tokens"] < upto),
               default=0)  # fmt: skip
    cost = sum(
        r["snapshot_s"] + (r["write_s"] if with_write else 0.0) for r in rows if r["tokens"] <= last
    )
    return cost / prefill


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--tokens", default=8192, show_default=True)
@click.option("--chunk", "chunk_tokens", default=512, show_default=True)
def main(model: str, tokens: int, chunk_tokens: int) -> None:
    """Measure (see the module docstring) and write the JSON."""
    with tempfile.TemporaryDirectory(prefix="ringq-ckpt-cost-") as folder:
        rows = measure(model, tokens, chunk_tokens, Path(folder))
    lengths = sorted({min(tokens, n) for n in (2048, 4096, 8192, tokens)})
    table = {
        str(every): {
            str(upto): {
                "with_write": overhead(rows, every, upto, True),
                "compute_path_only": overhead(rows, every, upto, False),
            }
            for upto in lengths
        }
        for every in INTERVALS
        if every < tokens
    }
    result = {
        "model": model,
        "device": str(mx.default_device()),
        "blas": os.environ.get("LD_PRELOAD", "MLX's own"),
        "chunk_tokens": chunk_tokens,
        "prefill_s_per_token": sum(r["prefill_s"] for r in rows) / tokens,
        "write_s_per_token_written": sum(r["write_s"] for r in rows) / tokens,
        "snapshot_s_per_token": sum(r["snapshot_s"] for r in rows) / tokens,
        "write_bytes_per_token": sum(r["bytes"] for r in rows) / tokens,
        "write_bytes_per_s": sum(r["bytes"] for r in rows) / sum(r["write_s"] for r in rows),
        "overhead": table,
        "rows": rows,
        "load_avg_1m": os.getloadavg()[0],
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    name = f"checkpoint-cost-{model.replace(':', '-')}-{tokens}.json"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(result, indent=1))
    click.echo(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    click.echo(f"written: {OUT / name}")


if __name__ == "__main__":
    main()
