"""The join budget (ring_worker/join_budget.py) in a simulated group with modelled times, no
service: what the RINGQ_MAX_SLOWDOWN bound costs in decode throughput and buys in worst latency,
for a burst of jobs submitted together, against joining every job at once.

    uv run python -m bench.join_budget_sim

Times per cell (measured through the service, bench/results/batch-decode.md): CPU SmolLM2, a
500-token prefill 2.36 s and a decode step 85 ms + 8.3 ms per added row, 64 tokens a job; H200
8B shape, a 4K prefill 0.12 s and a step 5.5 ms + 0.49 ms per added row (engine level: the
service's mixed-length steps are slower, host-bound), 256 tokens. The group learns its times as
the service's does (JoinBudget.times: every step and prefill it runs). One at a time is the sum
of each job's prefill and one-row steps, in queue order. Prints one line per cell.
"""

import json
from collections.abc import Callable

from ring_worker.join_budget import JoinBudget, Waiting

PROMPT_TOKENS = 1000  # the modelled prefill time stands for any length

CELLS = [  # name, jobs, prefill s, step s(rows), max_tokens, max_batch
    ("cpu-smollm2", 8, 2.36, lambda n: 0.085 + 0.0083 * (n - 1), 64, 8),
    ("cpu-smollm2", 64, 2.36, lambda n: 0.085 + 0.0083 * (n - 1), 64, 8),
    ("h200-8b", 32, 0.12, lambda n: 0.0055 + 0.00049 * (n - 1), 256, 32),
    ("h200-8b", 256, 0.12, lambda n: 0.0055 + 0.00049 * (n - 1), 256, 32),
]


def simulate(
    jobs: int,
    prefill_s: float,
    step_s: Callable[[int], float],
    max_tokens: int,
    max_batch: int,
    slowdown: float | None,
) -> dict:
    budget = JoinBudget(slowdown)
    waiting = [Waiting(str(i), 0.0, PROMPT_TOKENS, max_tokens) for i in range(jobs)]
    now, members, finished = 0.0, dict[str, int](), dict[str, float]()
    while waiting or members:
        free = waiting[: max_batch - len(members)]
        for job in waiting[: budget.admit(now, dict(members), free)]:
            now += prefill_s
            budget.times.saw_prefill(PROMPT_TOKENS, prefill_s)
            budget.arrive(job, prefill_s)
            members[job.job_id] = max_tokens
        waiting = [
            job for job in waiting if job.job_id not in members and job.job_id not in finished
        ]
        step = step_s(len(members))
        budget.times.saw_step(len(members), step)
        now += step
        for job_id in list(members):
            members[job_id] -= 1
            if members[job_id] == 0:
                finished[job_id] = now
                del members[job_id]
                budget.left(job_id)
    alone = prefill_s + max_tokens * step_s(1)
    makespan, prefills = max(finished.values()), jobs * prefill_s
    decode_ratio = (jobs * alone - prefills) / (makespan - prefills)
    worst = max(finished[str(i)] / ((i + 1) * alone) for i in range(jobs))
    return {"makespan_s": round(makespan, 1), "decode_x": round(decode_ratio, 2),
            "worst_latency_x": round(worst, 2)}  # fmt: skip


def main() -> None:
    for name, jobs, prefill_s, step_s, max_tokens, max_batch in CELLS:
        for slowdown in (None, 1.5):
            found = simulate(jobs, prefill_s, step_s, max_tokens, max_batch, slowdown)
            print(json.dumps({"cell": name, "jobs": jobs, "max_slowdown": slowdown, **found}))


if __name__ == "__main__":
    main()
