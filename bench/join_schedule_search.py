"""What can any order of joins reach? A search over schedules of the simulated H200 service cell
of bench.join_budget_sim (issue 14's 32 jobs x 256 tokens, the service's measured step curve, a
0.12 s prefill), or of its CPU cell (`--curve cpu`: 8 SmolLM2 jobs x 64 tokens, a 2.36 s
prefill, 85 ms a step + 8.3 ms a row), with every time known, against the join budget's own
rule told every time up front (its oracle cell).

The device does one thing at a time: a step of every member, or a joiner's prefill, which stalls
every member (a prefill on a second stream beside the steps hid nothing: bench.overlap_probe).
So a schedule is the step at which each job joins (its prefill runs just before that step; an
earlier prefill only delays more steps), and it decodes its 256 tokens in the 256 steps from
there. Decode throughput against one at a time is then the one-row step time of every token over
the summed step times (prefills excluded, as bench.batch_service counts it), and each job's
latency is its end against one at a time behind the same queue order.

The search is simulated annealing over the join steps: moves shift one job's join, or every job
from one on, by 1-100 steps; a job over the bound costs its overshoot in the score. It starts
from the best schedule found before ("job 0 alone, job 1 at step 110, job 2 at 159, job 3 at
315, the rest at 366") and from "job 0 alone, then the rest at once". Seeded: the same command
prints the same lines. `--scale` multiplies the steps of two or more rows (a cheaper step
there), to see what the goal (>= 8x decode, no job over 1.5x) needs; `--curve compiled` takes
the steps the service measured with compiled steps (bench.join_budget_sim H200_COMPILED_STEPS).

    uv run python -m bench.join_schedule_search                 # bounds 1.5, 2 and 3
    uv run python -m bench.join_schedule_search --bounds 1.5 --scale 1,0.9,0.8
    uv run python -m bench.join_schedule_search --bounds 1.5 --curve compiled
    uv run python -m bench.join_schedule_search --bounds 1.5,1.3 --curve cpu
"""

import json
import math
import random
from collections.abc import Callable

import click
import numpy as np

from bench.join_budget_sim import (
    CPU_PREFILL_S,
    H200_COMPILED_STEPS,
    H200_SERVICE_STEPS,
    cpu_smollm2_steps,
    simulate,
)

JOBS, PREFILL_S, MAX_TOKENS = 32, 0.12, 256  # the H200 cell
FOUND = [0, 110, 159, 315] + [366] * (JOBS - 4)  # the best at bound 1.5, scale 1
CPU_JOBS, CPU_MAX_TOKENS = 8, 64
CPU_FOUND = [0, 0] + [CPU_MAX_TOKENS] * (CPU_JOBS - 2)  # the best at bound 1.5


class Cell:
    """The cell's times: step seconds by member count (0 members: no step)."""

    def __init__(
        self,
        step_s: Callable[[int], float],
        jobs: int = JOBS,
        prefill_s: float = PREFILL_S,
        max_tokens: int = MAX_TOKENS,
    ):
        self.jobs, self.prefill_s, self.max_tokens = jobs, prefill_s, max_tokens
        self.step_s = np.array([0.0] + [step_s(n) for n in range(1, jobs + 1)])
        alone = prefill_s + max_tokens * self.step_s[1]
        self.alone_in_order = alone * np.arange(1, jobs + 1)

    def run(self, joins: list[int]) -> tuple[float, np.ndarray]:
        """Summed step seconds, and each job's end, when job k joins before step joins[k]."""
        starts, tokens = np.asarray(joins), self.max_tokens
        steps = starts.max() + tokens
        change = np.zeros(steps + 1, int)
        np.add.at(change, starts, 1)
        np.add.at(change, starts + tokens, -1)
        members = np.cumsum(change)[:steps]
        stall = np.zeros(steps)
        np.add.at(stall, starts, self.prefill_s)
        step_s = self.step_s[members]
        ends = np.cumsum(step_s + stall)[starts + tokens - 1]
        return float(step_s.sum()), ends

    def outcome(self, joins: list[int]) -> dict:
        stepped_s, ends = self.run(joins)
        decode = self.jobs * self.max_tokens * self.step_s[1] / stepped_s
        worst = float((ends / self.alone_in_order).max())
        return {"decode_x": round(decode, 2), "worst_latency_x": round(worst, 3)}

    def score(self, joins: list[int], bound: float) -> float:
        """Seconds of steps, plus 50 for every second any job ends past its bound."""
        stepped_s, ends = self.run(joins)
        return stepped_s + 50 * float(np.maximum(ends - bound * self.alone_in_order, 0).sum())


def anneal(cell: Cell, bound: float, start: list[int], moves: int, seed: int) -> list[int]:
    draw = random.Random(seed)
    joins, now = list(start), cell.score(start, bound)
    best, best_score = list(joins), now
    for move in range(moves):
        heat = 0.3 * (1 - move / moves) + 1e-4
        trial, job = list(joins), draw.randrange(cell.jobs)
        shift = draw.choice((-1, 1)) * draw.choice((1, 2, 5, 10, 30, 100))
        for k in range(job, cell.jobs if draw.random() < 0.5 else job + 1):
            trial[k] = max(0, trial[k] + shift)
        score = cell.score(trial, bound)
        if score <= now or draw.random() < math.exp((now - score) / heat):
            joins, now = trial, score
            if score < best_score:
                best, best_score = list(trial), score
    return best


CURVES = {"service": H200_SERVICE_STEPS, "compiled": H200_COMPILED_STEPS, "cpu": cpu_smollm2_steps}


def scaled(curve: str, factor: float) -> Callable[[int], float]:
    return lambda n: CURVES[curve](n) * (factor if n > 1 else 1.0)


def cell_for(curve: str, factor: float) -> tuple[Cell, list[int]]:
    """The curve's cell (its steps scaled by `factor` from 2 rows on) and the best schedule
    found before there."""
    steps = scaled(curve, factor)
    if curve == "cpu":
        return Cell(steps, CPU_JOBS, CPU_PREFILL_S, CPU_MAX_TOKENS), CPU_FOUND
    return Cell(steps), FOUND


@click.command()
@click.option("--bounds", default="1.5,2,3", show_default=True)
@click.option("--scale", default="1", show_default=True, help="factors for steps of 2+ rows")
@click.option("--curve", type=click.Choice(sorted(CURVES)), default="service", show_default=True)
@click.option("--moves", default=100_000, show_default=True)
@click.option("--seeds", default=2, show_default=True)
def main(bounds: str, scale: str, curve: str, moves: int, seeds: int) -> None:
    for factor in (float(f) for f in scale.split(",")):
        cell, found_before = cell_for(curve, factor)
        jobs, tokens, steps = cell.jobs, cell.max_tokens, scaled(curve, factor)
        for bound in (float(b) for b in bounds.split(",")):
            rule = simulate(jobs, cell.prefill_s, steps, tokens, jobs, bound, oracle=True)
            line = {"scale": factor, "bound": bound, "the rule (told every time)": rule}
            print(json.dumps(line), flush=True)
            flood = [0] + [tokens] * (jobs - 1)
            for name, start in {
                "found before": found_before,
                "job 0, then the rest": flood,
            }.items():
                for seed in range(seeds):
                    best = anneal(cell, bound, start, moves, seed)
                    found = {"scale": factor, "bound": bound, "start": name, "seed": seed}
                    print(json.dumps({**found, **cell.outcome(best), "joins": best}), flush=True)


if __name__ == "__main__":
    main()
