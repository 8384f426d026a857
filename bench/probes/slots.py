"""Does a decode step cost by its rows or by its buffer's slots? A compiled step
(ring_worker/engine/compiled_step.py) runs every slot of the batch's buffers, and slots double as
jobs
join and stay while the batch lives, so a batch's tail of a few rows may step as many slots as
its widest moment; the join budget keys its step times by rows. This times the same rows
(prefilled, ~--prompt-tokens each, of different lengths) stepping in buffers of as many slots as
rows and of --slots slots, alternating, one JSON line per (rows, slots) as it goes.

Since `94bf51c` the buffers halve as rows leave (BatchDecoder). With --shrink, it also times
what that costs once: --slots rows step together, half of them leave, and the gaps between step
ends are given before the leave, at it (the copy to half the slots, and the compiled step's new
trace), and after, in half the slots.

    python -m bench.probes.slots --model random:llama-3.1-8b --rows 2,4,8,16 --slots 32 [--shrink]
"""

import itertools
import json
import statistics
import time
from importlib.resources import files
from pathlib import Path

import click

from bench.decode_throughput import make_prompts
from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest, time_steps
from ring_worker.engine.devices import cap_device_memory
from ring_worker.engine.engines import Engine, PrefillResult
from ring_worker.engine.models import load_for_this_device


def step_ms(engine: Engine, prefills: list[PrefillResult], slots: int, steps: int) -> float:
    """Median ms between step ends of `prefills` decoding together in `slots` slots (the first
    four steps untimed)."""
    return 1e3 * time_steps(engine, prefills, slots, steps, untimed=4)


def shrink_gaps(engine: Engine, prefills: list[PrefillResult], steps: int) -> dict:
    """`prefills` (a power of two of them, 4 or more) decode together in as many slots; half
    leave at call `steps`, and the buffers halve there. Ms between step ends: the median before
    (the first four gaps untimed), the three gaps from the leave's on, and the median after."""
    decoder, half = BatchDecoder(engine), len(prefills) // 2
    for row, prefill in enumerate(prefills):
        decoder.add(DecodeRequest(str(row), steps if row % 2 else 3 * steps), prefill)
    ends, slots = [], []
    for _ in range(2 * steps):
        decoder.step()
        ends.append(time.perf_counter())
        slots.append(decoder.cache.slots)
    decoder.run()
    gaps = [1e3 * (b - a) for a, b in itertools.pairwise(ends)]  # gaps[k]: call k + 1's gap
    at = slots.index(half)  # the call the rows left in (its gap is gaps[at - 1])
    before, after = statistics.median(gaps[4 : at - 1]), statistics.median(gaps[at + 3 :])
    return {"slots": [len(prefills), half], "before_ms": before, "at_ms": gaps[at - 1 : at + 2],
            "after_ms": after}  # fmt: skip


@click.command()
@click.option("--model", default="smollm2")
@click.option("--rows", default="2,4,8,16", show_default=True)
@click.option("--slots", default=32, show_default=True)
@click.option("--prompt-tokens", default=4096, show_default=True)
@click.option("--steps", default=24, show_default=True)
@click.option("--rounds", default=2, show_default=True)
@click.option("--shrink", is_flag=True, help="also time the buffers halving as rows leave")
@click.option("--out", type=click.Path(path_type=Path))
def main(
    model: str, rows: str, slots: int, prompt_tokens: int, steps: int, rounds: int,
    shrink: bool, out: Path | None,
) -> None:  # fmt: skip
    cap_device_memory()
    path = resolve_model(model, allowed_dirs=None)
    engine = Engine(load_for_this_device(path))
    counts = [int(r) for r in rows.split(",")]
    document = load_tokenizer(path).encode(files("cli").joinpath("demo/document.md").read_text())
    most = max([*counts, slots if shrink else 0])
    prompts = make_prompts(document, most, prompt_tokens, equal=False)
    prefills = [engine.prefill(p, prompt_tokens) for p in prompts]
    step_ms(engine, prefills[:2], 2, 8)  # kernels compiled, untimed
    found: list[dict] = []

    def record(line: dict) -> None:
        print(json.dumps(line), flush=True)
        found.append(line)
        if out:
            out.write_text(json.dumps({"model": model, "found": found}, indent=1) + "\n")

    for count in counts:
        times: dict[int, list[float]] = {count: [], slots: []}
        for _ in range(rounds):
            for width in times:
                times[width].append(step_ms(engine, prefills[:count], width, steps))
        medians = {width: statistics.median(t) for width, t in times.items()}
        record({"rows": count, "step_ms_by_slots": medians, "rounds_ms": times})
    for _ in range(rounds if shrink else 0):
        record({"shrink": shrink_gaps(engine, prefills[:slots], steps)})


if __name__ == "__main__":
    main()
