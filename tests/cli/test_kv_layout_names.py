"""kv_layout is the one name of a ring's KV layout: `ringq bench --kv-layout`, `ringq run
--kv-layout`, RINGQ_KV_LAYOUT and the bench report's "kv_layout". The old names (--decode-kv,
RINGQ_DECODE_KV, "decode_kv") still work, with a deprecation note where a user typed them."""

import click
import pytest
from click.testing import CliRunner

from cli.bench import bench
from cli.bench_report import plan_cells, run_schedule, summarize_all
from cli.local_run import run
from jobs.schemas import JobResult
from jobs.settings import Settings


def parsed(command: click.Command, args: list[str]) -> dict:
    """The parameters click hands `command` for `args` (parsed, callbacks run, not invoked)."""
    with command.make_context(command.name or "", args) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize(
    ("args", "expected", "note"),
    [
        ([], ["replicated"], ""),
        (["--kv-layout", "sharded,replicated"], ["sharded", "replicated"], ""),
        (["--decode-kv", "sharded"], ["sharded"], "--decode-kv is deprecated, use --kv-layout\n"),
    ],
)
def test_bench_kv_layouts(args, expected, note, capsys):
    assert parsed(bench, args)["kv_layouts"] == expected
    assert capsys.readouterr().err == note


@pytest.mark.parametrize("flag", ["--kv-layout", "--decode-kv"])
def test_bench_rejects_an_unknown_kv_layout_by_name(flag):
    out = CliRunner().invoke(bench, [flag, "sharded,mirrored"])
    assert out.exit_code == 2
    assert "'mirrored' is not one of replicated, sharded" in out.output


@pytest.mark.parametrize(
    ("args", "expected", "note"),
    [
        (["--kv-layout", "sharded"], "sharded", ""),
        (["--decode-kv", "sharded"], "sharded", "--decode-kv is deprecated, use --kv-layout\n"),
    ],
)
def test_run_kv_layout(args, expected, note, capsys):
    assert parsed(run, ["prefill", "doc.txt", *args])["kv_layout"] == expected
    assert capsys.readouterr().err == note


@pytest.mark.parametrize("command", [bench, run])
def test_help_shows_kv_layout_only(command):
    shown = CliRunner().invoke(command, ["--help"]).output
    assert "--kv-layout" in shown and "--decode-kv" not in shown


@pytest.mark.parametrize("variable", ["RINGQ_KV_LAYOUT", "RINGQ_DECODE_KV"])
def test_the_kv_layout_setting_reads_both_names(variable, monkeypatch):
    monkeypatch.setenv(variable, "sharded")
    assert Settings().kv_layout == "sharded"
    monkeypatch.setenv(variable, "mirrored")
    with pytest.raises(ValueError, match="'auto', 'replicated' or 'sharded'"):
        Settings()


def test_the_bench_report_names_a_ring_cells_kv_layout_by_both_names():
    cells = plan_cells([64], ["ring"], 2, ["rotate"], ["sharded"])
    done = JobResult(
        prompt_tokens=64,
        generated_tokens=4,
        prompt_tps=100.0,
        generation_tps=10.0,
        load_s=0.5,
        prefill_s=0.64,
        decode_s=0.4,
        peak_memory_bytes=[1, 1],
    )
    (cell,) = summarize_all(run_schedule(cells, 0, 1, lambda c: done))
    assert (cell["label"], cell["kv_layout"], cell["decode_kv"]) == (
        "ring-2 rotate/sharded",
        "sharded",
        "sharded",
    )
