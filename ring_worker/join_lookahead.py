"""Should the head of the queue join the batch now, or later? A lookahead for the join budget
(ring_worker/join_budget.py), pure.

The budget's rule alone is greedy: a job joins as soon as every member still makes its deadline.
For a burst of jobs that spends the first members' slack on a trickle of joins, and the jobs
after them then wait for those to finish, in a long tail of small batches. In the simulated H200
service cell (32 jobs x 256 tokens; bench.join_schedule_search) the greedy rule reached 6.68x
decode at a 1.5x bound with the service's compiled step times, where a schedule at 8.05x exists
(job 0 alone a while, jobs 1-3 one by one, the other 28 together once job 1 ends).

So before a join the budget can play the rest forward twice, by its own times and with its
greedy rule from then on: with the head joining now, and with it held for HOLD_STEPS steps. It
joins now unless holding is feasible (every job of the batch and the queue within its deadline)
and finishes everything in fewer step-seconds, or joining now is not feasible. A rollout
advances in chunks of CHUNK_STEPS steps (a join waits for a chunk's end).

Measured in bench.join_budget_sim (32 jobs, bound 1.5): told every time up front, 8.17x decode at
1.47x worst with the compiled step curve (the rule: 6.68x) and 6.51x with the eager one (5.73x).
In a group's first burst, learning its times, it gained nothing and with noisy steps lost 10-20 %
(compiled curve: 5.0-5.9x against 6.1-6.6x): a rollout took the budget's estimates from above
for batch sizes not seen yet (a flood of 28 looked dear). So the budget consults it only once
the group has measured steps at 3/4 of the rows a rollout would play (GroupTimes.covers), which
a warm group's later bursts have. There, with noisy steps (the `primed` cells, 5 seeds), it
reached 7.2-8.2x at 1.41-1.54x with the compiled curve against the rule's 6.3-6.6x at
1.42-1.54x, and 6.1-6.5x against 5.4-5.8x with the eager one. On an H100 through the service
(bench.batch_service --prime at tree 5ef4618, now --rounds' later bursts; one run each): 8.02x
at 1.39x worst, the rule 7.85x at 1.61x; job 0 finished 3.17-3.18 s after submission in both,
and the ratios differ by its one-at-a-time reference (2.29 s against 1.97 s),
bench/results/batch-decode.md.
"""

from collections.abc import Callable
from dataclasses import dataclass

HOLD_STEPS = 16  # how long a held join waits before it is weighed again
CHUNK_STEPS = 8  # steps a rollout advances at a time


@dataclass(frozen=True)
class Plan:
    """The group's times and rule, as a rollout uses them."""

    step_s: Callable[[int], float]  # seconds a step at n rows
    prefill_s: Callable[[int], float]  # seconds to prefill n prompt tokens
    deadline: Callable[[str], float]  # a job's deadline (unix time; inf where it has none)
    margin: float  # projected times are stretched by this (the rule's PLAN_MARGIN)


@dataclass(frozen=True)
class Queued:
    job_id: str
    prompt_tokens: int
    max_tokens: int


def tightest(plan: Plan, now: float, members: dict[str, int], stall_s: float) -> tuple[float, str]:
    """The greedy rule's measure: how far inside its deadline the tightest member (named) would
    finish after one more join (its prefill ending `stall_s` from now), at the step time of one
    more row; below 0, it would miss it."""
    step_s = plan.step_s(len(members) + 1)
    return min(
        (plan.deadline(job_id) - (now + plan.margin * (stall_s + tokens * step_s)), job_id)
        for job_id, tokens in members.items()
    )


def fits(plan: Plan, now: float, members: dict[str, int], stall_s: float) -> bool:
    """The greedy rule: after the join every member still finishes within its deadline."""
    return tightest(plan, now, members, stall_s)[0] >= 0


def rollout(
    plan: Plan, now: float, members: dict[str, int], queue: list[Queued], hold_s: float
) -> tuple[bool, float]:
    """Play the batch and the queue to the end, the queue joining by the greedy rule, none
    before `now + hold_s`. Returns whether every job ended within its deadline, and the seconds
    spent stepping."""
    members, queue, feasible, stepped_s = dict(members), list(queue), True, 0.0
    hold_until = now + hold_s
    while members or queue:
        while queue and now >= hold_until:
            head = queue[0]
            stall_s = plan.prefill_s(head.prompt_tokens)
            if members and not fits(plan, now, members, stall_s):
                break
            now += stall_s
            members[head.job_id] = head.max_tokens
            queue.pop(0)
        if not members:  # nobody steps until the hold ends
            now = hold_until
            continue
        steps = min(CHUNK_STEPS, *members.values())
        step_s = plan.step_s(len(members))
        now, stepped_s = now + steps * step_s, stepped_s + steps * step_s
        for job_id in list(members):
            members[job_id] -= steps
            if members[job_id] <= 0:
                feasible = feasible and now <= plan.deadline(job_id)
                del members[job_id]
    return feasible, stepped_s


def join_now(plan: Plan, now: float, members: dict[str, int], queue: list[Queued]) -> bool:
    """Whether the head of `queue` (which the greedy rule admits) should join now."""
    hold_s = HOLD_STEPS * plan.step_s(len(members))
    now_ok, now_s = rollout(plan, now, members, queue, 0.0)
    later_ok, later_s = rollout(plan, now, members, queue, hold_s)
    if not later_ok:
        return True
    return now_ok and now_s <= later_s
