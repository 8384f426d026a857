"""The pure parts of `ringq bench`: planning cells, running the schedule, summaries and ratios."""

import pytest

from cli.bench_report import (
    Cell,
    CellFailed,
    parse_choices,
    parse_positive_ints,
    plan_cells,
    plot_series,
    report_table,
    run_schedule,
    summarize_all,
    tile_tokens,
)
from jobs.schemas import JobResult


def result(prompt_tps: float, ranks: int = 1, generated: int = 4) -> JobResult:
    return JobResult(
        prompt_tokens=64,
        generated_tokens=generated,
        prompt_tps=prompt_tps,
        generation_tps=10.0,
        load_s=0.5,
        prefill_s=64 / prompt_tps,
        decode_s=0.4,
        peak_memory_bytes=[int(prompt_tps)] * ranks,
    )


@pytest.mark.parametrize(
    ("strategies", "exchanges", "decode_kvs", "labels"),
    [
        (["single"], ["rotate", "allgather"], ["sharded"], ["single"]),
        (["pipeline"], ["allgather"], ["sharded"], ["pipeline-4"]),
        (
            ["ring", "single"],
            ["rotate", "allgather"],
            ["replicated", "sharded"],
            [
                "ring-4 rotate/replicated",
                "ring-4 rotate/sharded",
                "ring-4 allgather/replicated",
                "ring-4 allgather/sharded",
                "single",
            ],
        ),
    ],
)
def test_plan_cells_crosses_ring_options_only_for_ring(strategies, exchanges, decode_kvs, labels):
    cells = plan_cells([64, 128], strategies, 4, exchanges, decode_kvs)
    assert [c.label for c in cells] == labels * 2
    assert [c.pp_tokens for c in cells] == [64] * len(labels) + [128] * len(labels)
    assert all(c.ranks == (1 if c.strategy == "single" else 4) for c in cells)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64", [64]), ("2048, 4096,8192", [2048, 4096, 8192]), ("64,64,32", [64, 32])],
)
def test_parse_positive_ints(text, expected):
    assert parse_positive_ints(text) == expected


@pytest.mark.parametrize("text", ["abc", "64,", "0", "-5", "1.5", ""])
def test_parse_positive_ints_rejects(text):
    with pytest.raises(ValueError, match="not a positive integer"):
        parse_positive_ints(text)


def test_parse_choices():
    assert parse_choices("ring, single,ring", ["single", "ring"]) == ["ring", "single"]
    with pytest.raises(ValueError, match="'pipe' is not one of single, ring"):
        parse_choices("ring,pipe", ["single", "ring"])


@pytest.mark.parametrize(
    ("count", "expected"), [(1, [1]), (3, [1, 2, 3]), (7, [1, 2, 3] * 2 + [1])]
)
def test_tile_tokens(count, expected):
    assert tile_tokens([1, 2, 3], count) == expected


def test_schedule_keeps_failed_cells_and_computes_ratios() -> None:
    cells = plan_cells([64, 128], ["single", "ring", "pipeline"], 2, ["rotate"], ["replicated"])
    speed = {"single": 100.0, "ring": 150.0}
    calls: list[Cell] = []
    seen: list[tuple[str, str | None]] = []

    def run_one(cell: Cell) -> JobResult:
        calls.append(cell)
        if cell.strategy == "pipeline":
            raise CellFailed("rank 1 (local): NotImplementedError: pipeline")
        return result(speed[cell.strategy] * cell.pp_tokens / 64 + len(calls), cell.ranks)

    outcomes = run_schedule(cells, 1, 3, run_one, lambda c, tag, r, e: seen.append((tag, e)))
    pipeline_calls = [c for c in calls if c.strategy == "pipeline"]
    assert len(pipeline_calls) == 2, "a failed cell is not run again"
    assert len(calls) == 2 + 4 * 4
    assert seen[0] == ("warmup 1/1", None) and seen[-1] == ("run 3/3", None)

    report = summarize_all(outcomes)
    by_key = {(c["pp"], c["label"]): c for c in report}
    failed = by_key[(64, "pipeline-2")]
    assert failed["status"] == "failed" and failed["prompt_tps"] is None
    assert failed["error"] == "warmup 1: rank 1 (local): NotImplementedError: pipeline"
    assert failed["ratio_vs_single"] is None
    for pp in (64, 128):
        single, ring = by_key[(pp, "single")], by_key[(pp, "ring-2 rotate/replicated")]
        assert single["status"] == ring["status"] == "ok"
        assert len(ring["runs"]) == 3, "warm-ups are not measured"
        assert single["ratio_vs_single"] == 1.0
        assert ring["ratio_vs_single"] == pytest.approx(
            ring["prompt_tps"]["median"] / single["prompt_tps"]["median"]
        )
        assert ring["prompt_tps"]["min"] < ring["prompt_tps"]["median"] < ring["prompt_tps"]["max"]
        assert ring["peak_memory_bytes"] == [int(ring["prompt_tps"]["max"])] * 2
    assert set(plot_series(report)) == {"single", "ring-2 rotate/replicated"}
    assert [p[0] for p in plot_series(report)["single"]] == [64, 128]


def test_ratio_is_null_without_a_single_cell():
    cells = plan_cells([64], ["ring"], 2, ["rotate"], ["replicated"])
    (cell,) = summarize_all(run_schedule(cells, 0, 1, lambda c: result(50.0, 2)))
    assert cell["status"] == "ok" and cell["ratio_vs_single"] is None


def test_report_table_has_a_row_per_cell():
    cells = plan_cells([64], ["single", "ring"], 2, ["rotate"], ["replicated"])

    def run_one(cell: Cell) -> JobResult:
        if cell.strategy == "ring":
            raise CellFailed("boom")
        return result(80.0)

    report = {
        "date_utc": "2026-01-01T00:00:00+00:00",
        "config": {"model": "tiny", "tg": 4, "chunk_tokens": 64, "repeat": 1, "warmup": 0},
        "machine": {
            "platform": "Linux",
            "cpu_count": 2,
            "mlx_version": "0.32.4",
            "backend": "cpu",
            "load_avg_start": [0.1, 0, 0],
            "load_avg_end": [0.2, 0, 0],
            "source": None,
        },
        "cells": summarize_all(run_schedule(cells, 0, 1, run_one)),
    }
    table = report_table(report)
    assert table.row_count == 2
