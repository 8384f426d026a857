"""The lead rank's progress reports (ring_worker/runtime/job_report.py): rates from the phase's
start."""

import math
import time
from typing import Any, cast

from jobs.schemas import Progress
from ring_worker.runtime.batch_serve import pace
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.job_report import ReportClock, throttled


class Recorded:
    """Where the reports go (the part of JobIO that `throttled` writes to)."""

    job_id = "j"

    def __init__(self) -> None:
        self.reports: list[Progress] = []

    def progress(self, progress: Progress) -> None:
        self.reports.append(progress)


def test_a_phase_first_report_has_no_rate_and_later_ones_count_from_its_start():
    io = Recorded()
    report = throttled(cast(JobIO, cast(Any, io)), lead=True)
    report("decode", 1, 10)  # the phase starts: no time has passed, no rate (was 1 / 1e-9)
    time.sleep(0.05)
    report("decode", 10, 10)
    first, last = io.reports
    assert first.generation_tps == 0.0 and first.prompt_tps == 0.0
    assert 0 < last.generation_tps <= 10 / 0.05
    assert last.prompt_tps == 0.0


def test_only_the_lead_rank_reports():
    io = Recorded()
    throttled(cast(JobIO, cast(Any, io)), lead=False)("prefill", 1, 1)
    assert io.reports == []


def test_a_clock_paces_the_reports_between_a_phases_first_and_last():
    io = Recorded()
    clock = ReportClock(
        interval_s=3600.0
    )  # a batch member's, paced (ring_worker/runtime/batch_serve.py)
    report = throttled(cast(JobIO, cast(Any, io)), lead=True, clock=clock)
    for done in range(1, 11):
        report("decode", done, 10)
    assert [r.processed for r in io.reports] == [1, 10]
    clock.interval_s = 0.0
    report("decode", 5, 10)
    assert io.reports[-1].processed == 5


def test_pace_grows_as_the_square_root_of_the_batch():
    assert pace(1) == 1.0 and pace(0) == 1.0
    assert pace(4) == 2.0 and pace(32) == math.sqrt(32)


def test_a_prefills_eta_weighs_the_work_left_by_its_cost():
    """Later tokens of a long prompt cost more: with work growing as the square of the tokens
    done, half the tokens leave three times the work done, so the ETA is 3x the time so far."""
    io = Recorded()
    report = throttled(cast(JobIO, cast(Any, io)), lead=True, cost=lambda a, b: b * b - a * a)
    report("prefill", 0, 100)
    time.sleep(0.3)  # past the throttle's interval
    report("prefill", 50, 100)
    first, last = io.reports
    assert first.eta_s is None  # no work done yet to go by
    elapsed = 50 / last.prompt_tps
    assert last.eta_s is not None and math.isclose(last.eta_s, 3 * elapsed, rel_tol=1e-6)


def test_a_prefill_logs_the_chunk_ends_its_eta_was_fitted_to(caplog):
    io = Recorded()
    report = throttled(cast(JobIO, cast(Any, io)), lead=True, cost=lambda start, end: end - start)
    with caplog.at_level("INFO", logger="ring_worker.runtime.job_report"):
        for done in (0, 100, 200, 300):
            report("prefill", done, 300)
    (line,) = [r.getMessage() for r in caplog.records if "prefill chunks" in r.getMessage()]
    assert [int(end.split(":")[0]) for end in line.split(") ")[1].split()] == [0, 100, 200, 300]
