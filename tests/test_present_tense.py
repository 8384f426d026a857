"""The present-tense check (.ci/present_tense.py) finds lab notes in comments and docstrings,
and leaves present-tense text and code alone."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("present_tense", ROOT / ".ci" / "present_tense.py")
assert spec is not None and spec.loader is not None
present_tense = importlib.util.module_from_spec(spec)
spec.loader.exec_module(present_tense)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('"""Measured on the H100 of 2026-12-05."""\n', "a date"),
        ("x = 1  # found in the nineteenth session\n", "a session count"),
        ('def f():\n    """As in 82121f1, steps ran 8 ms."""\n', "a commit hash"),
        ("# see issue 14\n", "an issue number"),
        ('class A:\n    """bench/results/batch-decode.md"""\n', "a result file"),
        ('"""A 16K chunk keeps a layer under 1 GiB (bench.probes.step_cost)."""\n', None),
        ("# its own session, so a Ctrl-C meant for the CLI does not reach it\n", None),
        ('KEY = "deadbeef1234"  # a code string is not a note\n', None),
    ],
)
def test_lab_notes_are_found_in_comments_and_docstrings(tmp_path, source, found):
    path = tmp_path / "module.py"
    path.write_text(source)
    hits = present_tense.hits(path)
    assert [found in hit for hit in hits] == ([True] if found else [])


def test_the_product_packages_speak_in_the_present_tense():
    assert present_tense.main([str(ROOT / p) for p in present_tense.PACKAGES]) == 0
