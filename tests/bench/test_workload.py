"""bench.workload: the seeded workload and its distinct prefill work as table tests, and the bench
end to end at its tiny scale (ringq's Batch API, mlx_lm.server with one setting, the engine
floor on three short documents): the JSON's shape, and both sides counting the same prompt
tokens for every request. Timings are not checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.workload_plan import (
    PREFILL_EVERY,
    SCALES,
    PeerSettings,
    Request,
    make_workload,
    prefill_ranges,
    shared_prefix,
)
from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        ([[1, 2, 3]], 0),  # one prompt: prefilled whole
        ([[1, 2, 3], [1, 2, 4]], 2),
        ([[1, 2, 3], [1, 2, 3, 4]], 2),  # the shorter keeps one token of its own
        ([[1, 2], [3, 4]], 0),
        ([[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 1]], 2),
    ],
)
def test_shared_prefix(prompts, expected):
    assert shared_prefix(prompts) == expected


def test_prefill_ranges_count_each_documents_prefix_once():
    requests = [
        Request("a", 0, "generate", "", 4),
        Request("b", 0, "generate", "", 4),
        Request("c", 1, "prefill", "", 1),
    ]
    tokens = {"a": [1, 2, 3, 4], "b": [1, 2, 3, 5, 6], "c": [7, 8]}
    assert prefill_ranges(requests, tokens) == [(0, 3), (3, 4), (3, 5), (0, 2)]


def test_peer_settings_parse_with_and_without_cache_bytes():
    assert PeerSettings.parse("32,8,10").flags()[-1] == "10"
    assert PeerSettings.parse("8, 1, 10, 8GB").flags()[-2:] == ["--prompt-cache-bytes", "8GB"]


def test_the_workload_is_seeded_and_keeps_its_ranges():
    scale = SCALES["cpu"]
    tokenizer = load_tokenizer(resolve_model(scale.model, allowed_dirs=None))
    requests = make_workload(scale, tokenizer, seed=0)
    assert requests == make_workload(scale, tokenizer, seed=0)
    assert requests != make_workload(scale, tokenizer, seed=1)
    documents = sorted({r.document for r in requests})
    assert documents == list(range(scale.documents or 0))
    for document in documents:
        mine = [r for r in requests if r.document == document]
        if document % PREFILL_EVERY == 1:
            assert [r.kind for r in mine] == ["prefill"]
            continue
        assert 1 <= len(mine) <= 4 and {r.kind for r in mine} == {"generate"}
        assert all(r.max_tokens == 32 for r in mine)
        body = mine[0].text.rsplit("\n\n", 1)[0]  # the document, before the question
        assert all(r.text.startswith(body) for r in mine)
        low, high = scale.doc_tokens
        assert 0.95 * low <= len(tokenizer.encode(body, add_special_tokens=False)) <= 1.05 * high


@pytest.mark.slow
def test_the_tiny_workload_runs_on_both_sides_with_the_same_prompt_tokens(tmp_path):
    out = tmp_path / "workload.json"
    argv = ["--scale", "tiny", "--machine", "test", "--peak-tflops", "1", "--port-base", "38900"]
    argv += ["--peer-grid", "4,2,10;4,1,10"]  # two tries: the report is written after the first
    subprocess.run(
        [sys.executable, "-m", "bench.workload", *argv, "--out", str(out)],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    report = json.loads(out.read_text())
    for key in (
        "machine",
        "commit",
        "command",
        "prompt_tokens",
        "engine_floor_s",
        "mfu",
        "ratio",
        "load_before",
        "load_after",
        "identical_texts",
    ):
        assert report[key] is not None, key
    assert report["machine"] == "test"
    assert report["ringq"]["settings"]["RINGQ_*"] == "defaults"
    peer = report["mlx_lm_server"]
    assert len(peer["tries"]) == 2 and peer["settings"] in [t["settings"] for t in peer["tries"]]
    for side in (report["ringq"], peer):
        assert side["makespan_s"] > 0
    ringq_rows, peer_rows = report["ringq"]["requests"], peer["best"]["requests"]
    assert set(ringq_rows) == set(peer_rows) == {r["custom_id"] for r in report["workload"]}
    for row in report["workload"]:
        counted = (
            ringq_rows[row["custom_id"]]["prompt_tokens"],
            peer_rows[row["custom_id"]]["prompt_tokens"],
        )
        assert counted == (row["prompt_tokens"], row["prompt_tokens"]), row["custom_id"]
    assert report["prompt_token_mismatches"] == {
        "ringq_vs_mlx_lm_server": [],
        "ringq_vs_local_tokenizer": [],
    }
    assert report["prompt_tokens"] == sum(r["prompt_tokens"] for r in report["workload"])
    assert report["mfu"]["ringq"] > 0 and report["ratio"]["ringq_over_peer"] > 0
