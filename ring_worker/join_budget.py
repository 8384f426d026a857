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
within its deadline; the admitted ones count as members for the next. A member already projected
past its deadline without the join does not hold it back (waiting would not save it). A waiting
job's own deadline never keeps it out: joining later only finishes it later.

The times are the group's own: step seconds per row count (exponential averages; a row count
not seen yet is extrapolated from the nearest one seen, at PRIOR_ROW_SHARE of its step per added
row, as measured: 85 -> 143 ms from 1 to 8 rows on the CPU, 5.5 -> 20.6 ms from 1 to 32 on an
H200), and prompt tokens per second of its prefills.
"""

import math
from dataclasses import dataclass, field

AVERAGE_WEIGHT = 0.2  # of each new sample in an exponential average
PRIOR_ROW_SHARE = 0.1  # an added row's cost, as a share of a one-row step (see above)


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

    def saw_step(self, rows: int, seconds: float) -> None:
        self.step_s[rows] = _averaged(self.step_s.get(rows), seconds)

    def saw_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tok_s = _averaged(self.prefill_tok_s, tokens / seconds)

    def step(self, rows: int) -> float:
        """Seconds per step at `rows` rows (0.0 before any step was seen)."""
        if rows in self.step_s or not self.step_s:
            return self.step_s.get(rows, 0.0)
        seen = min(self.step_s, key=lambda n: (abs(n - rows), n))
        per_row = self.step_s[seen] * PRIOR_ROW_SHARE / (1 + PRIOR_ROW_SHARE * (seen - 1))
        return max(0.0, self.step_s[seen] + (rows - seen) * per_row)

    def prefill(self, tokens: int) -> float:
        """Seconds to prefill `tokens` (0.0 before any prefill was seen)."""
        return tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0


def _averaged(average: float | None, sample: float) -> float:
    if average is None:
        return sample
    return (1 - AVERAGE_WEIGHT) * average + AVERAGE_WEIGHT * sample


class JoinBudget:
    """Deadlines of the group's jobs, and which waiting jobs may join now."""

    def __init__(self, slowdown: float):
        if slowdown < 1:
            raise ValueError(f"slowdown must be at least 1, got {slowdown}")
        self.slowdown = slowdown
        self.times = GroupTimes()
        self.deadlines: dict[str, float] = {}
        self._arrived: list[tuple[Waiting, float | None]] = []  # deadlines not fixed yet
        self._seen: set[str] = set()
        self._virtual_end = -math.inf  # when one at a time would finish the jobs seen so far

    def arrive(self, job: Waiting, prefill_s: float | None = None) -> None:
        """The group sees the job for the first time (`prefill_s`: its measured prefill, where
        it has run). Its deadline is fixed at the next `admit`, once a step has been timed."""
        if job.job_id not in self._seen:
            self._seen.add(job.job_id)
            self._arrived.append((job, prefill_s))

    def left(self, job_id: str) -> None:
        self.deadlines.pop(job_id, None)
        self._seen.discard(job_id)

    def admit(self, now: float, remaining: dict[str, int], waiting: list[Waiting]) -> int:
        """How many of `waiting` (in order) may join now. `remaining`: each member's tokens
        still to decode, at most."""
        if not remaining:
            return min(1, len(waiting))
        for job in waiting:
            self.arrive(job)
        self._fix_deadlines()
        members = dict(remaining)
        stall_s, admitted = 0.0, 0
        for job in waiting:
            job_stall_s = stall_s + self.times.prefill(job.prompt_tokens)
            if not self._keeps_deadlines(now, members, stall_s, job_stall_s):
                break
            members[job.job_id] = job.max_tokens
            stall_s, admitted = job_stall_s, admitted + 1
        return admitted

    def _fix_deadlines(self) -> None:
        """Deadlines of the jobs seen since the last admit, in the order the group saw them."""
        for job, prefill_s in self._arrived:
            if job.job_id not in self._seen:
                continue  # it left before its deadline was needed
            if prefill_s is None:
                prefill_s = self.times.prefill(job.prompt_tokens)
            alone_s = prefill_s + job.max_tokens * self.times.step(1)
            self._virtual_end = max(self._virtual_end, job.submitted) + alone_s
            self.deadlines[job.job_id] = job.submitted + self.slowdown * (
                self._virtual_end - job.submitted
            )
        self._arrived = []

    def _keeps_deadlines(
        self, now: float, members: dict[str, int], stall_s: float, join_stall_s: float
    ) -> bool:
        """Whether one more join (its prefill ending `join_stall_s` from now) keeps every
        member that would meet its deadline without it (`stall_s`) within it."""
        rows = len(members)
        before_s, after_s = self.times.step(rows), self.times.step(rows + 1)
        for job_id, tokens in members.items():
            deadline = self.deadlines.get(job_id, math.inf)
            with_join = now + join_stall_s + tokens * after_s
            without = now + stall_s + tokens * before_s
            if with_join > deadline and without <= deadline:
                return False
        return True
