"""`ringq run`'s KV layout: --kv-layout, else RINGQ_KV_LAYOUT (cli/local_run.py::run_kv_layout),
and a real 2-rank run whose group spec carries the setting's layout."""

import json
import os
import subprocess
import sys

import pytest

from cli.local_run import run_kv_layout


@pytest.mark.parametrize(
    ("flag", "setting", "expected"),
    [
        (None, "auto", "replicated"),
        (None, "sharded", "sharded"),
        (None, "replicated", "replicated"),
        ("sharded", "auto", "sharded"),
        ("replicated", "sharded", "replicated"),
        ("sharded", "replicated", "sharded"),
    ],
)
def test_run_kv_layout(flag, setting, expected):
    assert run_kv_layout(flag, setting) == expected


def test_ringq_run_follows_the_kv_layout_setting(tmp_path, tiny_llama_dir):
    doc = tmp_path / "doc.txt"
    doc.write_text("The Eddystone rocks lie fourteen kilometres off Plymouth. " * 10)
    home = tmp_path / "home"
    env = {**os.environ, "RINGQ_HOME": str(home), "RINGQ_KV_LAYOUT": "sharded"}
    env.pop("RINGQ_DECODE_KV", None)
    args = ["run", "generate", str(doc), "--model", str(tiny_llama_dir), "--max-tokens", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", *args, "--ranks", "2", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["state"] == "finished"
    [group] = list((home / "runs").glob("run-*/group.json"))
    assert json.loads(group.read_text())["kv_layout"] == "sharded"
