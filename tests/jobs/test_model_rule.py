"""The one model rule (jobs/model_rule.py) as a table over the operator's entry points (the
Python client, `ringq submit`, batch lines, the batch-wide --model); the HTTP entry points are
in tests/cli/test_http_security.py. A real Redis; models on disk."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.batch_input import Defaults, parse_batch_lines
from jobs.client import Client
from jobs.errors import ModelNotServedError, UnknownModelError
from jobs.model_catalog import PACKAGED_MODELS
from jobs.model_rule import BUILT_IN_MODELS, served_model
from jobs.settings import Settings

MODEL = "random:tiny-llama"


@pytest.fixture
def dirs(tmp_path, tiny_llama_dir):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "model").symlink_to(tiny_llama_dir)  # inside: its target is what resolves
    (allowed / "leak").symlink_to("/etc")
    return allowed


def cases(allowed: Path, tiny: Path) -> list[tuple[str, bool]]:
    """(model, runs) where RINGQ_ALLOWED_DIRS is [allowed] (the link makes tiny count inside)."""
    return [
        ("smollm2", True),
        (MODEL, True),
        ("gpt-4o-mini", True),  # an alias
        (str(allowed / "model"), False),  # a link out of the allowed dir
        (str(tiny), False),
        ("/etc/passwd", False),
        ("/proc/self/cwd", False),
        (str(allowed / "leak" / "passwd"), False),
        (str(allowed / ".." / "x.gguf"), False),
        (str(allowed / "missing.gguf"), False),
    ]


def test_the_built_in_names_are_the_packaged_ones():
    assert set(BUILT_IN_MODELS) == set(PACKAGED_MODELS)


def test_aliases_map_and_unset_dirs_mean_anywhere_for_the_operator(tiny_llama_dir):
    settings = Settings(model_aliases={"gpt-4o-mini": MODEL})
    assert served_model("gpt-4o-mini", settings) == MODEL
    assert served_model(str(tiny_llama_dir), settings) == str(tiny_llama_dir)
    with pytest.raises(ModelNotServedError):
        served_model(str(tiny_llama_dir), Settings(allowed_dirs=[]))


def test_every_operator_entry_point_keeps_the_rule(dirs, tiny_llama_dir, redis_url, redis_conn):
    settings = Settings(
        redis_url=redis_url, allowed_dirs=[dirs], model_aliases={"gpt-4o-mini": MODEL}
    )
    client = Client(conn=redis_conn, settings=settings)
    for model, runs in cases(dirs, tiny_llama_dir):
        outcomes = {}
        for entry in ("client", "batch line", "batch --model"):
            try:
                if entry == "client":
                    record = client.submit(document="A short document.", model=model)
                    assert record.spec.model == served_model(model, settings)
                else:
                    line = {"custom_id": "a", "document": "A document.", "model": model}
                    defaults = Defaults(model if entry == "batch --model" else None, MODEL, 4, 1000)
                    parsed = parse_batch_lines([json.dumps(line)], dirs, "in", defaults, settings)
                    assert not parsed.errors, parsed.errors
                    assert parsed.items[0].spec.model == served_model(model, settings)
                outcomes[entry] = True
            except (AssertionError, UnknownModelError) as exc:
                if runs:
                    raise
                assert "resolves" not in str(exc)
                outcomes[entry] = False
        assert outcomes == dict.fromkeys(outcomes, runs), (model, outcomes)


def test_ringq_submit_keeps_the_rule_and_tells_the_operator_why(
    dirs, tiny_llama_dir, redis_url, tmp_path
):
    document = tmp_path / "doc.txt"
    document.write_text("A short document.")
    env = {
        **os.environ,
        "RINGQ_REDIS_URL": redis_url,
        "RINGQ_ALLOWED_DIRS": f"{dirs}:{tmp_path / 'other'}",  # the path-list form
        "RINGQ_HOME": str(tmp_path / "home"),
    }
    args = [sys.executable, "-m", "cli.main", "submit", "prefill", str(document)]
    for model, runs in cases(dirs, tiny_llama_dir):
        if model == "gpt-4o-mini":
            continue  # no alias in this environment
        done = subprocess.run(
            [*args, "--model", model], env=env, capture_output=True, text=True, timeout=120
        )
        assert (done.returncode == 0) == runs, (model, done.stderr)
        if not runs:
            assert "not served here" in done.stderr and "Traceback" not in done.stderr
