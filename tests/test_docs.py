"""The docs stay true to the code and the results stay an index of data (house style 13, 14).

README.md is short; every RINGQ_* setting the code reads is in docs/configuration.md's table and
the table names nothing else; relative links in README.md and docs/ resolve; bench/results holds
at most 60 files, no archives, no commit hashes in file names, and an INDEX.md."""

import re
from pathlib import Path

from jobs.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CODE_DIRS = ("jobs", "ring_worker", "admission", "cli")
SETTING = re.compile(r"(?<![A-Za-z0-9_])RINGQ_[A-Z0-9_]+")
TABLE_ROW = re.compile(r"^\| `(RINGQ_[A-Z0-9_]+)` \|", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HASH = re.compile(r"(?<![0-9a-f])[0-9a-f]{7,40}(?![0-9a-f])")
MAX_README_LINES = 200
MAX_RESULT_FILES = 60


def settings_in_code() -> set[str]:
    names = {f"RINGQ_{field.upper()}" for field in Settings.model_fields}
    files = [path for folder in CODE_DIRS for path in (ROOT / folder).rglob("*.py")]
    for path in [*files, ROOT / "dev"]:
        names |= set(SETTING.findall(path.read_text()))
    return names


def settings_in_docs() -> set[str]:
    return set(TABLE_ROW.findall((ROOT / "docs" / "configuration.md").read_text()))


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, at most {MAX_README_LINES}"


def test_every_setting_is_documented() -> None:
    missing = settings_in_code() - settings_in_docs()
    assert not missing, f"not in docs/configuration.md's table: {sorted(missing)}"


def test_documented_settings_exist() -> None:
    unknown = settings_in_docs() - settings_in_code()
    assert not unknown, f"docs/configuration.md names settings the code lacks: {sorted(unknown)}"


def test_relative_links_resolve() -> None:
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "INDEX.md"]:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"broken links: {broken}"


def looks_like_commit(name: str) -> bool:
    return any(
        re.search(r"[a-f]", token) and re.search(r"\d", token) for token in HASH.findall(name)
    )


def test_results_are_an_index_of_data() -> None:
    files = [path for path in RESULTS.rglob("*") if path.is_file()]
    assert len(files) <= MAX_RESULT_FILES, f"{len(files)} files under bench/results"
    assert not [path for path in files if path.name.endswith(".tgz")]
    hashed = [path.name for path in files if looks_like_commit(path.name)]
    assert not hashed, f"commit hashes in file names: {hashed}"
    assert (RESULTS / "INDEX.md").is_file()


def test_commit_pattern() -> None:
    assert looks_like_commit("batch-service-smollm2-defaults-94bf51c.json")
    assert not looks_like_commit("checkpoint-cost-smollm2-4096.json")
    assert not looks_like_commit("h200x2-llama-3.1-8b.json")
