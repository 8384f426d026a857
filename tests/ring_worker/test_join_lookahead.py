"""The join budget's lookahead (ring_worker/join_lookahead.py): rollouts worked out by hand, a
hold chosen where batching costs more than it saves, a join kept where holding would miss a
deadline; and, in the simulated H200 service cell with every time known, more decode than the
greedy rule at the same bound."""

import math

import pytest

from bench.join_budget_sim import H200_COMPILED_STEPS, H200_SERVICE_WARM_UP, simulate
from ring_worker.join_budget import PROBE_STEPS, JoinBudget, Waiting
from ring_worker.join_lookahead import HOLD_STEPS, Plan, Queued, join_now, rollout


def plan(step_s: dict[int, float], deadlines: dict[str, float] | None = None) -> Plan:
    due = deadlines or {}
    return Plan(lambda n: step_s[n], lambda tokens: 0.0, lambda j: due.get(j, math.inf), 1.0)


def test_a_lone_member_steps_its_tokens_out():
    feasible, stepped_s = rollout(plan({1: 0.5}), 0.0, {"a": 10}, [], 0.0)
    assert feasible and stepped_s == pytest.approx(5.0)


def test_a_held_job_runs_after_the_member_when_batching_costs_more():
    """Two rows cost 3x one: joining now steps 10 x 3 s, holding steps 10 x 1 s twice."""
    costly = plan({1: 1.0, 2: 3.0})
    assert rollout(costly, 0.0, {"a": 10}, [Queued("b", 5, 10)], 0.0) == (True, 30.0)
    feasible, held_s = rollout(costly, 0.0, {"a": 10}, [Queued("b", 5, 10)], HOLD_STEPS * 1.0)
    assert feasible and held_s == pytest.approx(20.0)
    assert not join_now(costly, 0.0, {"a": 10}, [Queued("b", 5, 10)])


def test_a_join_that_holding_would_make_late_goes_now():
    """The same costs. Held, b starts when the hold ends (16 s; a left at 10 s) and ends at 26 s:
    due by 31 s, it is held; due by 25 s, holding would make it late, so it joins now."""
    job = [Queued("b", 5, 10)]
    assert not join_now(plan({1: 1.0, 2: 3.0}, {"b": 31.0}), 0.0, {"a": 10}, job)
    assert join_now(plan({1: 1.0, 2: 3.0}, {"b": 25.0}), 0.0, {"a": 10}, job)


def test_when_batching_pays_the_join_goes_now():
    assert join_now(plan({1: 1.0, 2: 1.2}), 0.0, {"a": 10}, [Queued("b", 5, 10)])


def test_with_every_time_known_the_lookahead_decodes_more_within_the_bound():
    rule = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, oracle=True)
    ahead = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, oracle=True, lookahead=True)
    assert ahead["worst_latency_x"] <= 1.5
    assert ahead["decode_x"] > 1.1 * rule["decode_x"], (ahead, rule)


def test_the_lookahead_waits_for_steps_measured_near_the_batch_it_would_play():
    """Learning its times, a group's first burst has measured only small batches: a rollout
    would play the queue's flood on estimates from above, so the greedy rule decides. A second
    burst in the same group, with large batches measured, is played forward, and decodes more
    than the rule within the bound."""
    budget = JoinBudget(1.5, H200_SERVICE_WARM_UP, lookahead=True)
    for _ in range(PROBE_STEPS):
        budget.times.saw_step(1, H200_COMPILED_STEPS(1))
    assert not budget.times.covers(32)
    assert budget._join_now(0.0, {"a": 256}, [Waiting(str(i), 0.0, 1000, 256) for i in range(31)])
    rule_first = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, H200_SERVICE_WARM_UP)
    first = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, budget=budget)
    assert first == rule_first  # nothing measured near 32 rows yet: the rule's joins
    assert budget.times.covers(32)
    rule = JoinBudget(1.5, H200_SERVICE_WARM_UP)
    simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, budget=rule)
    second = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, budget=budget, start=1e3)
    rule_second = simulate(32, 0.12, H200_COMPILED_STEPS, 256, 32, 1.5, budget=rule, start=1e3)
    assert second["worst_latency_x"] <= 1.5
    assert second["decode_x"] > 1.05 * rule_second["decode_x"], (second, rule_second)
