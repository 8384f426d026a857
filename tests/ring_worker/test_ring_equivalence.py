"""Ring prefill + replicated decode over real multi-process mx.distributed groups must match
single-device mlx-lm: final-position logits within 1e-4 (float32) and 32 identical greedy tokens."""

import json
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from ring_worker.group import free_loopback_ports
from ring_worker.processes import rank_environment, spawn_rank, wait_all
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny, save_tiny

LENGTHS = [1, 7, 257, 1001]
CHUNK_TOKENS = 96  # several chunks per prompt, lengths not divisible by it
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny_model_dir(request, tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp(request.param), request.param)


def run_ring(model_dir, size, exchange, kv_layout, out_dir):
    addresses = [f"127.0.0.1:{port}" for port in free_loopback_ports(size)]
    procs = [
        spawn_rank(
            [
                "-m",
                "tests.ring_worker.equivalence_rank",
                str(model_dir),
                str(rank),
                json.dumps(addresses),
                json.dumps(LENGTHS),
                str(CHUNK_TOKENS),
                str(out_dir),
                exchange,
                kv_layout,
            ],
            rank_environment(threads=1),
        )
        for rank in range(size)
    ]
    assert wait_all(procs, timeout_s=300) == [0] * size


def reference(model, tokens):
    logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)
    greedy = [t for t, _ in generate_step(mx.array(tokens), model, max_tokens=32)]
    return logits, greedy


@pytest.mark.parametrize(
    ("size", "exchange", "kv_layout"),
    [
        (2, "rotate", "replicated"),
        (3, "rotate", "replicated"),
        (4, "rotate", "replicated"),
        (2, "allgather", "replicated"),
        (3, "allgather", "replicated"),
        (2, "rotate", "sharded"),
        (3, "rotate", "sharded"),
        (2, "allgather", "sharded"),
        (3, "allgather", "sharded"),
    ],
)
def test_ring_matches_single_device(tiny_model_dir, size, exchange, kv_layout, tmp_path):
    run_ring(tiny_model_dir, size, exchange, kv_layout, tmp_path)
    model = load_tiny(tiny_model_dir)
    for rank in range(size):
        decoded = json.loads((tmp_path / f"tokens-rank{rank}.json").read_text())
        for length in LENGTHS:
            want_logits, want_tokens = reference(model, prompt_tokens(length))
            got_logits = mx.load(str(tmp_path / f"logits-{length}-rank{rank}.npy"))
            delta = mx.abs(got_logits - want_logits).max().item()
            assert delta <= LOGITS_ATOL, f"rank {rank}, length {length}: max |dlogits| {delta}"
            assert decoded[str(length)]["tokens"] == want_tokens, f"rank {rank}, length {length}"
    check_kv_layout(tmp_path, size, kv_layout)


def check_kv_layout(out_dir, size, kv_layout):
    """Replicated: every rank holds the whole prompt. Sharded: the ranks' KV partitions it,
    about 1/N each (zigzag blocks of every chunk; chunks too short to split stay on rank 0)."""
    per_rank = [json.loads((out_dir / f"tokens-rank{r}.json").read_text()) for r in range(size)]
    for length in LENGTHS:
        held = [ranks[str(length)]["kv_tokens"] for ranks in per_rank]
        if kv_layout == "replicated":
            assert held == [length] * size
        else:
            assert sum(held) == length
            if length >= 257:
                assert max(held) <= length / size + 2 * (length // CHUNK_TOKENS + 1), held


def test_greedy_tokens_are_not_degenerate(tiny_model_dir):
    """The equivalence test is only meaningful if the tiny model's greedy output varies."""
    _, tokens = reference(load_tiny(tiny_model_dir), prompt_tokens(257))
    assert len(set(tokens)) > 3, tokens


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
