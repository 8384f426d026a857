"""The join budget (ring_worker/join_budget.py): deadlines from a one-at-a-time clock in the
order the group sees its jobs, and joins admitted only while every member keeps its deadline."""

import math

import pytest

from ring_worker.join_budget import SETTLED_STEPS, GroupTimes, JoinBudget, Waiting

PREFILL_TOK_S = 1000.0  # every prompt below is 1,000 tokens: 1 s of prefill
STEP_S = {1: 0.1, 2: 0.11, 3: 0.12, 4: 0.13}


def budget(slowdown: float | None = 1.5) -> JoinBudget:
    found = JoinBudget(slowdown)
    found.times.saw_prefill(1000, 1000 / PREFILL_TOK_S)
    for rows, seconds in STEP_S.items():
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
    found = budget(slowdown=2.0)
    found.arrive(job(0), prefill_s=1.0)
    found.arrive(job(1, submitted=100.0), prefill_s=1.0)  # the group idled meanwhile
    found.admit(100.0, {"j1": 10}, [])
    assert found.deadlines["j1"] == pytest.approx(104.0)  # 100 + 2 x 2 s, not behind j0


def test_joins_stop_where_a_member_would_miss_its_deadline():
    """j0 (deadline 3 s) decodes at t = 1.2 with 8 tokens left: alone it ends at 2.0 s. One
    joiner (1 s prefill, then 8 x 0.11 s) ends it at 3.08 s > 3: nobody joins. With more
    slack (slowdown 2: deadline 4 s) j1 joins, and j2 would push j0 to 4.2 s: one joins."""
    tight = budget()
    tight.arrive(job(0), prefill_s=1.0)
    assert tight.admit(1.2, {"j0": 8}, [job(1), job(2)]) == 0
    loose = budget(slowdown=2.0)
    loose.arrive(job(0), prefill_s=1.0)
    assert loose.admit(1.2, {"j0": 8}, [job(1), job(2)]) == 1


def test_a_member_already_late_holds_joins_back():
    found = budget()
    found.arrive(job(0), prefill_s=1.0)
    found.admit(0.0, {"j0": 10}, [])  # j0's deadline: 3 s
    assert found.admit(10.0, {"j0": 5}, [job(1)]) == 0  # a join would make it later still


def test_an_empty_batch_always_takes_the_first_job():
    assert budget().admit(0.0, {}, [job(0), job(1)]) == 1
    assert budget().admit(0.0, {}, []) == 0


@pytest.mark.parametrize("slowdown", [None, math.inf])
def test_no_bound_admits_everyone(slowdown):
    found = budget(slowdown=slowdown)
    found.arrive(job(0), prefill_s=1.0)
    assert found.admit(1.2, {"j0": 8}, [job(n) for n in range(1, 4)]) == 3


def test_step_times_extrapolate_from_the_row_counts_seen():
    times = GroupTimes()
    assert times.step(4) == 0.0 and times.prefill(100) == 0.0
    times.saw_step(1, 0.1)
    assert times.step(5) == pytest.approx(0.2)  # a quarter of a one-row step per added row
    times.saw_step(8, 0.17)
    assert times.step(9) == pytest.approx(0.18)  # on the line through 1 and 8 rows
    assert times.step(4) == pytest.approx(0.13)
    times.saw_step(1, 0.2)  # averaged, not replaced
    assert 0.1 < times.step(1) < 0.2


def test_slowdown_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        JoinBudget(0.9)


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
    """The H200's steps (8B: 7.2 ms at one row, 11.2 at two): a second row costs +56 %, more
    than the prior's +25 %. Job 0 alone: 0.1 s of prefill + 256 x 7.2 ms, so its deadline is
    1.5 x 1.94 s = 2.91 s. Job 1 joining at 0.2 s (0.1 s of prefill) ends job 0 at 0.3 + 250
    steps: 2.55 s at the prior's two-row step (admitted), 3.1 s at the measured one (held)."""

    def joins(step_s: dict[int, float]) -> int:
        found = JoinBudget(1.5, step_s)
        found.times.saw_prefill(1000, 0.1)
        found.arrive(job(0, max_tokens=256), prefill_s=0.1)
        return found.admit(0.2, {"j0": 250}, [job(1, max_tokens=256)])

    assert joins({1: 0.0072}) == 1
    assert joins({1: 0.0072, 2: 0.0112}) == 0
    assert not JoinBudget(1.5, {1: 0.0072, 2: 0.0112}).times.settled  # seeds are not steps seen
