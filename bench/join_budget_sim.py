"""The join budget (ring_worker/join_budget.py) in a simulated group with modelled times, no
service: what the RINGQ_MAX_SLOWDOWN bound costs in decode throughput and buys in worst latency,
for a burst of jobs submitted together, against joining every job at once.

    uv run python -m bench.join_budget_sim

Times per cell (measured through the service, bench/results/batch-decode.md): CPU SmolLM2, a
500-token prefill 2.36 s and a decode step 85 ms + 8.3 ms per added row, 64 tokens a job; H200
8B shape, a 4K prefill 0.12 s and a step 5.5 ms + 0.49 ms per added row (engine level: the
service's mixed-length steps are slower, host-bound), 256 tokens; and `h200-8b-service`, the
service's own steps (H200_SERVICE_STEPS: a second row of another length +56 %) with its group's
warm-up times as the budget's start, also with each step's time drawn noisy (NOISE), and with
the budget told every step time before the first job (`oracle`: what the rule itself can reach,
learning aside), and a second burst run by the same group (`primed`: its times learned in the
first); the oracle, noisy and primed cells run with the budget's lookahead
(ring_worker/join_lookahead.py) off and on; `primed_low`, a second burst after a first whose
steps ran at 0.7x the cell's (its deadlines come out short). The group
learns its times as the service's does (JoinBudget.times: every step and prefill it runs), and
tells its budget when its batch empties, with the time of a job that ran alone (JoinBudget.emptied).
One at a time is the sum of each job's prefill and one-row steps, in queue order. Prints one line
per cell.
"""

import json
import math
import random
from collections.abc import Callable

from ring_worker.join_budget import RECENT_STEPS, JoinBudget, Waiting

PROMPT_TOKENS = 1000  # the modelled prefill time stands for any length


def measured(points: dict[int, float]) -> Callable[[int], float]:
    """Seconds per step at n rows on the straight lines between measured row counts."""
    rows = sorted(points)

    def step_s(n: int) -> float:
        low = max((r for r in rows if r <= n), default=rows[0])
        high = min((r for r in rows if r >= n), default=rows[-1])
        if low == high:
            return points[low]
        return points[low] + (points[high] - points[low]) * (n - low) / (high - low)

    return step_s


# The H200 service's steps (8B, ~4K-token rows of different lengths), as the service runs them
# (queued before the previous step's tokens are read): bench.step_cost_probe's `pipelined_ms`,
# fused linears on cuBLASLt, 2026-12-03 (h200-service/step-cost-skinny-gemv.json, "cublas"; 32
# rows from the defaults batch's rank log), and that group's warm-up times (rows of 8-24 tokens).
H200_SERVICE_STEPS = measured({1: 0.0070, 2: 0.0109, 4: 0.0139, 8: 0.0134, 16: 0.0155, 32: 0.019})
H200_SERVICE_WARM_UP = {1: 0.0043, 2: 0.00985, 4: 0.00816}
# The same with compiled steps (ring_worker/compiled_step.py): the join budget's step table at the
# end of the bounded H200 run at 8b7d522 (its group's medians of recent steps, start to start).
H200_COMPILED_STEPS = measured(
    {1: 0.0064, 2: 0.0082, 3: 0.0101, 4: 0.0127, 5: 0.0123, 6: 0.0118, 7: 0.0120, 8: 0.0114,
     12: 0.0114, 16: 0.0121, 20: 0.0128, 24: 0.0128, 30: 0.0135}
)  # fmt: skip


def cpu_smollm2_steps(n: int) -> float:
    """The CPU cell's step at n rows (SmolLM2, ~500-token rows, this 2-core machine)."""
    return 0.085 + 0.0083 * (n - 1)


CPU_PREFILL_S = 2.36  # the CPU cell's 500-token prefill

NOISE, NOISY_SEEDS = 0.15, 5  # lognormal sigma of a step's time; seeds run
WALK_STEPS, WALKS, WALK_SEEDS = 300, (0.05, 0.1), 8  # the walk's steps, its sigmas, seeds run

CELLS = [  # name, jobs, prefill s, step s(rows), max_tokens, max_batch, warm-up step times
    ("cpu-smollm2", 8, CPU_PREFILL_S, cpu_smollm2_steps, 64, 8, None),
    ("cpu-smollm2", 64, CPU_PREFILL_S, cpu_smollm2_steps, 64, 8, None),
    ("h200-8b", 32, 0.12, lambda n: 0.0055 + 0.00049 * (n - 1), 256, 32, None),
    ("h200-8b", 256, 0.12, lambda n: 0.0055 + 0.00049 * (n - 1), 256, 32, None),
    ("h200-8b-service", 32, 0.12, H200_SERVICE_STEPS, 256, 32, H200_SERVICE_WARM_UP),
]


def simulate(
    jobs: int,
    prefill_s: float,
    step_s: Callable[[int], float],
    max_tokens: int,
    max_batch: int,
    slowdown: float | None,
    warm_up: dict[int, float] | None = None,
    noise: float = 0.0,
    seed: int = 0,
    oracle: bool = False,
    joins: list[float] | None = None,
    lookahead: bool = False,
    budget: JoinBudget | None = None,
    start: float = 0.0,
    walk: float = 0.0,
) -> dict:
    """`noise`: each step's time is its modelled one times a draw from a lognormal of this
    sigma (seeded), as a shared host's steps vary. `walk`: also times a slow lognormal walk of
    this sigma (correlated over WALK_STEPS steps, started from its spread), as a GPU's step at
    the same row count read 30-40 % apart minutes apart (batch-decode.md). `oracle`: the
    budget knows every row count's step and the prefill before the first job (no learning, no
    estimates from above). `joins`, if given, gets the time each job started its prefill, in
    queue order."""
    draw = random.Random(seed)
    level, keep = draw.gauss(0.0, walk) if walk else 0.0, math.exp(-1 / WALK_STEPS)
    if budget is None:
        budget = JoinBudget(slowdown, warm_up, lookahead=lookahead)
    if oracle:
        for rows in range(1, max_batch + 1):
            for _ in range(RECENT_STEPS):
                budget.times.saw_step(rows, step_s(rows))
        budget.times.saw_prefill(PROMPT_TOKENS, prefill_s)
    waiting = [Waiting(str(i), start, PROMPT_TOKENS, max_tokens) for i in range(jobs)]
    now, members, finished = start, dict[str, int](), dict[str, float]()
    began, widest = dict[str, float](), dict[str, int]()  # each job's start, its most rows
    while waiting or members:
        free = waiting[: max_batch - len(members)]
        for job in waiting[: budget.admit(now, dict(members), free)]:
            if joins is not None:
                joins.append(now)
            began[job.job_id] = now
            now += prefill_s
            budget.times.saw_prefill(PROMPT_TOKENS, prefill_s)
            budget.arrive(job, prefill_s)
            members[job.job_id] = max_tokens
        waiting = [
            job for job in waiting if job.job_id not in members and job.job_id not in finished
        ]
        if walk:
            level = keep * level + math.sqrt(1 - keep * keep) * draw.gauss(0.0, walk)
        step = step_s(len(members)) * (draw.lognormvariate(0.0, noise) if noise else 1.0)
        step *= math.exp(level)
        budget.times.saw_step(len(members), step)
        now += step
        alone = None
        for job_id in list(members):
            members[job_id] -= 1
            widest[job_id] = max(widest.get(job_id, 0), len(members))
            if members[job_id] == 0:
                finished[job_id] = now
                if widest[job_id] == 1:
                    alone = (job_id, now - began[job_id])
                del members[job_id]
                budget.left(job_id)
        if not members:  # the batch emptied, as the service tells its budget
            budget.emptied(now, alone)
    ends = [finished[str(i)] - start for i in range(jobs)]
    return outcome(ends, prefill_s, step_s, max_tokens)


def outcome(
    finished: list[float],
    prefill_s: float,
    step_s: Callable[[int], float],
    max_tokens: int,
    digits: int | None = 2,
) -> dict:
    """Makespan, decode throughput against one at a time, and the worst job's latency against
    one at a time behind the same queue order, of jobs (in queue order) submitted at 0; rounded
    to `digits` (None: not rounded)."""
    jobs = len(finished)
    alone = prefill_s + max_tokens * step_s(1)
    makespan, prefills = max(finished), jobs * prefill_s
    decode_ratio = (jobs * alone - prefills) / (makespan - prefills)
    worst = max(end / ((i + 1) * alone) for i, end in enumerate(finished))
    if digits is None:
        return {"makespan_s": makespan, "decode_x": decode_ratio, "worst_latency_x": worst}
    return {"makespan_s": round(makespan, digits - 1), "decode_x": round(decode_ratio, digits),
            "worst_latency_x": round(worst, digits)}  # fmt: skip


def primed(step_s: Callable[[int], float], seed: int, lookahead: bool) -> dict:
    """The service cell's second burst of 32, run by the group that ran a first one (its join
    budget's times learned there; the lookahead acts only once they cover the batch it plays)."""
    budget = JoinBudget(1.5, H200_SERVICE_WARM_UP, lookahead=lookahead)
    simulate(32, 0.12, step_s, 256, 32, 1.5, noise=NOISE, seed=seed, budget=budget)
    return simulate(32, 0.12, step_s, 256, 32, 1.5, noise=NOISE, seed=seed + 100, budget=budget,
                    start=1e3)  # fmt: skip


def primed_low(seed: int, low: float = 0.7) -> dict:
    """A second burst of 32 in a group whose first burst's steps ran at `low` x the cell's (an
    H100 group read its one-row step at 5.6 ms in a burst's first steps, where its jobs alone
    then took 6.1-10.4 ms a step): its deadlines come out short."""
    steps = H200_COMPILED_STEPS
    budget = JoinBudget(1.5, H200_SERVICE_WARM_UP, lookahead=True)
    simulate(32, 0.12, lambda n: low * steps(n), 256, 32, 1.5, noise=0.05, seed=seed,
             budget=budget)  # fmt: skip
    return simulate(32, 0.12, steps, 256, 32, 1.5, noise=0.05, seed=seed + 100, budget=budget,
                    start=1e3)  # fmt: skip


def main() -> None:
    for name, jobs, prefill_s, step_s, max_tokens, max_batch, warm_up in CELLS:
        for slowdown in (None, 1.5):
            found = simulate(jobs, prefill_s, step_s, max_tokens, max_batch, slowdown, warm_up)
            print(json.dumps({"cell": name, "jobs": jobs, "max_slowdown": slowdown, **found}))
    for slowdown in (1.5, 2.0, 3.0):  # the same rule told every time up front: its own limit
        for cell, steps in (("h200-8b-service", H200_SERVICE_STEPS),
                            ("h200-8b-service-compiled", H200_COMPILED_STEPS)):  # fmt: skip
            for lookahead in (False, True):  # the greedy rule, and with its lookahead
                found = simulate(32, 0.12, steps, 256, 32, slowdown, oracle=True,
                                 lookahead=lookahead)  # fmt: skip
                print(json.dumps({"cell": cell, "oracle": True, "lookahead": lookahead,
                                  "max_slowdown": slowdown, **found}))  # fmt: skip
    for seed in range(NOISY_SEEDS):  # the service cell with steps that vary as they do on a host
        for lookahead in (False, True):
            found = simulate(32, 0.12, H200_SERVICE_STEPS, 256, 32, 1.5, H200_SERVICE_WARM_UP,
                             noise=NOISE, seed=seed, lookahead=lookahead)  # fmt: skip
            print(json.dumps({"cell": "h200-8b-service", "noise": NOISE, "seed": seed,
                              "lookahead": lookahead, **found}))  # fmt: skip
    for cell, steps in (("h200-8b-service", H200_SERVICE_STEPS),
                        ("h200-8b-service-compiled", H200_COMPILED_STEPS)):  # fmt: skip
        for seed in range(NOISY_SEEDS):  # a second burst in the same group: its times learned
            for lookahead in (False, True):
                found = primed(steps, seed, lookahead)
                print(json.dumps({"cell": cell, "primed": True, "noise": NOISE, "seed": seed,
                                  "lookahead": lookahead, **found}))  # fmt: skip
    for walk in WALKS:  # three bursts in one group, its steps on a slow walk (see simulate)
        for seed in range(WALK_SEEDS):
            budget = JoinBudget(1.5, H200_SERVICE_WARM_UP, lookahead=True)
            for burst in range(3):
                found = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, noise=0.05,
                                 seed=100 * seed + burst, budget=budget, start=1e3 * burst,
                                 walk=walk)  # fmt: skip
                print(json.dumps({"cell": "h200-8b-service-compiled", "walk": walk, "noise": 0.05,
                                  "seed": seed, "burst": burst, **found}))  # fmt: skip
    for seed in range(WALK_SEEDS):  # a second burst after a first whose steps read low
        print(json.dumps({"cell": "h200-8b-service-compiled", "primed_low": 0.7, "noise": 0.05,
                          "seed": seed, **primed_low(seed)}))  # fmt: skip


if __name__ == "__main__":
    main()
