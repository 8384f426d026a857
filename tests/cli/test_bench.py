"""`ringq bench` as a user runs it: a real process that starts real rank groups on a tiny model."""

import json
import os
import subprocess
import sys

import pytest

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METRICS = ("prompt_tps", "generation_tps", "prefill_s", "decode_s", "load_s")


def ringq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=timeout,
    )


def test_bench_measures_every_cell(tiny_llama_dir, tmp_path):
    json_out, plot = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    proc = ringq(
        "bench",
        "--model",
        str(tiny_llama_dir),
        "--pp",
        "128",  # one prompt length: every cell starts fresh ranks (test_bench_report crosses pp)
        "--tg",
        "4",
        "--strategy",
        "single,ring,pipeline,mlx-lm",
        "--warmup",
        "0",
        "--repeat",
        "1",
        "--chunk-tokens",
        "64",
        "--json",
        "--json-out",
        str(json_out),
        "--plot",
        str(plot),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert json.loads(json_out.read_text()) == report
    assert report["command"].startswith("ringq bench --model")
    assert report["machine"]["cpu_count"] >= 1 and report["machine"]["backend"] in (
        "cpu",
        "metal",
        "cuda",
    )
    assert report["config"]["pp"] == [128] and report["config"]["chunk_tokens"] == 64
    cells = {(c["pp"], c["strategy"]): c for c in report["cells"]}
    strategies = ("single", "ring", "pipeline", "mlx-lm")
    assert set(cells) == {(128, s) for s in strategies}
    assert report["machine"]["matmul_peak"]["tflops"] > 0
    for (pp, strategy), cell in cells.items():
        assert cell["status"] == "ok" and cell["error"] is None, cell
        assert all(cell[name]["min"] > 0 for name in METRICS), cell
        assert 1 <= cell["generated_tokens"]["max"] <= 4
        assert cell["runs"][0]["prompt_tokens"] == pp
        assert len(cell["peak_memory_bytes"]) == (1 if strategy in ("single", "mlx-lm") else 2)
        assert all(b > 0 for b in cell["peak_memory_bytes"])
        assert cell["ratio_vs_single"] > 0 and cell["ratio_vs_mlx_lm"] > 0
        assert 0 < cell["mfu"] < 1
    assert cells[(128, "single")]["ratio_vs_single"] == 1.0
    assert cells[(128, "mlx-lm")]["ratio_vs_mlx_lm"] == 1.0
    assert plot.read_bytes().startswith(PNG_SIGNATURE) and plot.stat().st_size > 1000


def test_failed_cells_are_reported_not_fatal(broken_model_dir, tmp_path):
    json_out = tmp_path / "bench.json"
    proc = ringq(
        "bench",
        "--model",
        str(broken_model_dir),
        "--pp",
        "64",
        "--tg",
        "2",
        "--strategy",
        "single,ring",
        "--warmup",
        "1",
        "--repeat",
        "2",
        "--json-out",
        str(json_out),
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("Error: every cell failed")
    assert "failed" in proc.stdout  # the table is still printed
    report = json.loads(json_out.read_text())
    assert [c["status"] for c in report["cells"]] == ["failed", "failed"]
    for cell in report["cells"]:
        assert cell["error"].startswith("warmup 1: rank "), cell["error"]
        assert cell["prompt_tps"] is None and cell["ratio_vs_single"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "abc"], "Invalid value for '--pp': 'abc' is not a positive integer"),
        (["--pp", "64,0"], "'0' is not a positive integer"),
        (["--repeat", "0"], "Invalid value for '--repeat'"),
        (["--strategy", "ring,tree"], "'tree' is not one of single, ring, pipeline"),
        (["--exchange", "broadcast"], "'broadcast' is not one of rotate, allgather"),
        (["--ranks", "1"], "Invalid value for '--ranks'"),
        (["--pp", "8190", "--tg", "4"], "exceeds"),
        (["--model", "gpt-17"], "gpt-17"),
    ],
)
def test_bad_arguments_are_one_line(tiny_llama_dir, args, message):
    model = [] if "--model" in args else ["--model", str(tiny_llama_dir)]
    proc = ringq("bench", *model, *args, timeout=60)
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], lines
