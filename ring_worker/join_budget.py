"""Which waiting jobs may join a running decode batch now, so that batching starves no job
(issue 14: no job's submit -> finished over RINGQ_MAX_SLOWDOWN x what it takes one at a time
behind the same queue order). Pure: rank 0 of a batching group asks it before each hand-off
(ring_worker/batch_serve.py), and one collective gives every rank its answer.

One at a time, the group would run its jobs in the order they reach it, each taking its prefill
and then max_tokens one-row steps: job k would finish at V_k = max(V_(k-1), submitted_k) +
alone_k, and its deadline is submitted_k + slowdown x (V_k - submitted_k) / ESTIMATE_MARGIN.
alone_k is the group's estimate, and the bound is judged against another run's clock: in three
of the five H100 bursts of 2026-12-05 that ended a job past 1.5x (8B), the estimate of its time
one at a time was 8-16.5 % over the one-at-a-time run's, and the budget met its own deadline
while the job ended at 1.57-1.72x (bench/results/batch-decode.md, nineteenth session). So the
deadlines aim inside the bound (1.36x for 1.5x). In bench.join_budget_sim's walk cells (steps
on a slow 5 % walk, 24 bursts), aiming at 1.5x ended a job past 1.5x in 11 bursts (7.4x decode,
median), aiming at 1.36x in 1 (7.0x); on a 10 % walk, in 16 and 4.

A join stalls every member for the joiner's prefill, and every later step is slower by a row.
The jobs waiting for the group are admitted in order while each member's projected finish (now,
plus the admitted prefills, plus its remaining tokens at the step time of the new row count) stays
within its deadline; the admitted ones count as members for the next. A member already late holds
every join back until it leaves: each join would make it later still. A waiting job's own
deadline never keeps it out: joining later only finishes it later.

A step's time is keyed by its width (`BatchDecoder.width`), called its rows below: on CUDA, where
steps of two rows or more run compiled, every slot of the batch's buffers steps, slots double as
rows join and halve as they leave (BatchDecoder), and a step costs by them (an H100: 2 rows 8.2
ms in 2 slots, 12.4 in 32). Keyed by rows, the few rows of a batch's tail (in 32 slots) read 13
ms and a burst's first joins planned 7-8 rows at 2-3 rows' 6.3 ms (in 2-4 slots), where 8 slots
ran 11.

The times are the group's own, as its loop runs them (LoopClock): seconds from one step's start
to the next (the step, the hand-off between steps, finished jobs' records) per row count, the
median of the last RECENT_STEPS; a join's stall is the gap it opened between two steps, per
prompt token. Deadlines take the loop's own one-row step: at one row the loop runs as one at a
time does (H200, 8B, 32 jobs of 4K tokens and 256 each: 55.65 s at batch size 1 in the batching
loop, 55.57 s with RINGQ_MAX_BATCH=1, in one run). A one-row step by itself, less the loop
around it and scaled by the warm-up's one-at-a-time ratio, said 4.2-4.7 ms where one at a time
took 6.4: every deadline came out short, every lone job looked late, and no job ever joined.
A job the group ran alone, start to finish, ran as one at a time runs it: its own time then
replaces its estimate in one at a time's clock, and the deadlines of the jobs behind it follow
(JoinBudget.emptied). Without it, a one-row step read low (an H100: 5.6 ms from a burst's first
steps, 6.1-10.4 ms a step for its jobs alone later) made every deadline of the next burst short,
and the whole burst ran one at a time. In bench.join_budget_sim's `primed_low` cells (a first
burst at 0.7x the steps) that burst ran at 1.0x decode in 8 of 8 seeds; with it, 5.1-5.3x, no job
past 1.34x. On the 10 % walk, one burst more of 24 ended a job past 1.5x (5, not 4): a lone job
there ran on a slow stretch of the walk, while the sim's one at a time does not.
Three guards keep a wrong guess from starving a member, since a join cannot be undone:
- A row count not seen yet is estimated from above. Between two seen counts it is on the line
  through them; above every seen count, each added row costs what the seen counts' slope says
  (at least MIN_ROW_SHARE of the step). A second row, seen nowhere yet, costs
  SECOND_ROW_SHARE of a one-row step, or more where the group's warm-up (GPU: short rows)
  measured more: its times count only as ratios to its own one-row step, since short rows cost
  less than long ones (its 4K-token steps took 12-13 ms at 2-5 rows on an H200, where the
  warm-up's absolute times said 8-10). Above the most rows seen (2 or more), a count grows at
  least as the warm-up's step grew between the two counts. Measured: a second row +44 % and
  each next +23 % on the CPU (SmolLM2, 51 -> 73 -> 120 ms at 1, 2, 7 rows); on an H200 (8B,
  bf16) a second row +56-90 %, then ~+0.2-0.3 ms a row.
- Joins wait until the group has run PROBE_STEPS steps at its current row count. Then every
  waiting job that fits by those estimates joins together, to counts seen or not: the estimate
  from above is the guard. (Until 2026-12-05 only one join a turn could go to a count not seen
  yet: a burst then trickled in one job per PROBE_STEPS steps, each start apart, and the batch
  ended in a long tail. In bench.join_budget_sim's learning cells, joining together reached
  6.73x decode against 6.26x at the compiled step curve, 6.1x against 5.7x at the eager one,
  at the same worst latency, noisy steps included.)
- A count's step is taken as at least any fewer rows' seen: more rows never cost less, but a
  count's first few steps can measure low. In an H100 run (`731fafd`) the table read {3: 8.6,
  4: 6.3} ms, the budget planned job 0's last joins at 6.6 ms a step of 6 rows, and job 0 ended
  0.47 s past its deadline.
- Every projection is stretched by PLAN_MARGIN: steps on a shared host vary by ~10 % a minute.
"""

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ring_worker.join_lookahead import HOLD_STEPS, Plan, Queued, join_now, tightest

AVERAGE_WEIGHT = 0.2  # of each new prefill sample in an exponential average
RECENT_STEPS = 32  # steps kept per row count: their median is its step time
SETTLED_STEPS = 16  # step samples before deadlines are fixed (until then, recomputed each time)
SECOND_ROW_SHARE = 0.6  # a second row's cost, as a share of a one-row step, before one is seen
ADDED_ROW_SHARE = 0.25  # each further row's, as a share of a one-row step, before a slope is seen
MIN_ROW_SHARE = 0.02  # the least an added row is taken to cost, as a share of the step
PROBE_STEPS = 3  # steps run at the batch's row count before another row joins
PLAN_MARGIN = 1.1  # projected times are stretched by this (see above)
ESTIMATE_MARGIN = 1.1  # deadlines aim this much inside the bound (see above)
COVERED_SHARE = 0.75  # the lookahead plays a batch of n rows once 0.75 n rows were measured
FIRST_READ_OFF = 0.1  # the log names a count whose first probe read this share off its median
FIRST_GAPS_LEFT_OUT = 3  # a width's first gaps between steps in a group: no samples (LoopClock)


def warm_up_rows(slowdown: float | None, batch_limit: int) -> int:
    """The most rows (in as many slots) a GPU group's warm-up measures: a bounded budget plans
    with every width up to the batch limit; unbounded, nothing plans with them, and a warm-up
    measuring 8-32 slots has not been timed on a GPU, so up to 4, as before."""
    return batch_limit if slowdown is not None else min(batch_limit, 4)


def by_rows(rows: int) -> int:
    """A step's width where it costs by its rows (JoinBudget.admit's default)."""
    return rows


@dataclass(frozen=True)
class Waiting:
    """A job handed to the group, not yet started: what its deadline needs."""

    job_id: str
    submitted: float  # unix time (its record's created_at)
    prompt_tokens: int
    max_tokens: int


@dataclass
class GroupTimes:
    """What this group has measured of its own steps and prefills (and its warm-up's steps)."""

    warm_up_s: dict[int, float] = field(default_factory=dict)  # rows -> seconds, short rows
    step_s: dict[int, float] = field(default_factory=dict)  # rows -> median of recent steps
    recent_s: dict[int, deque[float]] = field(default_factory=dict)  # rows -> recent steps
    first_s: dict[int, float] = field(default_factory=dict)  # rows -> its first probe's median
    prefill_tok_s: float | None = None
    steps_seen: int = 0

    @property
    def settled(self) -> bool:
        return self.steps_seen >= SETTLED_STEPS

    def saw_step(self, rows: int, seconds: float) -> None:
        recent = self.recent_s.setdefault(rows, deque(maxlen=RECENT_STEPS))
        recent.append(seconds)
        self.step_s[rows] = statistics.median(recent)
        if len(recent) == PROBE_STEPS and rows not in self.first_s:
            self.first_s[rows] = self.step_s[rows]  # what the count's first joins planned with
        self.steps_seen += 1

    def saw_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tok_s = _averaged(self.prefill_tok_s, tokens / seconds)

    def covers(self, rows: int) -> bool:
        """Whether the group has run PROBE_STEPS steps at COVERED_SHARE of `rows` rows or
        more: counts up to it are then measured, on a line between measured ones, or a short
        way above the most measured, not estimated from above far past what was seen."""
        return any(self.known(n) for n in self.recent_s if n >= COVERED_SHARE * rows)

    def known(self, rows: int) -> bool:
        """Whether the group has run PROBE_STEPS steps at `rows` rows."""
        return len(self.recent_s.get(rows, ())) >= PROBE_STEPS

    def step(self, rows: int) -> float:
        """Seconds per step at `rows` rows, estimated from above where not seen (see the
        module's docstring), and never less than at fewer rows seen; before any step of its
        own, the warm-up's (0.0 without one)."""
        seen = self.step_s or self.warm_up_s
        fewer = [seconds for n, seconds in seen.items() if n < rows]
        return max([self._estimate(seen, rows), *fewer])

    def _estimate(self, seen: dict[int, float], rows: int) -> float:
        if rows in seen or not seen:
            return seen.get(rows, 0.0)
        below = [n for n in seen if n < rows]
        above = [n for n in seen if n > rows]
        if not below:
            return seen[min(above)]
        low = max(below)
        if above:
            high = min(above)
            return seen[low] + (seen[high] - seen[low]) * (rows - low) / (high - low)
        if low == 1:
            return seen[1] * self._share_over_one_row(rows)
        added = seen[low] + (rows - low) * self._added_row_s(seen, low)
        return max(added, seen[low] * self._warm_up_growth(low, rows))

    def _warm_up_growth(self, low: int, rows: int) -> float:
        """How much the warm-up's step grew from `low` rows to `rows` (its times on the lines
        between its counts, flat past its last; 1.0 where it has no say)."""
        warm = self.warm_up_s
        if len(warm) < 2 or low < min(warm):
            return 1.0
        counts = sorted(warm)

        def at(n: int) -> float:
            n = min(n, counts[-1])
            below = max(c for c in counts if c <= n)
            above = min(c for c in counts if c >= n)
            if below == above:
                return warm[below]
            return warm[below] + (warm[above] - warm[below]) * (n - below) / (above - below)

        return max(1.0, at(rows) / at(low)) if at(low) > 0 else 1.0

    def table(self) -> str:
        """The step times it goes by, in ms by row count; the counts whose first PROBE_STEPS
        steps read more than FIRST_READ_OFF off what they read now (a join there was planned
        with those: on an H100 2 and 3 rows first read 6.1 and 6.6 ms, later 8.9 and 9.5,
        bench/results/batch-decode.md, eighteenth session); and its prefill rate (for the log)."""
        steps = ", ".join(f"{n}: {1e3 * s:.1f}" for n, s in sorted(self.step_s.items()))
        off = {n: s for n, s in sorted(self.first_s.items())
               if abs(s - self.step_s[n]) > FIRST_READ_OFF * self.step_s[n]}  # fmt: skip
        first = ", ".join(f"{n}: {1e3 * s:.1f}" for n, s in off.items())
        rate = f"{self.prefill_tok_s / 1e3:.1f}K tok/s" if self.prefill_tok_s else "none seen"
        read = f", first read {{{first}}}" if off else ""
        return f"step ms by rows {{{steps}}}{read}, prefill {rate}"

    def _share_over_one_row(self, rows: int) -> float:
        """A step of `rows` rows as a multiple of a one-row step, no more rows seen: the priors,
        or the warm-up's ratios where they say more."""
        prior = 1 + SECOND_ROW_SHARE + ADDED_ROW_SHARE * (rows - 2)
        warm = self.warm_up_s
        if 1 not in warm or warm[1] <= 0:
            return prior
        return max([prior] + [warm[n] / warm[1] for n in warm if 1 < n <= rows])

    def _added_row_s(self, seen: dict[int, float], low: int) -> float:
        """What a row added above `low` (>= 2 rows, the most seen) costs: the slope from the
        next count seen below it (2 rows or more), else ADDED_ROW_SHARE of a one-row step."""
        floor_s = MIN_ROW_SHARE * seen[low]
        lower = [n for n in seen if 2 <= n < low]
        if lower:
            other = max(lower)
            return max(floor_s, (seen[low] - seen[other]) / (low - other))
        one_row_s = seen.get(1, seen[low] / (1 + SECOND_ROW_SHARE))
        return max(floor_s, ADDED_ROW_SHARE * one_row_s)

    def prefill(self, tokens: int) -> float:
        """Seconds to prefill `tokens` (0.0 before any prefill was seen)."""
        return tokens / self.prefill_tok_s if self.prefill_tok_s else 0.0


def _averaged(average: float | None, sample: float) -> float:
    if average is None:
        return sample
    return (1 - AVERAGE_WEIGHT) * average + AVERAGE_WEIGHT * sample


class JoinBudget:
    """Deadlines of the group's jobs, and which waiting jobs may join now."""

    def __init__(
        self,
        slowdown: float | None,
        step_s: dict[int, float] | None = None,
        lookahead: bool = False,
    ):
        """`slowdown` None: no bound (every waiting job is admitted). `step_s`: seconds per step
        by row count measured before the group's first job (its GPU warm-up, on short rows): its
        ratios to one row bound the estimates from below (GroupTimes.step); they count as no
        step seen, so deadlines still settle on the group's own. `lookahead`: weigh each
        first join of a turn against holding it (ring_worker/join_lookahead.py), once the
        group's own steps cover the batch a rollout would play (GroupTimes.covers)."""
        if slowdown is not None and slowdown < 1:
            raise ValueError(f"slowdown must be at least 1, got {slowdown}")
        self.slowdown = slowdown
        self.times = GroupTimes(warm_up_s=dict(step_s or {}))
        self.deadlines: dict[str, float] = {}
        # one at a time's clock of each job with a deadline, in the order the group saw them:
        # its submission, its time alone as estimated, and when one at a time would finish it
        self._virtual: dict[str, tuple[float, float, float]] = {}
        self._arrived: list[tuple[Waiting, float | None]] = []  # deadlines not fixed yet
        self._seen: set[str] = set()
        self._virtual_end = -math.inf  # when one at a time would finish the jobs seen so far
        self.submitted: dict[str, float] = {}  # of the jobs with deadlines
        self.slack_s, self.tightest = math.inf, ""  # the last admitted join's (tightest)
        self.planned_step_s = 0.0  # the step time that join was planned at (its row count)
        self.lookahead = lookahead
        self.held_until = -math.inf  # the lookahead held the head of the queue until then
        self.holding = False  # the last admit's first waiting job was held by the lookahead

    @property
    def aim(self) -> float:
        """What the deadlines allow, as a multiple of a job's estimated time one at a time:
        the bound, less ESTIMATE_MARGIN, never under 1."""
        assert self.slowdown is not None
        return max(1.0, self.slowdown / ESTIMATE_MARGIN)

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

    def emptied(self, now: float, alone: tuple[str, float] | None = None) -> float | None:
        """The batch emptied at `now` (unix time): one at a time is taken to have finished the
        jobs seen so far by then too, so a job arriving later is not given the time one at a
        time would still have spent on them (a second burst in a warm group would otherwise get
        deadlines a whole burst late, and join as if unbounded).

        `alone`: the batch was one job, start to finish, and took that many seconds: what one at
        a time does, so its time replaces its estimate in one at a time's clock, and the jobs
        behind it get their deadlines from that. On an H100 (`82121f1`, 8B) a warm group's
        one-row step read 5.6 ms from a burst's first steps, where its jobs alone then took
        6.1-10.4 ms a step: every deadline of the next burst came out short, job 0 alone looked
        late and held every join, each job behind it started late too, and the whole burst ran
        one at a time (0.93x decode). Returns the estimate it replaced (None: none)."""
        replaced = None
        if alone is not None and self.times.settled and not self._arrived:
            replaced = self._replace_estimate(*alone)
        self._virtual_end = min(self._virtual_end, now)
        self._arrived = [(job, s) for job, s in self._arrived if job.job_id in self._seen]
        self._virtual = {key: clock for key, clock in self._virtual.items() if key in self._seen}
        return replaced

    def _replace_estimate(self, job_id: str, seconds: float) -> float | None:
        """One at a time's clock with `job_id` taking `seconds`: it and the jobs seen after it
        end that much later (or sooner), where they queued behind it, and their deadlines
        move with their ends. Returns the estimate replaced."""
        if job_id not in self._virtual:
            return None
        keys = list(self._virtual)
        submitted, alone_s, end = self._virtual[job_id]
        end += seconds - alone_s
        for key in keys[keys.index(job_id) + 1 :]:
            submitted, alone_s, _ = self._virtual[key]
            end = max(end, submitted) + alone_s
            self._virtual[key] = (submitted, alone_s, end)
            if key in self.deadlines:
                self.deadlines[key] = submitted + self.aim * (end - submitted)
        self._virtual_end = end
        return self._virtual[job_id][1]

    def left(self, job_id: str) -> None:
        self.deadlines.pop(job_id, None)
        self.submitted.pop(job_id, None)
        self._seen.discard(job_id)

    def admit(
        self,
        now: float,
        remaining: dict[str, int],
        waiting: list[Waiting],
        width: Callable[[int], int] = by_rows,
    ) -> int:
        """How many of `waiting` (in order) may join now. `remaining`: each member's tokens
        still to decode, at most. `width`: what a step of n rows costs by in this batch, which
        the times are keyed by (`BatchDecoder.width`: its slots where steps are compiled)."""
        self.holding = False
        if self.slowdown is None:
            return len(waiting)
        if not remaining:
            return min(1, len(waiting))
        for job in waiting:
            self.arrive(job)
        self._fix_deadlines()
        members = dict(remaining)
        if not self.times.known(width(len(members))):
            return 0  # the batch's step at this size is not measured yet
        plan = self._plan(width)
        stall_s, admitted = 0.0, 0
        for job in waiting:
            job_stall_s = stall_s + self.times.prefill(job.prompt_tokens)
            # how far inside its deadline the tightest member (named) would finish after this
            # join too (its prefill ending job_stall_s from now); below 0, it would miss it
            slack_s, tightest_id = tightest(plan, now, members, job_stall_s)
            if slack_s < 0:
                break
            if self.lookahead and not admitted and not self._join_now(now, members, waiting, width):
                self.holding = True
                break
            self.slack_s, self.tightest = slack_s, tightest_id
            self.planned_step_s = self.times.step(width(len(members) + 1))
            members[job.job_id] = job.max_tokens
            stall_s, admitted = job_stall_s, admitted + 1
        return admitted

    def _join_now(
        self,
        now: float,
        members: dict[str, int],
        waiting: list[Waiting],
        width: Callable[[int], int] = by_rows,
    ) -> bool:
        """The lookahead (ring_worker/join_lookahead.py): whether the head of the queue, which
        fits now, should join now rather than HOLD_STEPS later; a hold is weighed again after
        half of that."""
        if now < self.held_until:
            return False
        if not self.times.covers(width(len(members) + len(waiting))):
            return True  # the rollouts would run on estimates from above: the rule decides
        queue = [Queued(job.job_id, job.prompt_tokens, job.max_tokens) for job in waiting]
        plan = self._plan(width)
        if join_now(plan, now, members, queue):
            return True
        self.held_until = now + HOLD_STEPS / 2 * plan.step_s(len(members))
        return False

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
                allowed_s = self.aim * (virtual_end - job.submitted)
                self.deadlines[job.job_id] = job.submitted + allowed_s
                self.submitted[job.job_id] = job.submitted
                self._virtual[job.job_id] = (job.submitted, alone_s, virtual_end)
        if self.times.settled:
            self._virtual_end, self._arrived = virtual_end, []

    def _plan(self, width: Callable[[int], int]) -> Plan:
        """The group's times (at the width n rows step at) and deadlines, as the rule and the
        lookahead read them."""
        return Plan(lambda rows: self.times.step(width(rows)), self.times.prefill,
                    lambda job_id: self.deadlines.get(job_id, math.inf), PLAN_MARGIN)  # fmt: skip

    def allowed_s(self, job_id: str) -> float:
        """The member's deadline, as seconds after its submission (inf where it has none)."""
        submitted = self.submitted.get(job_id)
        if submitted is None:
            return math.inf
        return self.deadlines[job_id] - submitted


@dataclass
class LoopClock:
    """The batch loop's times, for the group's GroupTimes, from the timestamps it passes in: a
    step's time is from its start to the next one's; a join's stall is that gap, less its step,
    where jobs joined in between (every cost of the join: the hand-off, the prefill, records).
    Both leave out what the loop set `aside` in the gap: a job's one-off costs, not a step's
    (reading a job handed over, writing a leaving job's result). Counted as steps, they made
    a burst's first one-row steps read high while its jobs were handed over, so its deadlines
    came out late (an H100 run: 7.7 ms early, 6.5 later; bench/results/batch-decode.md).

    A width's first FIRST_GAPS_LEFT_OUT sampled gaps in the group are no samples either (kept
    for the log): on an H100 (`fc12c9c`, 8B, two runs) they read 6.1-6.5 ms at 2, 4 and 8 slots,
    below bench.slots_probe's steady 8.2-10.4 ms there, where the same widths later ran
    8.8-11.5 ms; one row first read 5.4 ms, then 6.7. The cause is not found. A burst's ramp
    passes a width in a few steps, so its only samples were those: the next burst planned 4
    rows at 6.8 ms, they stepped 10.6, and its job 0 ended at 1.67x."""

    times: GroupTimes
    last: tuple[int, float, float] | None = None  # rows, start, seconds of the step itself
    joined_tokens: int | None = None  # prompt tokens prefilled since the last step started
    unsampled: int = 0  # gaps not sampled: across a join and the step reading its token; a shrink
    aside_s: float = 0.0  # set aside since the last step started
    left_out: int = FIRST_GAPS_LEFT_OUT  # of each width's first gaps, not sampled
    first_gaps: dict[int, list[float]] = field(default_factory=dict)  # those, by width

    def aside(self, seconds: float) -> None:
        """`seconds` of the current gap went to a job's one-off cost, not to the step."""
        self.aside_s += seconds

    def step_began(self, rows: int, now: float) -> None:
        if self.last is not None:
            last_rows, then, step_s = self.last
            gap_s = now - then - self.aside_s
            if self.joined_tokens:
                self.times.saw_prefill(self.joined_tokens, gap_s - step_s)
            elif self.joined_tokens is None and not self.unsampled:
                self._sample(last_rows, gap_s)
            self.unsampled = max(0, self.unsampled - 1)
        self.last, self.joined_tokens, self.aside_s = (rows, now, 0.0), None, 0.0

    def _sample(self, rows: int, gap_s: float) -> None:
        """A step's gap: a sample, unless it is one of the width's first `left_out`."""
        first = self.first_gaps.setdefault(rows, [])
        if len(first) < self.left_out:
            first.append(gap_s)
        else:
            self.times.saw_step(rows, gap_s)

    def step_ended(self, now: float) -> None:
        if self.last is not None:
            rows, began, _ = self.last
            self.last = (rows, began, now - began)

    def joined(self, tokens: int) -> None:
        """A job started between two steps, prefilling `tokens` (0: a prefill job run whole,
        or one cancelled: its gap is no step, nor a prefill rate)."""
        self.joined_tokens = (self.joined_tokens or 0) + tokens
        self.unsampled = 2

    def shrank(self) -> None:
        """The step that just ran copied the batch's buffers to fewer slots (rows left): its gap
        holds the copy's graph, the next the copy itself and the compiled step's new trace."""
        self.unsampled = 2

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A job's prefill of `tokens` took `seconds`. One that starts a batch (before its first
        step) is no gap between steps, so it is a sample as it ran: without it, a group's first
        join took the joiner's prefill as free (an H100 group's first join of a 4K prompt
        planned its stall at 0 s, not ~0.12 s, where job 0's deadline left 0.00 s)."""
        if self.last is None:
            self.times.saw_prefill(tokens, seconds)

    def batch_ended(self) -> None:
        self.last, self.joined_tokens, self.unsampled = None, None, 0

    def left_out_line(self) -> str:
        """The first gaps left out, in ms by width (their medians), for the log."""
        gaps = {n: statistics.median(g) for n, g in sorted(self.first_gaps.items()) if g}
        shown = ", ".join(f"{n}: {1e3 * s:.1f}" for n, s in gaps.items())
        return f"first gaps left out {{{shown}}}"
