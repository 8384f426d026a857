"""The join budget's lookahead (ring_worker/join_lookahead.py): rollouts worked out by hand, a
hold chosen where batching costs more than it saves, a join kept where holding would miss a
deadline; and, in the simulated H200 service cell with every time known, more decode than the
greedy rule at the same bound."""

import math

import pytest

from bench.join_budget_sim import H200_COMPILED_STEPS, simulate
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
