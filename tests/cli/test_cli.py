"""The `ringq` command as a user runs it: a real process, real Redis, real ranks."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli.main import cli
from jobs import keys

DOCUMENT = "The Eddystone rocks lie fourteen kilometres off Plymouth. " * 30


def ringq(*args, env_extra=None, stdin=None, timeout=180):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        input=stdin,
        timeout=timeout,
    )


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(DOCUMENT)
    return path


def test_run_ring_and_single_agree(doc, tiny_llama_dir):
    common = [
        "generate",
        str(doc),
        "--model",
        str(tiny_llama_dir),
        "--max-tokens",
        "8",
        "--prompt",
        "Where?",
        "--json",
        "--chunk-tokens",
        "64",
    ]
    ring = json.loads(ringq("run", *common, "--strategy", "ring", "--ranks", "2").stdout)
    single = json.loads(ringq("run", *common, "--strategy", "single").stdout)
    for payload in (ring, single):
        assert {
            "id",
            "state",
            "text",
            "prompt_tokens",
            "generated_tokens",
            "prompt_tps",
            "generation_tps",
            "peak_memory_bytes",
        } <= payload.keys()
    assert ring["state"] == "finished" and ring["ranks"] == 2
    assert len(ring["peak_memory_bytes"]) == 2 and len(single["peak_memory_bytes"]) == 1
    assert ring["text"] == single["text"] and ring["prompt_tokens"] == single["prompt_tokens"]


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["run", "prefill", "/no/such/file"], "no such file"),
        (b"\xff\xfe\x00binary", ["run", "prefill", "{file}"], "not UTF-8"),
        (b"   \n", ["run", "prefill", "{file}"], "empty"),
        (b"text", ["run", "prefill", "{file}", "--model", "gpt-17"], "gpt-17"),
        (b"text", ["run", "generate", "{file}", "--max-tokens", "0"], "max_tokens"),
        (b"text", ["submit", "prefill", "{file}", "--ranks", "two"], "ranks"),
    ],
)
def test_bad_input_is_one_line_on_stderr(tmp_path, setup, args, message):
    file = tmp_path / "input"
    if setup is not None:
        file.write_bytes(setup)
    proc = ringq(*[a.replace("{file}", str(file)) for a in args])
    assert proc.returncode != 0
    assert message in proc.stderr
    assert proc.stdout == ""
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) <= 2  # click's "Error:"


@pytest.mark.parametrize(
    ("name", "value"), [("RINGQ_MAX_BATCH", "abc"), ("RINGQ_ALLOWED_DIRS", "[1")]
)
def test_a_bad_setting_is_named_once_as_a_command_starts(tmp_path, name, value):
    proc = ringq("up", env_extra={name: value, "RINGQ_HOME": str(tmp_path)}, timeout=60)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: bad setting {name}={value}: ")
    assert not (tmp_path / "logs").exists()  # nothing was started


def test_submit_status_result_against_a_running_cluster(cluster, doc, tiny_llama_dir):
    env = {"RINGQ_REDIS_URL": cluster.url, "RINGQ_HOME": str(cluster.settings.home)}
    submitted = ringq(
        "submit",
        "generate",
        str(doc),
        "--model",
        str(tiny_llama_dir),
        "--prompt",
        "Where?",
        "--max-tokens",
        "6",
        "--ranks",
        "2",
        "--id",
        "cli-job-1",
        env_extra=env,
    )
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.strip() == "cli-job-1"
    watched = ringq("status", "cli-job-1", "--watch", "--json", env_extra=env)
    status = json.loads(watched.stdout)
    assert status["state"] == "finished", status
    assert status["placement"]["strategy"] == "ring" and status["placement"]["ranks"] == 2
    assert {"id", "kind", "state", "progress", "placement", "error"} <= status.keys()
    result = json.loads(ringq("result", "cli-job-1", "--json", env_extra=env).stdout)
    assert result["state"] == "finished" and result["generated_tokens"] >= 1
    assert len(result["peak_memory_bytes"]) == 2
    assert status["progress"]["processed"] == result["generated_tokens"]  # not one short
    assert_stop_string_ends_the_text(env, doc, tiny_llama_dir, result["text"])
    nodes = json.loads(ringq("nodes", "--json", env_extra=env).stdout)
    assert {n["name"] for n in nodes["nodes"]} >= {"node-0", "node-1"}
    again = ringq("submit", "prefill", str(doc), "--id", "cli-job-1", env_extra=env)
    assert again.returncode == 1 and "already exists" in again.stderr


def assert_stop_string_ends_the_text(env, doc, model_dir, text: str) -> None:
    """The same greedy job with a stop string taken from its answer ends where it appears."""
    if not text.strip():
        pytest.skip(f"the tiny model answered whitespace only ({text!r}): no stop string to pick")
    stop = text.strip()[len(text.strip()) // 2]
    submitted = ringq(
        *("submit", "generate", str(doc), "--model", str(model_dir), "--prompt", "Where?"),
        *("--max-tokens", "6", "--ranks", "2", "--stop", stop, "--seed", "1"),
        env_extra=env,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    waited = ringq("result", job_id, "--wait", "120", "--json", env_extra=env)
    assert waited.returncode == 0, waited.stderr
    stopped = json.loads(waited.stdout)
    assert stopped["text"] == text[: text.index(stop)]


def test_status_of_unknown_job(cluster):
    proc = ringq("status", "nope", env_extra={"RINGQ_REDIS_URL": cluster.url})
    assert proc.returncode == 1 and "no job 'nope'" in proc.stderr


def test_the_old_flags_still_work_with_a_note_and_the_record_has_the_new_names(
    redis_url, redis_conn, doc, tmp_path
):
    env = {"RINGQ_REDIS_URL": redis_url, "RINGQ_HOME": str(tmp_path)}
    common = ("submit", "prefill", str(doc), "--model", "random:tiny-llama")
    old = ringq(*common, "--sharding", "pipeline", "--ring-size", "2", env_extra=env)
    assert old.returncode == 0, old.stderr
    assert old.stderr.splitlines() == [
        "--sharding is deprecated, use --strategy",
        "--ring-size is deprecated, use --ranks",
    ]
    new = ringq(*common, "--strategy", "pipeline", "--ranks", "2", env_extra=env)
    assert new.returncode == 0 and new.stderr == ""
    for job_id in (old.stdout.strip(), new.stdout.strip()):
        spec = json.loads(redis_conn.hget(keys.job(job_id), "spec"))
        assert (spec["strategy"], spec["ranks"]) == ("pipeline", 2), spec
        assert not {"sharding", "ring_size"} & spec.keys()
    bad = ringq(*common, "--ring-size", "two", env_extra=env)
    assert bad.returncode == 2 and "'two' is not a number or 'auto'" in bad.stderr


@pytest.mark.parametrize(
    ("command", "new", "old"),
    [
        ("submit", ["--strategy", "--ranks"], ["--sharding", "--ring-size"]),
        ("run", ["--strategy", "--ranks"], ["--sharding", "--ring-size"]),
        ("bench", ["--strategy", "--ranks"], ["--sharding", "--ring-size"]),
        ("demo", ["--ranks"], ["--ring-size"]),
    ],
)
def test_help_shows_only_the_new_flag_names(command, new, old):
    shown = CliRunner().invoke(cli, [command, "--help"]).output
    assert all(flag in shown for flag in new) and not any(flag in shown for flag in old)
