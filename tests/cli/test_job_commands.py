"""`ringq --version`, `result` of a job that has not ended, `jobs --state/--limit`: click against
a real Redis, with no dispatcher (so submitted jobs stay queued)."""

import json
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version

import pytest
from click.testing import CliRunner, Result

from cli.main import cli
from jobs.settings import get_settings


@pytest.fixture
def ringq(redis_url, redis_conn, monkeypatch) -> Iterator:
    """Run `ringq ARGS` in-process against the test Redis (emptied by redis_conn)."""
    monkeypatch.setenv("RINGQ_REDIS_URL", redis_url)
    get_settings.cache_clear()

    def invoke(*args: str) -> Result:
        return CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"})

    yield invoke
    monkeypatch.undo()
    get_settings.cache_clear()


def submit_queued(ringq, tmp_path, name: str) -> str:
    (tmp_path / name).write_text(f"The document {name}.")
    submitted = ringq("submit", "prefill", str(tmp_path / name), "--model", "random:tiny-llama")
    assert submitted.exit_code == 0, submitted.output
    return submitted.stdout.strip()


def test_version_prints_the_installed_version():
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"ringq {version('ringq')}\n"


def test_result_of_a_job_that_has_not_ended_exits_3(ringq, tmp_path):
    job_id = submit_queued(ringq, tmp_path, "doc.txt")

    shown = ringq("result", job_id)
    assert shown.exit_code == 3, shown.output
    assert shown.stdout.strip() == "state: queued (no result yet; --wait waits for it)"

    waited = ringq("result", job_id, "--wait", "0.3", "--json")
    assert waited.exit_code == 3, waited.output
    payload = json.loads(waited.stdout)
    assert (payload["id"], payload["state"], payload["text"]) == (job_id, "queued", None)


def test_jobs_filtered_by_state_and_limited(ringq, redis_conn, tmp_path):
    older = submit_queued(ringq, tmp_path, "a.txt")
    newer = submit_queued(ringq, tmp_path, "b.txt")
    cancelled = ringq("cancel", older)
    assert cancelled.exit_code == 0, cancelled.output

    listed = ringq("jobs", "--state", "queued", "--limit", "1", "--json")
    assert listed.exit_code == 0, listed.output
    assert [job["id"] for job in json.loads(listed.stdout)["jobs"]] == [newer]

    both = json.loads(ringq("jobs", "--limit", "2", "--json").stdout)["jobs"]
    assert [(job["id"], job["state"]) for job in both] == [(newer, "queued"), (older, "cancelled")]
    assert ringq("jobs", "--state", "failed").stdout == "no jobs in state failed\n"
