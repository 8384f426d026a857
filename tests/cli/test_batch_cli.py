"""`ringq batch ...` and multi-file `ringq submit`, driven through click against a real Redis."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cli.main import cli
from jobs import keys
from jobs.settings import get_settings
from jobs.store import JobStore
from jobs.submit import admit_queue


@pytest.fixture
def ringq(redis_url, redis_conn, monkeypatch) -> Iterator:
    """Run `ringq ARGS` in-process against the test Redis (emptied by redis_conn)."""
    monkeypatch.setenv("RINGQ_REDIS_URL", redis_url)
    get_settings.cache_clear()

    def invoke(*args: str, stdin: str | None = None) -> Result:
        return CliRunner().invoke(cli, list(args), input=stdin, env={"COLUMNS": "200"})

    yield invoke
    monkeypatch.undo()
    get_settings.cache_clear()


def write_lines(path: Path, *lines: object) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def request(custom_id: str, text: str = "What is ringq?") -> dict:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


@pytest.fixture
def batch_file(tmp_path) -> Path:
    (tmp_path / "doc.txt").write_text("A document on disk.")
    plain = {"custom_id": "p", "document_path": "doc.txt", "kind": "prefill"}
    return write_lines(tmp_path / "in.jsonl", request("a"), plain, request("b"))


def test_submit_status_results_cancel(ringq, redis_conn, batch_file, tmp_path):
    submitted = ringq("batch", "submit", str(batch_file), "--model", "smollm2", "--json")
    assert submitted.exit_code == 0, submitted.output
    summary = json.loads(submitted.stdout)
    batch_id = summary["id"]
    assert (
        summary["total"] == 3 and summary["skipped"] == [] and summary["input_name"] == "in.jsonl"
    )
    assert admit_queue(redis_conn).count == 3
    store = JobStore(redis_conn)
    store.fail(f"{batch_id}-1", "rank 0 died")

    status = json.loads(ringq("batch", "status", batch_id, "--json").stdout)
    assert (status["total"], status["queued"], status["failed"], status["done"]) == (3, 2, 1, False)
    text = ringq("batch", "status", batch_id).stdout
    assert "queued 2" in text and "failed 1" in text

    cancelled = json.loads(ringq("batch", "cancel", batch_id, "--json").stdout)
    assert cancelled == {"id": batch_id, "cancelled": 2, "stopping": 0, "already_final": 1}
    watched = ringq("batch", "status", batch_id, "--watch", "--json")
    assert json.loads(watched.stdout)["done"] is True and "3/3" in watched.stderr

    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    written = ringq("batch", "results", batch_id, "-o", str(out), "--errors", str(errors), "--json")
    counts = json.loads(written.stdout)
    assert (counts["errors_written"], counts["failed"], counts["cancelled"]) == (3, 1, 2)
    assert out.read_text() == ""
    codes = [json.loads(line)["error"]["code"] for line in errors.read_text().splitlines()]
    assert codes == ["failed", "cancelled", "cancelled"]
    plain_text = ringq("batch", "results", batch_id, "-o", str(out)).stdout
    assert "error lines (1 failed, 2 cancelled, 0 skipped): not written (use --errors FILE)" in (
        plain_text
    )


def test_invalid_lines_refuse_the_whole_batch(ringq, redis_conn, tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", request("a"), request("a"), {"custom_id": "c"})
    refused = ringq("batch", "submit", str(path), "--model", "smollm2")
    assert refused.exit_code == 1 and refused.stdout == ""
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "2 invalid line(s), nothing enqueued" in refused.stderr
    assert "line 2: custom_id 'a' repeats line 1" in refused.stderr and "line 3:" in refused.stderr
    assert admit_queue(redis_conn).count == 0 and not redis_conn.keys(f"{keys.PREFIX}:batch:*")


def test_skip_invalid_enqueues_the_good_lines(ringq, redis_conn, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(request("a")) + "\n{oops\n" + json.dumps(request("b")) + "\n")
    result = ringq("batch", "submit", str(path), "--model", "smollm2", "--skip-invalid")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("skipped line 2: invalid JSON")
    batch_id = result.stdout.strip()
    assert admit_queue(redis_conn).count == 2
    status = json.loads(ringq("batch", "status", batch_id, "--json").stdout)
    assert status["total"] == 2 and status["skipped_lines"] == 1
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    written = ringq("batch", "results", batch_id, "-o", str(out), "--errors", str(errors), "--json")
    assert json.loads(written.stdout)["skipped"] == 1
    [skipped] = [json.loads(line) for line in errors.read_text().splitlines()]
    assert skipped["error"]["code"] == "skipped" and skipped["custom_id"] is None
    assert skipped["error"]["message"].startswith("line 2: invalid JSON")


def test_openai_model_names_get_one_hint_to_use_model(ringq, batch_file):
    result = ringq("batch", "submit", str(batch_file))
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.count("model 'gpt-4o-mini' not found") == 1  # in the hint, once
    assert result.stderr.count("does not run here (see the hint)") == 2  # lines 1 and 3
    assert "`ringq batch submit --model smollm2` runs every line on one model" in result.stderr


def test_batch_list_newest_first_with_counts(ringq, redis_conn, batch_file):
    first = ringq("batch", "submit", str(batch_file), "--model", "smollm2").stdout.strip()
    second = ringq("batch", "submit", str(batch_file), "--model", "smollm2").stdout.strip()
    ringq("cancel", f"{second}-1")
    listed = json.loads(ringq("batch", "list", "--json").stdout)["batches"]
    assert [b["id"] for b in listed] == [second, first]
    assert (listed[0]["total"], listed[0]["queued"], listed[0]["cancelled"]) == (3, 2, 1)
    table = ringq("batch", "list").stdout
    assert first in table and "in.jsonl" in table
    jobs = json.loads(ringq("jobs", "--batch", second, "--json").stdout)["jobs"]
    assert [j["id"] for j in jobs] == [f"{second}-1", f"{second}-2", f"{second}-3"]
    assert [j["state"] for j in jobs] == ["cancelled", "queued", "queued"]
    assert [j["custom_id"] for j in jobs] == ["a", "p", "b"]


def test_unknown_batch_is_one_line(ringq):
    result = ringq("batch", "status", "nope")
    assert (
        result.exit_code == 1
        and result.stderr.strip()
        == "Error: no batch 'nope' (it never existed or its record expired)"
    )


def test_batch_help_explains_the_line_forms(ringq):
    result = ringq("batch", "--help")
    assert result.exit_code == 0 and "/v1/chat/completions" in result.stdout
    for command in ("submit", "status", "results", "cancel"):
        assert ringq("batch", command, "--help").exit_code == 0


@pytest.fixture
def docs(tmp_path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("b.txt", "a.txt", "c.md", ".hidden"):
        (folder / name).write_text(f"The document {name}.")
    (folder / "sub").mkdir()
    return folder


def test_submit_a_directory_one_job_per_file(ringq, redis_conn, docs):
    result = ringq("submit", "prefill", str(docs))
    assert result.exit_code == 0, result.output
    ids = result.stdout.split()
    names = [JobStore(redis_conn).get(job_id).spec.document_name for job_id in ids]
    assert names == ["a.txt", "b.txt", "c.md"]
    assert admit_queue(redis_conn).count == 3


def test_submit_files_and_a_glob_as_a_json_list(ringq, docs):
    result = ringq("submit", "generate", str(docs / "c.md"), str(docs / "*.txt"), "--json")
    assert result.exit_code == 0, result.output
    jobs = json.loads(result.stdout)
    assert [job["state"] for job in jobs] == ["queued"] * 3


def test_submit_one_file_keeps_its_single_output(ringq, docs):
    plain = ringq("submit", "prefill", str(docs / "a.txt"), "--id", "only-one")
    assert plain.stdout == "only-one\n"
    as_json = json.loads(ringq("submit", "prefill", str(docs / "b.txt"), "--json").stdout)
    assert isinstance(as_json, dict) and as_json["state"] == "queued"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{docs}/a.txt", "{docs}/b.txt", "--id", "x"], "--id names one job: give one FILE"),
        (["{docs}/*.pdf"], "no files match this pattern"),
        (["{docs}/sub"], "a directory with no files"),
        (["{docs}/a.txt", "{docs}/missing.txt"], "missing.txt: no such file"),
    ],
)
def test_submit_bad_file_arguments_enqueue_nothing(ringq, redis_conn, docs, args, message):
    result = ringq("submit", "prefill", *[arg.replace("{docs}", str(docs)) for arg in args])
    assert result.exit_code != 0 and message in result.stderr
    assert admit_queue(redis_conn).count == 0
    assert redis_conn.zcard(keys.JOBS_INDEX) == 0
