"""Does a decode step cost by its rows or by its buffer's slots? A compiled step
(ring_worker/compiled_step.py) runs every slot of the batch's buffers, and slots double as jobs
join and stay while the batch lives, so a batch's tail of a few rows may step as many slots as
its widest moment; the join budget keys its step times by rows. This times the same rows
(prefilled, ~--prompt-tokens each, of different lengths) stepping in buffers of as many slots as
rows and of --slots slots, alternating, one JSON line per (rows, slots) as it goes.

    python -m bench.slots_probe --model random:llama-3.1-8b --rows 2,4,8,16 --slots 32
"""

import json
import statistics
from importlib.resources import files
from pathlib import Path

import click

from bench.batch_decode import make_prompts
from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer
from ring_worker.batch_decode import time_steps
from ring_worker.devices import cap_device_memory
from ring_worker.engine import Engine, PrefillResult
from ring_worker.models import load_for_this_device


def step_ms(engine: Engine, prefills: list[PrefillResult], slots: int, steps: int) -> float:
    """Median ms between step ends of `prefills` decoding together in `slots` slots (the first
    four steps untimed)."""
    return 1e3 * time_steps(engine, prefills, slots, steps, untimed=4)


@click.command()
@click.option("--model", default="smollm2")
@click.option("--rows", default="2,4,8,16", show_default=True)
@click.option("--slots", default=32, show_default=True)
@click.option("--prompt-tokens", default=4096, show_default=True)
@click.option("--steps", default=24, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--out", type=click.Path(path_type=Path))
def main(
    model: str, rows: str, slots: int, prompt_tokens: int, steps: int, rounds: int,
    out: Path | None,
) -> None:  # fmt: skip
    cap_device_memory()
    path = resolve_model(model, allowed_dirs=None)
    engine = Engine(load_for_this_device(path))
    counts = [int(r) for r in rows.split(",")]
    document = load_tokenizer(path).encode(files("cli").joinpath("demo/document.md").read_text())
    prompts = make_prompts(document, max(counts), prompt_tokens, equal=False)
    prefills = [engine.prefill(p, prompt_tokens) for p in prompts]
    step_ms(engine, prefills[:2], 2, 8)  # kernels compiled, untimed
    found = []
    for count in counts:
        times: dict[int, list[float]] = {count: [], slots: []}
        for _ in range(rounds):
            for width in times:
                times[width].append(step_ms(engine, prefills[:count], width, steps))
        medians = {width: statistics.median(t) for width, t in times.items()}
        line = {"rows": count, "step_ms_by_slots": medians, "rounds_ms": times}
        print(json.dumps(line), flush=True)
        found.append(line)
        if out:
            out.write_text(json.dumps({"model": model, "found": found}, indent=1) + "\n")


if __name__ == "__main__":
    main()
