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


# (key, prompt tokens, max_tokens, temperature, seed): greedy and sampled rows, two sampled ones
# on one seed, leaving at different steps so the rows after them move into their slots.
MIXED = (
    ("greedy-a", 257, 14, 0.0, 0),
    ("hot-a", 40, 10, 1.0, 7),
    ("greedy-b", 7, 6, 0.0, 0),
    ("hot-b", 120, 16, 0.8, 11),
    ("hot-c", 3, 8, 1.5, 7),
)


def decoded_alone(engine, key, length, max_tokens, temperature, seed) -> list[int]:
    """The sequence in a batch of its own (for a sampled one, the reference the batch must keep)."""
    decoder = BatchDecoder(engine)
    decoder.add(*request(engine, key, length, max_tokens, temperature=temperature, seed=seed))
    (result,) = decoder.run()
    return result.tokens


@pytest.mark.parametrize(
    "order", [(0, 1, 2, 3, 4), (4, 3, 2, 1, 0), (1, 3, 4, 0, 2), (2, 0, 4, 1, 3)], ids=str
)
def test_mixed_greedy_and_sampled_rows_each_decode_as_alone(tiny_model_dir, order):
    """Every row of a batch mixing greedy and sampled rows gets the tokens it gets alone (same
    seed), whatever row it holds; the last of `order` joins two steps after the others."""
    engine = Engine(model_at(tiny_model_dir))
    want = {row[0]: decoded_alone(engine, *row) for row in MIXED}
    for key, length, max_tokens, temperature, _ in MIXED:
        greedy = alone(tiny_model_dir, length, max_tokens)[0]
        assert (want[key] == greedy) == (temperature == 0), key  # sampled rows do sample
    assert want["hot-a"][:8] != want["hot-c"], "one seed, two rows: still their own draws"

    decoder = BatchDecoder(engine)
    *first, late = [MIXED[index] for index in order]
    for key, length, max_tokens, temperature, seed in first:
        decoder.add(*request(engine, key, length, max_tokens, temperature=temperature, seed=seed))
    results = decoder.step() + decoder.step()
    key, length, max_tokens, temperature, seed = late
    decoder.add(*request(engine, key, length, max_tokens, temperature=temperature, seed=seed))
    results += decoder.run()
    assert {r.key: r.tokens for r in results} == want
    assert max(r.max_batch_size for r in results) == len(MIXED)


@pytest.mark.parametrize("leavers_first", [True, False], ids=["leavers-first", "leavers-last"])
def test_rows_leaving_early_keep_the_others_limits(tiny_model_dir, leavers_first):
    """Rows that leave early (a short max_tokens, a stop token, a stop string) take nothing from
    the rows that stay: each of those still decodes exactly its own max_tokens, as alone, and
    each leaver stops exactly where its own limit says."""
    engine = Engine(model_at(tiny_model_dir))
    stop_want = alone(tiny_model_dir, 60, 30)[0]
    stop_id = stop_want[4]
    leavers = [
        ("brief", 7, 2, {}),
        ("stop-token", 60, 30, {"stop_ids": frozenset({stop_id})}),
        ("stop-string", 90, 30, {"stop_when": lambda tokens: len(tokens) >= 5}),
    ]
    # "answer" runs past the buffer's first 512 columns, long after the others left and the
    # buffers shrank around it.
    stayers = [("long", 300, 40, {}), ("mid", 130, 9, {}), ("answer", 20, 260, {})]
    decoder = BatchDecoder(engine)
    for key, length, max_tokens, kwargs in (
        leavers + stayers if leavers_first else stayers + leavers
    ):
        decoder.add(*request(engine, key, length, max_tokens, **kwargs))
    got = {r.key: r.tokens for r in decoder.run()}
    for key, length, max_tokens, _ in stayers:
        assert got[key] == alone(tiny_model_dir, length, max_tokens)[0], key
        assert len(got[key]) == max_tokens, key
    assert got["brief"] == alone(tiny_model_dir, 7, 2)[0]
    assert got["stop-token"] == stop_want[: stop_want.index(stop_id) + 1]
    assert got["stop-string"] == alone(tiny_model_dir, 90, 5)[0]
