"""Automatic prefix reuse answers exactly as recomputing (RINGQ_PREFIX_CACHE=off): greedy,
float32, CPU, a real Redis index and real files; a prefix that ends mid-block, a question that
diverges inside the document, the whole prompt cached, a corrupt file; and every layout reusing
every other's kept prefix (ring-2 sharded -> single, ring-3 sharded, pipeline-2, ring-2
replicated), over real multi-process groups."""

import json
import uuid
from dataclasses import replace
from typing import cast

import mlx.core as mx
import pytest

from jobs.prefix_cache import BLOCK_TOKENS
from jobs.prefix_index import PrefixIndex
from ring_worker.engine.engines import Engine
from ring_worker.engine.group import free_loopback_ports
from ring_worker.runtime.cache_store import node_store
from ring_worker.runtime.prefix_reuse import RankPrefixCache, view_of
from ring_worker.runtime.processes import rank_environment, spawn_rank, wait_all
from tests.ring_worker.prefix_rank import CHUNK_TOKENS, MAX_TOKENS
from tests.ring_worker.tiny import load_tiny, save_tiny

DOC_TOKENS = 2 * BLOCK_TOKENS + 188  # the document ends mid-block


def random_tokens(count: int, seed: int) -> list[int]:
    return cast(list[int], mx.random.randint(0, 1000, (count,), key=mx.random.key(seed)).tolist())


DOC = random_tokens(DOC_TOKENS, 1)


def question(seed: int, count: int = 20) -> list[int]:
    return random_tokens(count, 100 + seed)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama", layers=4)


def recomputed(model, tokens: list[int]) -> list[int]:
    """RINGQ_PREFIX_CACHE=off: the whole prompt computed."""
    engine = Engine(model)
    return engine.decode(engine.prefill(tokens, CHUNK_TOKENS), MAX_TOKENS).tokens


def single_cache(model_dir, redis_conn, home, engine) -> RankPrefixCache:
    view = view_of(engine, "node0", "single", "replicated")
    store = node_store(home, "node0", 10**9)
    return RankPrefixCache(PrefixIndex(redis_conn), store, view, f"tiny:{model_dir}")


def answer(cache: RankPrefixCache, engine: Engine, entry_id: str, tokens: list[int]):
    prefill, reused = cache.prefill(engine, tokens, CHUNK_TOKENS)
    decoded = engine.decode(prefill, MAX_TOKENS)
    cache.keep(engine, entry_id, tokens, prefill, reused)
    return decoded.tokens, reused.tokens if reused else 0


def forget(redis_conn, model_dir) -> None:
    index = PrefixIndex(redis_conn)
    for entry in index.listing():
        if entry.model_key == f"tiny:{model_dir}":
            index.remove(entry.id)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_single_reuse_answers_as_recomputing(model_dir, redis_conn, tmp_path, tier):
    """memory: one warm group answers in turn; disk: every question on a fresh group."""
    model = load_tiny(model_dir)
    engine = Engine(model)
    cache = single_cache(model_dir, redis_conn, tmp_path, engine)
    first, diverging = DOC + question(1), DOC[:300] + random_tokens(200, 7)
    cases = [
        (first, 0),  # nothing kept yet
        (DOC + question(2), DOC_TOKENS),  # the kept prefix ends mid-block
        (diverging, 300),  # diverges inside the document (inside block 1)
        (first, len(first) - 1),  # the whole prompt kept: its last token is recomputed
    ]
    try:
        for number, (tokens, reused) in enumerate(cases):
            if tier == "disk":
                cache.forget()
            got = answer(cache, engine, f"s{uuid.uuid4().hex[:6]}-{number}", tokens)
            assert got == (recomputed(model, tokens), reused), number
    finally:
        forget(redis_conn, model_dir)


def test_a_corrupt_kept_file_is_recomputed(model_dir, redis_conn, tmp_path, caplog):
    model = load_tiny(model_dir)
    engine = Engine(model)
    cache = single_cache(model_dir, redis_conn, tmp_path, engine)
    try:
        answer(cache, engine, f"c{uuid.uuid4().hex[:6]}", DOC + question(1))
        [kept] = cache.store.files()
        kept.path.write_bytes(kept.path.read_bytes()[:1000])  # truncated
        cache.forget()  # a fresh group: nothing in memory
        tokens = DOC + question(3)
        assert answer(cache, engine, "after", tokens) == (recomputed(model, tokens), 0)
        assert "unreadable" in caplog.text
    finally:
        forget(redis_conn, model_dir)


def test_a_file_that_would_not_pay_is_not_written(model_dir, redis_conn, tmp_path):
    """A prompt whose file would not pay for one reuse (a GPU's prefill: here one told it took
    no time at all) stays in memory only."""
    engine = Engine(load_tiny(model_dir))
    cache = single_cache(model_dir, redis_conn, tmp_path, engine)
    tokens = DOC + question(4)
    prefill = replace(engine.prefill(tokens, CHUNK_TOKENS), seconds=1e-9)
    try:
        assert cache.keep(engine, f"w{uuid.uuid4().hex[:6]}", tokens, prefill, None) is None
        assert cache.store.files() == [] and cache.memory is not None
        slow = replace(prefill, seconds=1e9)  # a CPU's: the file pays
        assert cache.keep(engine, f"w{uuid.uuid4().hex[:6]}", tokens, slow, None) is not None
        assert len(cache.store.files()) == 1
    finally:
        forget(redis_conn, model_dir)


def run_group(model_dir, out_dir, redis_url, home, label, layout, prompts):
    strategy, size, exchange, kv_layout = layout
    addresses = [f"127.0.0.1:{port}" for port in free_loopback_ports(size)]
    prompts_file = out_dir / f"{label}-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    run_dir = out_dir / label
    run_dir.mkdir()
    args = [model_dir, None, json.dumps(addresses), prompts_file, run_dir, strategy, exchange,
            kv_layout, redis_url, home, label]  # fmt: skip
    procs = [
        spawn_rank(
            [
                "-m",
                "tests.ring_worker.prefix_rank",
                *[str(rank) if a is None else str(a) for a in args],
            ],
            rank_environment(threads=1),
        )
        for rank in range(size)
    ]
    assert wait_all(procs, timeout_s=300) == [0] * size
    return [json.loads((run_dir / f"answers-rank{r}.json").read_text()) for r in range(size)][0]


@pytest.mark.slow
def test_every_layout_reuses_every_others_prefix(model_dir, redis_conn, redis_url, tmp_path):
    """ring-2 sharded keeps the document; single, ring-3 sharded, pipeline-2 and ring-2
    replicated (all-gather) each answer from it, resharded; all as recomputing."""
    model = load_tiny(model_dir)
    home = tmp_path / "home"
    first, diverging = DOC + question(1), DOC[:300] + random_tokens(200, 7)
    try:
        prompts = [first, DOC + question(2), diverging]
        ring2 = ("ring", 2, "rotate", "sharded")
        got = run_group(model_dir, tmp_path, redis_url, home, "r2s", ring2, prompts)
        want = [recomputed(model, t) for t in prompts]
        assert [a["tokens"] for a in got] == want
        assert [a["reused"] for a in got] == [0, DOC_TOKENS, 300]
        engine = Engine(model)
        tokens = DOC + question(3)
        assert answer(single_cache(model_dir, redis_conn, home, engine), engine, "one", tokens) == (
            recomputed(model, tokens),
            DOC_TOKENS,
        )
        layouts = [("ring", 3, "rotate", "sharded"), ("pipeline", 2, "rotate", "replicated"),
                   ("ring", 2, "allgather", "replicated")]  # fmt: skip
        for number, layout in enumerate(layouts):
            tokens = DOC + question(4 + number)
            [got_one] = run_group(
                model_dir, tmp_path, redis_url, home, f"l{number}", layout, [tokens]
            )
            assert got_one == {"tokens": recomputed(model, tokens), "reused": DOC_TOKENS}, layout
    finally:
        forget(redis_conn, model_dir)


def in_dtype(model_dir, dtype: mx.Dtype) -> Engine:
    model = load_tiny(model_dir)
    model.set_dtype(dtype)
    return Engine(model)


def keep_on_disk(cache: RankPrefixCache, engine: Engine, entry_id: str, tokens: list[int]):
    slow = replace(engine.prefill(tokens, CHUNK_TOKENS), seconds=1e9)  # a CPU's: the file pays
    entry = cache.keep(engine, entry_id, tokens, slow, None)
    assert entry is not None and entry.kv_dtype == cache.view.kv_dtype
    return entry


@pytest.mark.parametrize(
    ("kept", "later"), [(mx.float32, mx.bfloat16), (mx.bfloat16, mx.float32)], ids=str
)
def test_a_kept_prefix_of_another_kv_dtype_is_never_reused(
    model_dir, redis_conn, tmp_path, kept, later
):
    """One model (one model key), two compute dtypes (a CPU node's float32, a GPU's bfloat16):
    a group never loads the other dtype's kept KV; among entries of both at the same depth, it
    takes its own dtype's, even where the other's is longer and newer."""
    keeper = in_dtype(model_dir, kept)
    other = single_cache(model_dir, redis_conn, tmp_path, keeper)
    tokens = DOC + question(7)
    try:
        foreign = keep_on_disk(other, keeper, f"d{uuid.uuid4().hex[:6]}", DOC + question(5, 40))
        engine = in_dtype(model_dir, later)
        cache = single_cache(model_dir, redis_conn, tmp_path, engine)  # same node, same files
        assert PrefixIndex(redis_conn).match(cache.model_key, tokens).entries == [foreign]
        assert cache.find(engine, tokens) is None
        assert cache.prefill(engine, tokens, CHUNK_TOKENS)[1] is None  # computed in full

        own = keep_on_disk(cache, engine, f"o{uuid.uuid4().hex[:6]}", DOC + question(6))
        newer = keep_on_disk(other, keeper, f"n{uuid.uuid4().hex[:6]}", DOC + question(8, 60))
        assert {e.id for e in PrefixIndex(redis_conn).match(cache.model_key, tokens).entries} == {
            foreign.id,
            own.id,
            newer.id,
        }
        cache.forget()  # a fresh group: from the files
        found = cache.find(engine, tokens)
        assert found is not None and (found.entry_id, found.tokens) == (own.id, DOC_TOKENS)
        assert found.cache[0].keys.dtype == later
    finally:
        forget(redis_conn, model_dir)
