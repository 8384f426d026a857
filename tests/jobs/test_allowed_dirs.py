"""RINGQ_ALLOWED_DIRS: model paths and batch document_paths outside the allowed directories are
refused with a clear error, wherever they are read (CLI, dispatcher, ranks); symlinks and '..'
cannot escape; built-in and random models are unaffected."""

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import cli
from jobs.batch_input import Defaults, parse_batch_lines
from jobs.errors import ForbiddenPathError, ModelNotServedError
from jobs.files import allowed_path
from jobs.lifecycle import JobState
from jobs.model_catalog import resolve_model
from jobs.model_info import check_spec
from jobs.prompts import tokenize_and_check
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings, get_settings
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import private_cluster

JOB_TIMEOUT_S = 60


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path]:
    """(allowed, outside), side by side."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    return allowed, outside


@pytest.fixture
def allow(monkeypatch) -> Iterator[Callable[..., None]]:
    """Set RINGQ_ALLOWED_DIRS for this process (settings are cached: cleared both ways)."""

    def set_dirs(*paths: Path) -> None:
        monkeypatch.setenv("RINGQ_ALLOWED_DIRS", json.dumps([str(p) for p in paths]))
        get_settings.cache_clear()

    yield set_dirs
    monkeypatch.undo()
    get_settings.cache_clear()


def copy_model(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        shutil.copy(file, target / file.name)
    return target


def test_allowed_path_table(dirs):
    allowed, outside = dirs
    (allowed / "a.txt").write_text("a")
    (allowed / "escape").symlink_to(outside)
    (outside / "in").symlink_to(allowed)
    assert allowed_path(allowed / "a.txt", None, "x") == (allowed / "a.txt").resolve()
    assert allowed_path(outside / "b", None, "x") == (outside / "b").resolve()
    assert allowed_path(allowed / "a.txt", [allowed], "x") == (allowed / "a.txt").resolve()
    assert allowed_path(allowed / "new" / "f", [allowed], "x").name == "f"  # need not exist
    assert allowed_path(allowed, [allowed], "x") == allowed.resolve()
    assert allowed_path(outside / "in" / "a.txt", [allowed], "x").parent == allowed.resolve()
    for bad in (outside / "b", allowed / ".." / "outside" / "b", allowed / "escape" / "b"):
        with pytest.raises(ForbiddenPathError, match="is outside RINGQ_ALLOWED_DIRS"):
            allowed_path(bad, [allowed], "x")
    with pytest.raises(ForbiddenPathError, match=r"\(none\)"):
        allowed_path(allowed / "a.txt", [], "x")
    with pytest.raises(ForbiddenPathError, match="resolves to"):
        allowed_path(allowed / "escape" / "b", [allowed], "x")


def test_model_paths_outside_the_allowed_dirs_are_refused(dirs, tiny_llama_dir):
    allowed, outside = dirs
    inside_model = copy_model(tiny_llama_dir, allowed / "tiny")
    (allowed / "link").symlink_to(tiny_llama_dir)  # a symlink in an allowed dir, leading out
    leaky = copy_model(tiny_llama_dir, allowed / "leaky")
    (leaky / "model.safetensors").unlink()
    (leaky / "model.safetensors").symlink_to(tiny_llama_dir / "model.safetensors")

    def resolve(name: str):
        return resolve_model(name, allowed_dirs=[allowed])

    assert resolve(str(inside_model)).path == inside_model.resolve()
    assert resolve(str(outside / ".." / "allowed" / "tiny")).format == "hf"
    assert resolve("smollm2").format == "gguf"  # built-ins are the service's own files
    assert resolve("random:tiny-llama").format == "random"
    for bad in (tiny_llama_dir, allowed / "link", allowed / ".." / "outside", outside / "x.gguf"):
        with pytest.raises(ForbiddenPathError) as caught:
            resolve(str(bad))
        assert str(bad) in str(caught.value) and str(allowed.resolve()) in str(caught.value)
    with pytest.raises(ForbiddenPathError, match="model file .*model.safetensors"):
        resolve(str(leaky))


def test_unset_means_anywhere(tiny_llama_dir, allow, monkeypatch):
    monkeypatch.delenv("RINGQ_ALLOWED_DIRS", raising=False)
    get_settings.cache_clear()
    assert get_settings().allowed_dirs is None
    assert resolve_model(str(tiny_llama_dir), allowed_dirs=None).format == "hf"


def test_the_allowed_dirs_come_from_the_callers_settings(dirs, tiny_llama_dir, monkeypatch):
    """Settings are passed down: submit checks the model against the settings it is given,
    whatever this process's environment says."""
    allowed, _ = dirs
    monkeypatch.delenv("RINGQ_ALLOWED_DIRS", raising=False)
    get_settings.cache_clear()
    spec = JobSpec(kind=JobKind.PREFILL, document="A short document.", model=str(tiny_llama_dir))
    restricted = Settings(home=allowed, allowed_dirs=[allowed])
    with pytest.raises(ModelNotServedError, match="not served here") as refused:
        check_spec(spec, restricted)
    assert "outside RINGQ_ALLOWED_DIRS" in refused.value.reason  # the operator's detail
    with pytest.raises(ForbiddenPathError, match="outside RINGQ_ALLOWED_DIRS"):
        tokenize_and_check(spec, allowed_dirs=restricted.allowed_dirs)
    check_spec(spec, Settings(home=allowed))  # no restriction: it runs


def test_batch_document_paths_outside_the_allowed_dirs_are_refused(dirs):
    allowed, outside = dirs
    (allowed / "doc.txt").write_text("inside")
    (outside / "secret.txt").write_text("outside")
    (allowed / "link.txt").symlink_to(outside / "secret.txt")
    paths = ["doc.txt", "../outside/secret.txt", str(outside / "secret.txt"), "link.txt"]
    lines = [json.dumps({"custom_id": f"c{i}", "document_path": p}) for i, p in enumerate(paths)]
    restricted = Defaults(None, "random:tiny-llama", 8, 1000, [allowed])
    parsed = parse_batch_lines(lines, allowed, "in.jsonl", restricted)
    assert [item.spec.document for item in parsed.items] == ["inside"]
    assert [error.line_number for error in parsed.errors] == [2, 3, 4]
    assert all("outside RINGQ_ALLOWED_DIRS" in error.message for error in parsed.errors)
    unrestricted = Defaults(None, "random:tiny-llama", 8, 1000)
    assert len(parse_batch_lines(lines, allowed, "in.jsonl", unrestricted).items) == 4


def test_the_cli_refuses_with_one_line(dirs, tiny_llama_dir, allow, redis_url, redis_conn):
    allowed, outside = dirs
    (outside / "doc.txt").write_text("outside")
    (allowed / "doc.txt").write_text("inside")
    batch = allowed / "in.jsonl"
    batch.write_text(json.dumps({"custom_id": "a", "document_path": "../outside/doc.txt"}) + "\n")
    allow(allowed)
    runner = CliRunner()
    env = {"RINGQ_REDIS_URL": redis_url}
    refused = runner.invoke(cli, ["batch", "submit", str(batch), "--json"], env=env)
    assert refused.exit_code == 1 and "outside RINGQ_ALLOWED_DIRS" in refused.stderr
    args = ["submit", "prefill", str(allowed / "doc.txt"), "--model", str(tiny_llama_dir)]
    refused = runner.invoke(cli, args, env=env)
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert f"model {tiny_llama_dir} is outside RINGQ_ALLOWED_DIRS ({allowed})" in refused.stderr
    assert redis_conn.dbsize() == 0  # nothing enqueued


def wait_final(store: JobStore, job_id: str):
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (record := store.get(job_id)).state.is_final:
        assert time.monotonic() < deadline, f"job stuck in {record.state}: {record}"
        time.sleep(0.1)
    return record


def test_the_cluster_refuses_models_outside_and_stays_up(tmp_path, tiny_llama_dir):
    """The submitting process is unrestricted; the dispatcher and nodes are not: the job fails
    there with the reason, the services keep running, and an allowed model still runs."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside_model = copy_model(tiny_llama_dir, allowed / "tiny")
    env = {"RINGQ_ALLOWED_DIRS": json.dumps([str(allowed)]), "RINGQ_PREFILL_CHUNK_TOKENS": "128"}
    with private_cluster("allow", env) as cluster:
        store = JobStore(connect(cluster.url))

        def run(model: str) -> str:
            spec = JobSpec(kind=JobKind.PREFILL, document="A short document.", model=model)
            return submit_job(store.conn, spec).id

        refused = wait_final(store, run(str(tiny_llama_dir)))
        assert refused.state == JobState.FAILED and refused.placement is None
        assert f"model {tiny_llama_dir} is outside RINGQ_ALLOWED_DIRS ({allowed})" in (
            refused.error or ""
        )
        cluster.check_children()
        finished = wait_final(store, run(str(inside_model)))
        assert finished.state == JobState.FINISHED, finished.error
        cluster.check_children()
