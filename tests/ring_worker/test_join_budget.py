"""The join budget (ring_worker/join_budget.py): deadlines from a one-at-a-time clock in the
order the group sees its jobs, and joins admitted only while every member keeps its deadline."""

import math

import pytest

from ring_worker.join_budget import (
    ESTIMATE_MARGIN,
    FIRST_GAPS_LEFT_OUT,
    PLAN_MARGIN,
    PROBE_STEPS,
    SETTLED_STEPS,
    GroupTimes,
    JoinBudget,
    LoopClock,
    Waiting,
    warm_up_rows,
)

PREFILL_TOK_S = 1000.0  # every prompt below is 1,000 tokens: 1 s of prefill
STEP_S = {1: 0.1, 2: 0.11, 3: 0.12, 4: 0.13}


def bound(aim: float) -> float:
    """The RINGQ_MAX_SLOWDOWN whose deadlines allow `aim` x a job's estimated time alone."""
    return aim * ESTIMATE_MARGIN


def budget(aim: float | None = 1.5) -> JoinBudget:
    """A budget whose deadlines allow `aim` x a job's estimated time one at a time (None: no
    bound), with the times below measured."""
    found = JoinBudget(None if aim is None else bound(aim))
    found.times.saw_prefill(1000, 1000 / PREFILL_TOK_S)
    for rows, seconds in STEP_S.items():
        for _ in range(PROBE_STEPS):
            found.times.saw_step(rows, seconds)
    return found


def job(n: int, max_tokens: int = 10, submitted: float = 0.0) -> Waiting:
    return Waiting(f"j{n}", submitted, 1000, max_tokens)


def test_deadlines_follow_one_at_a_time_in_arrival_order():
    """Each job alone takes 1 s of prefill + 10 x 0.1 s: 2 s. Submitted together, one at a
    time they finish at 2, 4, 6 s; with slowdown 1.5 the deadlines are 3, 6, 9 s."""
    found = budget()
    for n in range(3):
        found.arrive(job(n), prefill_s=1.0)
    found.admit(0.0, {"j0": 10}, [])
    assert [found.deadlines[f"j{n}"] for n in range(3)] == pytest.approx([3.0, 6.0, 9.0])


def test_a_later_submission_starts_its_own_clock():
    found = budget(aim=2.0)
    found.arrive(job(0), prefill_s=1.0)
    found.arrive(job(1, submitted=100.0), prefill_s=1.0)  # the group idled meanwhile
    found.admit(100.0, {"j1": 10}, [])
    assert found.deadlines["j1"] == pytest.approx(104.0)  # 100 + 2 x 2 s, not behind j0


def test_joins_stop_where_a_member_would_miss_its_deadline():
    """j0 (deadline 3 s) decodes at t = 1.2 with 8 tokens left: alone it ends at 2.0 s. One
    joiner (1 s prefill, then 8 x 0.11 s, stretched by PLAN_MARGIN 1.1) ends it at 3.27 s > 3:
    nobody joins. With more slack (slowdown 2: deadline 4 s) j1 joins, and j2 would push j0 to
    1.2 + 1.1 x (2 + 8 x 0.12) = 4.46 s: one joins."""
    assert pytest.approx(1.1) == PLAN_MARGIN
    tight = budget()
    tight.arrive(job(0), prefill_s=1.0)
    assert tight.admit(1.2, {"j0": 8}, [job(1), job(2)]) == 0
    loose = budget(aim=2.0)
    loose.arrive(job(0), prefill_s=1.0)
    assert loose.admit(1.2, {"j0": 8}, [job(1), job(2)]) == 1
    assert loose.tightest == "j0" and loose.allowed_s("j0") == pytest.approx(4.0)
    assert loose.slack_s == pytest.approx(4.0 - (1.2 + 1.1 * (1.0 + 8 * 0.11)))


def test_times_go_by_the_width_a_step_will_have():
    """A compiled step runs every slot of the batch's buffers: with `width` saying two rows step
    in 8 slots, at 0.3 s a step there, the join above (0.11 s a step by rows) would end j0 at
    1.2 + 1.1 x (1 + 8 x 0.3) = 4.94 s, past its 4 s: nobody joins; and the batch's own steps
    must be measured at its width before anyone does."""
    loose = budget(aim=2.0)
    for _ in range(PROBE_STEPS):
        loose.times.saw_step(8, 0.3)
    loose.arrive(job(0), prefill_s=1.0)
    slots = {1: 1, 2: 8, 3: 8}
    assert loose.admit(1.2, {"j0": 8}, [job(1)], width=slots.__getitem__) == 0
    assert loose.admit(1.2, {"j0": 8}, [job(1)]) == 1  # by rows, as before
    assert loose.planned_step_s == pytest.approx(0.11)
    assert budget(aim=100.0).admit(1.2, {"j0": 8, "j1": 8}, [job(2)], width=slots.__getitem__) == 0


def test_joins_wait_until_the_batch_has_stepped_at_its_size():
    found = JoinBudget(10.0)
    found.times.saw_prefill(1000, 0.1)
    found.arrive(job(0), prefill_s=0.1)
    for steps in range(PROBE_STEPS):
        assert found.admit(0.2, {"j0": 10}, [job(1)]) == 0, steps
        found.times.saw_step(1, 0.1)
    assert found.admit(0.5, {"j0": 7}, [job(1)]) == 1


def test_joins_go_together_to_row_counts_not_measured_while_the_estimate_fits():
    """With every deadline far off, all five join at once (to 2-6 rows; 5 and 6 not measured).
    At 6 rows, not measured, nobody joins until the batch has stepped there."""
    found = budget(aim=100.0)
    found.arrive(job(0), prefill_s=1.0)
    assert found.admit(1.2, {"j0": 8}, [job(n) for n in range(1, 6)]) == 5
    members = {f"j{n}": 8 for n in range(6)}
    assert found.admit(6.2, members, [job(6)]) == 0


def test_a_join_of_many_stops_at_the_first_that_would_make_a_member_late():
    """j0 (deadline 3 s with slowdown 1.5; here 6 s with 3) ends at 1.2 + 1.1 x (n x 1 s of
    prefill + 8 steps at n + 1 rows): 1 joiner -> 3.27 s, 2 -> 4.46 s, 3 -> 5.66 s, 4 -> 6.9 s.
    Three join together."""
    found = budget(aim=3.0)
    found.arrive(job(0), prefill_s=1.0)
    assert found.admit(1.2, {"j0": 8}, [job(n) for n in range(1, 6)]) == 3


def test_a_member_already_late_holds_joins_back():
    found = budget()
    found.arrive(job(0), prefill_s=1.0)
    found.admit(0.0, {"j0": 10}, [])  # j0's deadline: 3 s
    assert found.admit(10.0, {"j0": 5}, [job(1)]) == 0  # a join would make it later still


def test_an_empty_batch_always_takes_the_first_job():
    assert budget().admit(0.0, {}, [job(0), job(1)]) == 1
    assert budget().admit(0.0, {}, []) == 0


@pytest.mark.parametrize("aim", [None, math.inf])
def test_no_bound_admits_everyone(aim):
    found = budget(aim=aim)
    found.arrive(job(0), prefill_s=1.0)
    assert found.admit(1.2, {"j0": 8}, [job(n) for n in range(1, 4)]) == 3


def test_step_times_are_estimated_from_above():
    times = GroupTimes()
    assert times.step(4) == 0.0 and times.prefill(100) == 0.0
    times.saw_step(1, 0.1)
    assert times.step(2) == pytest.approx(0.16)  # a second row: +60 % of a one-row step
    assert times.step(5) == pytest.approx(0.1 * (1.6 + 3 * 0.25))  # then +25 % a row
    times.saw_step(8, 0.17)
    assert times.step(4) == pytest.approx(0.1 + 0.07 * 3 / 7)  # on the line through 1 and 8
    assert times.step(9) == pytest.approx(0.17 + 0.025)  # no slope above 2 rows: the prior
    times.saw_step(4, 0.2)  # 4 rows measured dearer than 8: more rows are taken at least as dear
    assert times.step(8) == pytest.approx(0.2) and times.step(10) == pytest.approx(0.2)
    assert times.step(3) == pytest.approx(0.1 + 0.1 * 2 / 3)  # below it, the line through 1 and 4
    assert times.step(1) == pytest.approx(0.1)
    times.saw_step(1, 0.3)
    times.saw_step(1, 0.2)
    assert times.step(1) == pytest.approx(0.2)  # the median of the recent ones


def test_a_count_is_never_taken_cheaper_than_fewer_rows_seen():
    """The H100 run at 731fafd: {3: 8.6, 4: 6.3} ms, then a plan at 6.6 ms for 6 rows."""
    times = GroupTimes()
    for rows, seconds in {1: 0.0071, 2: 0.0081, 3: 0.0086, 4: 0.0063}.items():
        times.saw_step(rows, seconds)
    assert times.step(4) == pytest.approx(0.0086) and times.step(6) >= 0.0086
    assert times.step(2) == pytest.approx(0.0081)


def test_warm_up_times_count_as_ratios_to_its_own_one_row_step():
    """The H200's warm-up on rows of 8-24 tokens: 4.3 ms at one row, 9.85 at two (x2.29), 8.16
    at four. The group's own one-row steps of 4K-token rows take 6 ms: two rows are taken at
    6 x 2.29 = 13.7 ms (the prior's +60 % would say 9.6), and before any step of its own the
    warm-up's times stand."""
    warm = {1: 0.0043, 2: 0.00985, 4: 0.00816}
    times = GroupTimes(warm_up_s=dict(warm))
    assert times.step(2) == pytest.approx(0.00985)
    times.saw_step(1, 0.006)
    assert times.step(2) == pytest.approx(0.006 * 0.00985 / 0.0043)
    assert times.step(4) == pytest.approx(0.006 * max(1.6 + 2 * 0.25, 0.00985 / 0.0043))


def test_deadlines_take_the_loops_one_row_step():
    """One-row steps of the loop (start to start, hand-offs in between) of 0.2 s: a 10-token
    job with a 1 s prefill takes 3 s one at a time, so its deadline is 1.5 x 3 s after it was
    submitted (at batch size 1 the loop runs as one at a time does: see the module's doc)."""
    found = JoinBudget(bound(1.5), {1: 0.05})  # the warm-up's short rows: overruled
    for _ in range(SETTLED_STEPS):
        found.times.saw_step(1, 0.2)
    found.arrive(job(0), prefill_s=1.0)
    found.admit(1.0, {"j0": 10}, [])
    assert found.deadlines["j0"] == pytest.approx(4.5)


def test_deadlines_aim_inside_the_bound_by_the_estimates_margin():
    """The group's estimate of a job's time one at a time ran 5-16 % over the one-at-a-time
    run's: a bound of 1.5 sets deadlines at 1.5 / 1.1 of the estimate (2 s alone: 2.73 s), and
    a bound of 1 at the estimate itself, not inside it."""
    assert pytest.approx(1.1) == ESTIMATE_MARGIN
    for slowdown, allowed_s in ((1.5, 2.0 * 1.5 / 1.1), (1.05, 2.0), (1.0, 2.0)):
        found = JoinBudget(slowdown)
        found.times.saw_prefill(1000, 1.0)
        for _ in range(SETTLED_STEPS):
            found.times.saw_step(1, 0.1)
        found.arrive(job(0), prefill_s=1.0)
        found.admit(1.0, {"j0": 10}, [])
        assert found.allowed_s("j0") == pytest.approx(allowed_s), slowdown


def test_the_loop_clock_times_steps_start_to_start_and_joins_by_their_gap():
    times = GroupTimes()
    clock = LoopClock(times, left_out=0)
    clock.step_began(1, 10.0)
    clock.step_ended(10.1)
    clock.step_began(1, 10.3)  # 0.3 s a step, 0.1 of it the step itself
    assert times.step(1) == pytest.approx(0.3)
    clock.step_ended(10.4)
    clock.joined(1000)
    clock.step_began(2, 11.4)  # a gap of 1.1 s, 0.1 of it the step: 1,000 tokens in 1 s
    assert times.prefill(1000) == pytest.approx(1.0)
    clock.step_ended(11.5)
    clock.step_began(2, 11.9)  # the step reading the joiner's first token: not taken
    assert 2 not in times.step_s
    clock.step_ended(12.0)
    clock.step_began(2, 12.1)
    assert times.step_s[2] == pytest.approx(0.2)  # (step(2) is at least step(1): 0.3)
    clock.step_ended(12.2)
    clock.joined(0)  # a prefill job run whole between two steps: neither a step nor a rate
    clock.step_began(2, 15.0)
    assert times.step_s[2] == pytest.approx(0.2) and times.prefill(1000) == pytest.approx(1.0)
    clock.batch_ended()
    clock.step_began(1, 100.0)  # the idle time between batches is no step
    assert times.step(1) == pytest.approx(0.3)


def test_the_loop_clock_leaves_a_jobs_one_off_costs_out_of_steps_and_prefills():
    """A job handed over (read) or leaving (its result written) costs once, not every step: a
    burst handed over while job 0 ran alone made its one-row steps read high, and its deadlines
    late. What the loop sets aside in a gap is no part of the step, nor of a joiner's prefill."""
    times = GroupTimes()
    clock = LoopClock(times, left_out=0)
    clock.step_began(1, 10.0)
    clock.step_ended(10.1)
    clock.aside(0.15)  # two jobs read while handed over
    clock.aside(0.05)
    clock.step_began(1, 10.5)  # 0.5 s start to start, 0.2 of it set aside
    assert times.step_s[1] == pytest.approx(0.3)
    clock.step_ended(10.6)
    clock.step_began(1, 10.9)  # nothing set aside: the whole gap
    assert times.recent_s[1][-1] == pytest.approx(0.4)
    clock.step_ended(11.0)
    clock.aside(0.5)  # a leaving job's result
    clock.joined(1000)
    clock.step_began(2, 12.5)  # a gap of 1.6 s: 0.1 the step, 0.5 aside, 1,000 tokens in 1 s
    assert times.prefill(1000) == pytest.approx(1.0)


def test_a_batchs_first_prefill_is_a_sample_and_a_joiners_is_its_gap():
    """A job that starts a batch prefills before any step, so no gap holds it: it is a sample
    as it ran (the first join no longer takes a prefill as free). A joiner's prefill, run
    between two steps, is the gap's, not counted twice."""
    times = GroupTimes()
    clock = LoopClock(times, left_out=0)
    assert times.prefill(1000) == 0.0  # nothing seen
    clock.prefilled(1000, 2.0)
    assert times.prefill(1000) == pytest.approx(2.0)
    clock.step_began(1, 10.0)
    clock.step_ended(10.1)
    clock.prefilled(1000, 1.0)  # a joiner: its gap counts (1 s of prefill, 0.1 s of records)
    clock.joined(1000)
    clock.step_began(2, 11.2)  # the gap less the 0.1 s step: 1.1 s
    assert times.prefill_tok_s == pytest.approx(0.8 * 500 + 0.2 * 1000 / 1.1)


def test_the_warm_up_measures_every_width_only_where_a_bound_plans_with_them():
    assert [warm_up_rows(1.5, 32), warm_up_rows(1.5, 8), warm_up_rows(None, 32)] == [32, 8, 4]
    assert warm_up_rows(None, 2) == 2


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        JoinBudget(0.9)


@pytest.mark.parametrize("settled", [False, True])
def test_a_job_after_the_batch_emptied_is_not_given_the_time_one_at_a_time_still_owed(settled):
    """Ten jobs submitted at 0 would keep one at a time busy until 20 s. The batch ran them
    by 5 s, and a job submitted at 6 s is due 3 s after its submission (1.5 x 2 s), not
    behind 14 s of a backlog the group no longer has."""
    found = budget()
    for _ in range(SETTLED_STEPS if settled else 0):
        found.times.saw_step(1, STEP_S[1])
    assert found.times.settled == settled
    for n in range(10):
        found.arrive(job(n), prefill_s=1.0)
    found.admit(1.0, {"j0": 10}, [])
    for n in range(10):
        found.left(f"j{n}")
    found.emptied(5.0)
    late = job(10, submitted=6.0)
    found.arrive(late, prefill_s=1.0)
    found.admit(7.0, {"j10": 10}, [])
    assert found.deadlines["j10"] == pytest.approx(9.0)


def settled_with_three_jobs() -> JoinBudget:
    """Three jobs submitted at 0, each estimated at 2 s alone: deadlines 3, 6 and 9 s (1.5x),
    fixed (the times have settled)."""
    found = budget()
    for _ in range(SETTLED_STEPS):
        found.times.saw_step(1, STEP_S[1])
    for n in range(3):
        found.arrive(job(n), prefill_s=1.0)
    found.admit(0.0, {"j0": 10}, [])
    return found


@pytest.mark.parametrize(("took_s", "due"), [(4.0, [9.0, 12.0]), (1.5, [5.25, 8.25])])
def test_a_job_that_ran_alone_gives_one_at_a_time_its_own_time(took_s, due):
    """j0 ran alone start to finish, as one at a time runs it, in `took_s` where 2 s was
    estimated: one at a time ends j1 and j2 that much later (or sooner) too, and their deadlines
    are 1.5x of those ends (4 + 2 and 4 + 4 s; 1.5 + 2 and 1.5 + 4 s)."""
    found = settled_with_three_jobs()
    assert [found.deadlines[k] for k in ("j1", "j2")] == pytest.approx([6.0, 9.0])
    found.left("j0")
    assert found.emptied(took_s, alone=("j0", took_s)) == pytest.approx(2.0)
    assert [found.deadlines[k] for k in ("j1", "j2")] == pytest.approx(due)


def test_a_job_alone_moves_no_deadline_of_a_job_one_at_a_time_would_start_later():
    """j1 is submitted at 10 s, after one at a time would have ended j0 even at its 4 s: its
    clock starts at its own submission, as before."""
    found = budget()
    for _ in range(SETTLED_STEPS):
        found.times.saw_step(1, STEP_S[1])
    found.arrive(job(0), prefill_s=1.0)
    found.arrive(job(1, submitted=10.0), prefill_s=1.0)
    found.admit(0.0, {"j0": 10}, [])
    found.left("j0")
    found.emptied(4.0, alone=("j0", 4.0))
    assert found.deadlines["j1"] == pytest.approx(13.0)


def test_a_burst_whose_estimates_ran_short_still_joins_once_a_job_ran_alone():
    """Every job alone takes 4 s where 2 s was estimated. j0 ran alone and ended at 4 s, so j1,
    alone from 4 s, ends at 8 s: past the 6 s its estimate allowed, it would hold every join
    (and so would each job behind it: the burst would run one at a time). With j0's own time,
    j1 is due at 9 s, and j2 joins at 5 s: j1 then ends by 5 + 1 s (j2's prefill) + 10 steps
    of two rows (0.11 s, x PLAN_MARGIN) = 7.2 s."""
    held = settled_with_three_jobs()
    held.left("j0")
    held.emptied(4.0)
    assert held.admit(5.0, {"j1": 10}, [job(2)]) == 0
    joins = settled_with_three_jobs()
    joins.left("j0")
    joins.emptied(4.0, alone=("j0", 4.0))
    assert joins.admit(5.0, {"j1": 10}, [job(2)]) == 1


def test_a_job_alone_before_the_times_settled_replaces_no_estimate():
    """Until the times settle, deadlines are recomputed from them at every admit anyway."""
    found = budget()
    assert not found.times.settled
    found.arrive(job(0), prefill_s=1.0)
    found.arrive(job(1), prefill_s=1.0)
    found.admit(0.0, {"j0": 10}, [])
    found.left("j0")
    assert found.emptied(4.0, alone=("j0", 4.0)) is None
    assert found.deadlines["j1"] == pytest.approx(6.0)


def test_deadlines_follow_the_step_time_until_it_settles():
    """A first step time is a guess (the step after a join reads that join's own token):
    deadlines move with the group's times until SETTLED_STEPS samples, then stay fixed."""
    found = JoinBudget(1.5)
    found.times.saw_prefill(1000, 1.0)
    found.arrive(job(0), prefill_s=1.0)
    found.times.saw_step(1, 0.01)
    found.admit(1.0, {"j0": 10}, [])
    early = found.deadlines["j0"]
    for _ in range(SETTLED_STEPS):
        found.times.saw_step(1, 0.1)
    found.admit(2.0, {"j0": 5}, [])
    settled = found.deadlines["j0"]
    assert early < settled  # 1.5 x (1 + 10 x 0.01) moved up towards 1.5 x (1 + 10 x 0.1)
    for _ in range(SETTLED_STEPS):
        found.times.saw_step(1, 1.0)
    found.admit(3.0, {"j0": 4}, [])
    assert found.deadlines["j0"] == settled


def test_a_measured_prefill_replaces_the_guess():
    found = budget()
    found.arrive(job(0))  # seen waiting: 1 s guessed
    found.arrive(job(0), prefill_s=3.0)  # then prefilled, in 3 s
    found.admit(3.0, {"j0": 10}, [])
    assert found.deadlines["j0"] == pytest.approx(1.5 * (3.0 + 10 * 0.1))


def test_warm_up_step_times_hold_a_join_the_prior_would_admit():
    """The H200's steps (8B): 7.2 ms at one row of its own. Job 0 alone: 0.1 s of prefill +
    256 x 7.2 ms, so its deadline is 1.5 x 1.94 s = 2.91 s. Job 1 joining at 1.2 s (0.1 s of
    prefill) with 100 tokens left ends job 0 at 1.2 + 1.1 x (0.1 + 100 x the two-row step):
    2.58 s at the prior's 11.5 ms (admitted); 3.12 s at the warm-up's ratio, 2.29 (held)."""

    def joins(warm_up: dict[int, float] | None) -> int:
        found = JoinBudget(1.5, warm_up)
        found.times.saw_prefill(1000, 0.1)
        for _ in range(PROBE_STEPS):
            found.times.saw_step(1, 0.0072)
        found.arrive(job(0, max_tokens=256), prefill_s=0.1)
        return found.admit(1.2, {"j0": 100}, [job(1, max_tokens=256)])

    assert joins(None) == 1
    assert joins({1: 0.0043, 2: 0.00985}) == 0
    assert not JoinBudget(1.5, {1: 0.0072, 2: 0.0112}).times.settled  # seeds are not steps seen


def test_above_the_most_rows_seen_a_count_grows_at_least_as_the_warm_up_did():
    """Warm-up (short rows): 4, 8 and 12 ms at 1, 2 and 4 rows. The group's own steps: 6 ms at
    one row, 10 at two. Three rows: the prior says 10 + 25 % of 6 = 11.5 ms, the warm-up grew
    x1.25 from two rows to three (8 -> 10 on its line), so 12.5. Eight rows: flat past the
    warm-up's four (x1.5: 15 ms), where the prior's 10 + 6 x 1.5 = 19 ms says more."""
    times = GroupTimes(warm_up_s={1: 0.004, 2: 0.008, 4: 0.012})
    for _ in range(PROBE_STEPS):
        times.saw_step(1, 0.006)
        times.saw_step(2, 0.010)
    assert times.step(3) == pytest.approx(0.0125)
    assert times.step(8) == pytest.approx(0.019)
    assert times.table() == "step ms by rows {1: 6.0, 2: 10.0}, prefill none seen"
    times.saw_prefill(4096, 0.128)
    assert times.table().endswith("prefill 32.0K tok/s")


def test_the_log_names_a_count_whose_first_steps_read_low():
    """Two rows first read 6 ms (the joins to come were planned with that), then 9 ms: the
    table names the first read; one row, steady at 7 ms, is not named."""
    times = GroupTimes()
    for _ in range(PROBE_STEPS):
        times.saw_step(1, 0.007)
        times.saw_step(2, 0.006)
    assert times.table() == "step ms by rows {1: 7.0, 2: 6.0}, prefill none seen"
    for _ in range(2 * PROBE_STEPS):
        times.saw_step(1, 0.007)
        times.saw_step(2, 0.009)
    assert (
        times.table() == "step ms by rows {1: 7.0, 2: 9.0}, first read {2: 6.0}, prefill none seen"
    )


def test_a_widths_first_gaps_in_a_group_are_left_out():
    """On an H100 a width's first gaps read 6.1-6.5 ms where it later stepped 8.8-11.5: the
    first FIRST_GAPS_LEFT_OUT gaps at each width are no samples (the log shows them), once per
    group: a later batch samples the width from its first gap."""
    times = GroupTimes()
    clock = LoopClock(times)
    now = 10.0
    for gap in [0.006] * FIRST_GAPS_LEFT_OUT + [0.009, 0.010]:
        clock.step_began(4, now)
        clock.step_ended(now + 0.001)
        now += gap
    clock.step_began(4, now)
    assert list(times.recent_s[4]) == pytest.approx([0.009, 0.010])
    assert clock.left_out_line() == "first gaps left out {4: 6.0}"
    clock.batch_ended()
    clock.step_began(4, 100.0)
    clock.step_ended(100.001)
    clock.step_began(4, 100.008)
    assert times.recent_s[4][-1] == pytest.approx(0.008)
