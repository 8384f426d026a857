"""Continuous batching must not change any sequence: at every decode step each sequence's logits
are within 1e-4 (float32, CPU) of running it alone through plain mlx-lm, and its greedy tokens
are the same, whatever joins or leaves around it (ring_worker/engine/batch_decode.py)."""

import functools
import json
from pathlib import Path
from typing import cast

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from ring_worker.engine.batch_decode import MEASURED_ROWS, BatchDecoder, DecodeRequest, warm_up
from ring_worker.engine.engines import Engine
from ring_worker.engine.group import free_loopback_ports
from ring_worker.runtime.processes import rank_environment, spawn_rank, wait_all
from tests.ring_worker.batch_rank import CHUNK_TOKENS, SCHEDULE, run_schedule
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny

LOGITS_ATOL = 1e-4


@functools.cache
def model_at(model_dir: Path):
    return load_tiny(model_dir)


@functools.cache
def alone(model_dir: Path, length: int, steps: int) -> tuple[list[int], list[mx.array]]:
    """Plain mlx-lm, one sequence: greedy tokens and the logits of each decode step."""
    model = model_at(model_dir)
    cache = make_prompt_cache(model)
    token = cast(
        int, mx.argmax(model(mx.array([prompt_tokens(length)]), cache=cache)[0, -1]).item()
    )
    tokens, logits = [], []
    for _ in range(steps):
        tokens.append(token)
        step = model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        logits.append(step)
        token = cast(int, mx.argmax(step).item())
    return tokens, logits


def check_against_alone(model_dir, seen, tokens_by_key):
    for entry in SCHEDULE:
        want_tokens, want_logits = alone(model_dir, entry.prompt_tokens, entry.max_tokens)
        got = seen[entry.key]
        assert len(got) == entry.max_tokens, entry.key  # one forward per token, as mlx-lm
        for step, (have, want) in enumerate(zip(got, want_logits, strict=True)):
            delta = mx.abs(have - want).max().item()
            assert delta <= LOGITS_ATOL, f"{entry.key} step {step}: max |dlogits| {delta}"
        assert tokens_by_key[entry.key] == want_tokens, entry.key


def test_batch_matches_each_sequence_alone(tiny_model_dir):
    seen, results = run_schedule(Engine(model_at(tiny_model_dir)))
    check_against_alone(tiny_model_dir, seen, {r.key: r.tokens for r in results})
    sizes = {r.key: r.max_batch_size for r in results}
    assert sizes["long"] == 5 and sizes["short"] == 3  # the schedule really overlapped


def test_greedy_tokens_vary(tiny_model_dir):
    """The comparison is only meaningful if the tiny model's greedy output varies."""
    tokens, _ = alone(tiny_model_dir, 1001, 40)
    assert len(set(tokens)) > 3, tokens


def request(engine, key, length, max_tokens, **kwargs):
    prefill = engine.prefill(prompt_tokens(length), CHUNK_TOKENS)
    return DecodeRequest(key, max_tokens, **kwargs), prefill


def test_cancel_removes_only_that_sequence(tiny_model_dir):
    engine = Engine(model_at(tiny_model_dir))
    decoder = BatchDecoder(engine)
    flag = {"stop": False}
    decoder.add(*request(engine, "kept", 257, 16))
    decoder.add(*request(engine, "gone", 7, 16, should_stop=lambda: flag["stop"]))
    results = []
    for _ in range(4):
        results += decoder.step()
    flag["stop"] = True
    results += decoder.run()
    by_key = {r.key: r for r in results}
    assert by_key["gone"].cancelled and 0 < len(by_key["gone"].tokens) < 16
    assert by_key["kept"].cancelled is None
    assert by_key["kept"].tokens == alone(tiny_model_dir, 257, 16)[0]


def test_stop_id_ends_a_sequence_at_once(tiny_model_dir):
    want, _ = alone(tiny_model_dir, 257, 16)
    stop = want[5]
    engine = Engine(model_at(tiny_model_dir))
    decoder = BatchDecoder(engine)
    decoder.add(*request(engine, "stops", 257, 16, stop_ids=frozenset({stop})))
    decoder.add(*request(engine, "other", 7, 16))
    by_key = {r.key: r for r in decoder.run()}
    assert by_key["stops"].tokens == want[: want.index(stop) + 1]
    assert by_key["other"].tokens == alone(tiny_model_dir, 7, 16)[0]


def test_sampling_is_per_sequence(tiny_model_dir):
    """A sampled sequence draws from its own seed: the same tokens alone or beside others."""
    engine = Engine(model_at(tiny_model_dir))

    def sampled(companions: int) -> list[int]:
        decoder = BatchDecoder(engine)
        decoder.add(*request(engine, "hot", 257, 12, temperature=1.0, seed=7))
        for index in range(companions):
            decoder.add(*request(engine, f"cold{index}", 7 + index, 12))
        return next(r.tokens for r in decoder.run() if r.key == "hot")

    assert sampled(0) == sampled(2)
    assert sampled(0) != alone(tiny_model_dir, 257, 12)[0]  # it did sample


def test_bad_requests_are_refused(tiny_model_dir):
    engine = Engine(model_at(tiny_model_dir))
    decoder = BatchDecoder(engine)
    with pytest.raises(ValueError, match="max_tokens"):
        decoder.add(*request(engine, "none", 7, 0))
    decoder.add(*request(engine, "twice", 7, 4))
    with pytest.raises(ValueError, match="already"):
        decoder.add(*request(engine, "twice", 7, 4))


@pytest.mark.parametrize("steps", ["eager", "compiled"])
def test_ring_replicated_batch_matches_alone(tiny_model_dir, tmp_path, steps):
    """A real 2-process ring group (rotate prefill, replicated KV) runs the schedule; "compiled":
    its steps of several rows through ring_worker/engine/compiled_step.py, as on CUDA."""
    addresses = json.dumps([f"127.0.0.1:{p}" for p in free_loopback_ports(2)])
    procs = [
        spawn_rank(
            [
                "-m",
                "tests.ring_worker.batch_rank",
                str(tiny_model_dir),
                str(r),
                addresses,
                str(tmp_path),
                *(["compiled"] if steps == "compiled" else []),
            ],
            rank_environment(threads=1),
        )
        for r in range(2)
    ]
    assert wait_all(procs, timeout_s=300) == [0, 0]
    for rank in range(2):
        seen = {k: list(v) for k, v in mx.load(str(tmp_path / f"logits-rank{rank}.npz")).items()}
        tokens = json.loads((tmp_path / f"tokens-rank{rank}.json").read_text())
        check_against_alone(tiny_model_dir, seen, tokens)


def test_an_emptied_batch_lets_go_of_its_buffers(tiny_model_dir):
    """When the last row leaves, the batch's KV buffers are freed (not kept at their peak size
    by an idle warm group); the next sequence starts a fresh, small buffer."""
    engine = Engine(model_at(tiny_model_dir))
    decoder = BatchDecoder(engine)
    mx.clear_cache()
    before_bytes = mx.get_active_memory()
    decoder.add(*request(engine, "long", 700, 6))
    decoder.add(*request(engine, "short", 7, 6))
    peak_bytes = decoder.cache.layers[0].nbytes * len(decoder.cache.layers)
    assert peak_bytes > 0
    decoder.run()
    assert decoder.cache.state() == []
    assert mx.get_active_memory() - before_bytes < peak_bytes / 4
    assert mx.get_cache_memory() < peak_bytes / 4  # MLX's cache of freed buffers too
    decoder.add(*request(engine, "next", 7, 4))  # a fresh buffer: one row of 256 positions
    rows, _, positions, _ = decoder.cache.layers[0].keys.shape
    assert (rows, positions) == (1, 256)
    assert [r.tokens for r in decoder.run()] == [alone(tiny_model_dir, 7, 4)[0]]


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_model_dir):
    """The GPU warm-up's short batch (ring_worker/engine/batch_decode.py `warm_up`) runs its rows to
    the end, and a sequence decoded after it is what it is alone: the warm-up shares no state
    with the batches after it. It returns the step time it measured at each of MEASURED_ROWS."""
    engine = Engine(model_at(tiny_model_dir))
    steps = warm_up(engine, max_batch=8)  # the counts up to the group's batch limit
    assert sorted(steps) == [n for n in MEASURED_ROWS if n <= 8] and all(steps.values())
    decoder = BatchDecoder(engine)
    decoder.add(*request(engine, "after", 30, 5))
    assert [r.tokens for r in decoder.run()] == [alone(tiny_model_dir, 30, 5)[0]]
