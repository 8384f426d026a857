"""bench.join_schedule_search replays a schedule as bench.join_budget_sim's group runs it: the
join budget's own joins, replayed, give the budget's outcome; and a search never returns a
schedule worse than where it started."""

from bench.join_budget_sim import H200_SERVICE_STEPS, simulate
from bench.join_schedule_search import (
    JOBS,
    MAX_BATCH,
    MAX_TOKENS,
    PREFILL_S,
    run_schedule,
    score,
    search,
)


def test_the_rules_joins_replayed_give_the_rules_outcome():
    joins: list[float] = []
    rule = simulate(JOBS, PREFILL_S, H200_SERVICE_STEPS, MAX_TOKENS, MAX_BATCH, 1.5,
                    oracle=True, joins=joins)  # fmt: skip
    assert len(joins) == JOBS and joins == sorted(joins)
    assert run_schedule(joins, digits=2) == rule


def test_job_0_alone_then_the_rest_ends_when_the_flood_does():
    """Job 0 alone: 0.12 s + 256 x 7.0 ms; then 31 prefills and 256 steps at 32 rows (19 ms)."""
    alone = PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(1)
    found = run_schedule([0.0] + [alone] * (JOBS - 1))
    flood_s = (JOBS - 1) * PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(JOBS - 1)
    assert abs(found["makespan_s"] - (alone + flood_s)) < 0.05


def test_a_search_keeps_its_start_or_better():
    alone = PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(1)
    start = [0.0] + [alone] * (JOBS - 1)
    best, found = search(1.5, start, moves=100, seed=0)
    assert best == sorted(best)
    assert score(found, 1.5) >= score(run_schedule(start), 1.5)
