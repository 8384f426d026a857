"""Which waiting jobs may join a running decode batch now, so that batching starves no job
(issue 14: no job's submit -> finished over RINGQ_MAX_SLOWDOWN x what it takes one at a time
behind the same queue order). Pure: rank 0 of a batching group asks it before each hand-off
(ring_worker/batch_serve.py), and one collective gives every rank its answer.

One at a time, the group would run its jobs in the order they reach it, each taking its prefill
and then max_tokens one-row steps: job k would finish at V_k = max(V_(k-1), submitted_k) +
alone_k, and its deadline is submitted_k + slowdown x (V_k - submitted_k).

A join stalls every member for the joiner's prefill, and every later step is slower by a row.
The jobs waiting for the group are admitted in order while each member's projected finish (now,
plus the admitted prefills, plus its remaining tokens at the step time of the new row count) stays
within its deadline; the admitted ones count as members for the next. A member already late holds
every join back until it leaves: each join would make it later still. A waiting job's own
deadline never keeps it out: joining later only finishes it later.

The times are the group's own: step seconds per row count (exponential averages, starting from
what its GPU warm-up measured at 1, 2 and 4 rows, where it ran), and prompt tokens per second of
its prefills. A row count not seen yet is on the line through the two seen nearest to it; with
only one seen (the CPU, which has no warm-up), an added row costs PRIOR_ROW_SHARE of a one-row
step. Measured: a second row +44 % and each next +23 % on the CPU (SmolLM2, 51 -> 73 -> 120 ms at
1, 2, 7 rows); on an H200 (8B, bf16) a second row +56 %, then ~+0.2 ms a row (7.2 -> 11.2 ->
18.5 ms at 1, 2, 32 rows): there the prior admitted a second job too early, hence the warm-up.
"""

import math
from dataclasses import dataclass, field

AVERAGE_WEIGHT = 0.2  # of each new sample in an exponential average
SETTLED_STEPS = 8  # step samples before deadlines are fixed (until then, recomputed each time)
PRIOR_ROW_SHARE = 0.25  # an added row's cost, as a share of a one-row step (see above)


@dataclass(frozen=True)
class Waiting:
    """A job handed to the group, not yet started: what its deadline needs."""

    job_id: str
    submitted: float  # unix time (its record's created_at)
    prompt_tokens: int
    max_tokens: int


@dataclass
class GroupTimes:
    """What this group has measured of its own steps and prefills."""

    step_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds per step
    prefill_tok_s: float | None = None
    steps_seen: int = 0

    @property
    def settled(self) -> bool:
        return self.steps_seen >= SETTLED_STEPS

    def saw_step(self, rows: int, seconds: float) -> None:
        self.step_s[rows] = _averaged(self.step_s.get(rows), seconds)
        self.steps_seen += 1

    def saw_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tok_s = _averaged(self.prefill_tok_s, tokens / seconds)

    def step(self, rows: int) -> float:
        """Seconds per step at `rows` rows (0.0 before any step was seen): as seen, else on
        the line through the two row counts seen nearest to it, else (one seen) at
        PRIOR_ROW_SHARE of a one-row step per row."""
        if rows in self.step_s or not self.step_s:
            return self.step_s.get(rows, 0.0)
        near = sorted(self.step_s, key=lambda n: (abs(n - rows), n))[:2]
        seen = near[0]
        if len(near) == 2:
            other = near[1]
            per_row = (self.step_s[other] - self.step_s[seen]) / (other - seen)
        else:
            per_row = self.step_s[seen] * PRIOR_ROW_SHARE / (1 + PRIOR_ROW_SHARE * (seen - 1))
        return max(self.step_s[seen], self.step_s[seen] + (rows - seen) * max(per_row, 0.0))

    def prefill(self, tokens: int) -> float:
        """Seconds to prefill `tokens` (0.0 before any prefill was seen)."""
        return tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0


def _averaged(average: float | None, sample: float) -> float:
    if average is None:
        return sample
    return (1 - AVERAGE_WEIGHT) * average + AVERAGE_WEIGHT * sample


class JoinBudget:
    """Deadlines of the group's jobs, and which waiting jobs may join now."""

    def __init__(self, slowdown: float | None, step_s: dict[int, float] | None = None):
        """`slowdown` None: no bound (every waiting job is admitted). `step_s`: seconds per step
        by row count measured before the group's first job (its GPU warm-up), the start of its
        averages; they count as no step seen, so deadlines still settle on the group's own."""
        if slowdown is not None and slowdown < 1:
            raise ValueError(f"slowdown must be at least 1, got {slowdown}")
        self.slowdown = slowdown
        self.times = GroupTimes(step_s=dict(step_s or {}))
        self.deadlines: dict[str, float] = {}
        self._arrived: list[tuple[Waiting, float | None]] = []  # deadlines not fixed yet
        self._seen: set[str] = set()
        self._virtual_end = -math.inf  # when one at a time would finish the jobs seen so far

    def arrive(self, job: Waiting, prefill_s: float | None = None) -> None:
        """The group sees the job for the first time (`prefill_s`: its measured prefill, where
        it has run). Its deadline is set at the next `admit`, and fixed once the group's step
        time has settled (SETTLED_STEPS): a deadline from a first guess stays wrong."""
        if job.job_id not in self._seen:
            self._seen.add(job.job_id)
            self._arrived.append((job, prefill_s))
        elif prefill_s is not None:  # seen waiting: its measured prefill replaces the guess
            self._arrived = [
                (seen, prefill_s if seen.job_id == job.job_id else measured)
                for seen, measured in self._arrived
            ]

    def left(self, job_id: str) -> None:
        self.deadlines.pop(job_id, None)
        self._seen.discard(job_id)

    def admit(self, now: float, remaining: dict[str, int], waiting: list[Waiting]) -> int:
        """How many of `waiting` (in order) may join now. `remaining`: each member's tokens
        still to decode, at most."""
        if self.slowdown is None:
            return len(waiting)
        if not remaining:
            return min(1, len(waiting))
        for job in waiting:
            self.arrive(job)
        self._fix_deadlines()
        members = dict(remaining)
        stall_s, admitted = 0.0, 0
        for job in waiting:
            job_stall_s = stall_s + self.times.prefill(job.prompt_tokens)
            if not self._keeps_deadlines(now, members, job_stall_s):
                break
            members[job.job_id] = job.max_tokens
            stall_s, admitted = job_stall_s, admitted + 1
        return admitted

    def _fix_deadlines(self) -> None:
        """Deadlines of the jobs seen since they were last fixed, in the order the group saw
        them: recomputed from the current times until those have settled, then fixed."""
        virtual_end = self._virtual_end
        for job, prefill_s in self._arrived:
            if prefill_s is None:
                prefill_s = self.times.prefill(job.prompt_tokens)
            alone_s = prefill_s + job.max_tokens * self.times.step(1)
            virtual_end = max(virtual_end, job.submitted) + alone_s
            if job.job_id in self._seen and self.slowdown is not None:  # not left yet
                allowed_s = self.slowdown * (virtual_end - job.submitted)
                self.deadlines[job.job_id] = job.submitted + allowed_s
        if self.times.settled:
            self._virtual_end, self._arrived = virtual_end, []

    def _keeps_deadlines(self, now: float, members: dict[str, int], join_stall_s: float) -> bool:
        """Whether one more join (its prefill ending `join_stall_s` from now) keeps every
        member within its deadline."""
        step_s = self.times.step(len(members) + 1)
        return all(
            now + join_stall_s + tokens * step_s <= self.deadlines.get(job_id, math.inf)
            for job_id, tokens in members.items()
        )
