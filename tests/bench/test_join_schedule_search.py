"""bench.join_schedule_search's cells: a schedule's ends and step time worked out by hand (the
H200 cell and the CPU one), and a search that never returns a schedule worse than where it
started."""

import pytest

from bench.join_budget_sim import H200_SERVICE_STEPS
from bench.join_budget_sim import cpu_smollm2_steps as cpu_steps
from bench.join_schedule_search import (
    CPU_FOUND,
    JOBS,
    MAX_TOKENS,
    PREFILL_S,
    Cell,
    anneal,
    cell_for,
)


def test_job_0_alone_then_the_rest_ends_when_the_flood_does():
    """Job 0 alone: 0.12 s + 256 x 7.0 ms; then 31 prefills and 256 steps of 31 rows."""
    cell = Cell(H200_SERVICE_STEPS)
    stepped_s, ends = cell.run([0] + [MAX_TOKENS] * (JOBS - 1))
    alone = PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(1)
    flood = (JOBS - 1) * PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(JOBS - 1)
    assert ends[0] == pytest.approx(alone)
    assert list(ends[1:]) == pytest.approx([alone + flood] * (JOBS - 1))
    assert stepped_s == pytest.approx(MAX_TOKENS * (H200_SERVICE_STEPS(1) + H200_SERVICE_STEPS(31)))


def test_all_at_once_decodes_as_the_widest_step_does():
    cell = Cell(H200_SERVICE_STEPS)
    found = cell.outcome([0] * JOBS)
    widest = JOBS * H200_SERVICE_STEPS(1) / H200_SERVICE_STEPS(JOBS)
    assert found["decode_x"] == pytest.approx(widest, abs=0.01)
    one_at_a_time_first = PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(1)
    first_end = JOBS * PREFILL_S + MAX_TOKENS * H200_SERVICE_STEPS(JOBS)
    assert found["worst_latency_x"] == pytest.approx(first_end / one_at_a_time_first, abs=0.001)


def test_a_search_keeps_its_start_or_better():
    cell = Cell(H200_SERVICE_STEPS)
    start = [0] + [MAX_TOKENS] * (JOBS - 1)
    best = anneal(cell, 1.5, start, moves=300, seed=0)
    assert cell.score(best, 1.5) <= cell.score(start, 1.5)


def test_the_cpu_cell_two_together_then_six_together():
    """Jobs 0-1 prefill (2 x 2.36 s) and decode 64 steps of 2 rows; then jobs 2-7 prefill and
    decode 64 steps of 6 rows."""
    cell, found = cell_for("cpu", 1.0)
    assert found == CPU_FOUND == [0, 0, 64, 64, 64, 64, 64, 64]
    stepped_s, ends = cell.run(found)
    first = 2 * 2.36 + 64 * cpu_steps(2)
    assert list(ends) == pytest.approx([first] * 2 + [first + 6 * 2.36 + 64 * cpu_steps(6)] * 6)
    assert stepped_s == pytest.approx(64 * (cpu_steps(2) + cpu_steps(6)))
    alone = 2.36 + 64 * cpu_steps(1)
    assert cell.outcome(found)["worst_latency_x"] == pytest.approx(ends[2] / (3 * alone), abs=1e-3)
