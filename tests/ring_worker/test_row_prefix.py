"""A question that joins its document's batch starts from a member's row
(ring_worker/batch_serve.member_row_prefix, through RankPrefixCache.find): on the CPU in
float32, with a real Redis index, it answers as recomputing its whole prompt does (greedy
tokens identical, every decode step's logits within 1e-4), reuses exactly the shared prefix of
the member whose prompt shares most."""

import uuid
from typing import cast

import mlx.core as mx
import pytest

from jobs.prefix_cache import BLOCK_TOKENS
from jobs.prefix_index import PrefixIndex
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
from ring_worker.engine.engines import Engine
from ring_worker.runtime.batch_serve import member_row_prefix
from ring_worker.runtime.cache_store import node_store
from ring_worker.runtime.prefix_reuse import RankPrefixCache, view_of
from tests.ring_worker.tiny import load_tiny

CHUNK_TOKENS = 96
LOGITS_ATOL = 1e-4
STEPS = 12


def tokens(count: int, seed: int) -> list[int]:
    return cast(list[int], mx.random.randint(0, 1000, (count,), key=mx.random.key(seed)).tolist())


DOC, OTHER = tokens(300, 1), tokens(280, 2)


def decode_alone(engine: Engine, prompt: list[int], cache=None) -> tuple[list[int], list]:
    """Greedy tokens and each step's logits of one sequence, from `cache` if given."""
    prefill = engine.prefill(prompt, CHUNK_TOKENS, cache=cache)
    seen: list[mx.array] = []

    def record(_keys, logits):
        mx.eval(logits)
        seen.append(logits[0])

    decoder = BatchDecoder(engine, on_logits=record)
    decoder.add(DecodeRequest("q", STEPS), prefill)
    [result] = decoder.run()
    return result.tokens, seen


def test_a_joiner_starts_from_the_member_that_shares_most(tiny_model_dir, redis_conn, tmp_path):
    engine = Engine(load_tiny(tiny_model_dir))
    members = [("other", OTHER + tokens(9, 3)), ("doc", DOC + tokens(12, 4))]
    decoder = BatchDecoder(engine)
    for key, prompt in members:
        decoder.add(DecodeRequest(key, 40), engine.prefill(prompt, CHUNK_TOKENS))
    for _ in range(5):  # the rows hold answers after their prompts
        decoder.step()
    question = DOC + tokens(15, 5)
    view = view_of(engine, "node0", "single", "replicated")
    cache = RankPrefixCache(
        PrefixIndex(redis_conn), node_store(tmp_path, "node0", 10**9), view,
        f"tiny:{uuid.uuid4().hex}",
        rows=lambda t, at_least: member_row_prefix(decoder.cache, members, t, at_least),
    )  # fmt: skip
    found = cache.find(engine, question)
    assert found is not None
    assert (found.entry_id, found.source, found.tokens) == ("doc", "batch row", len(DOC))
    assert found.cache[0].keys.shape[2] == len(DOC)  # the shared part only
    for _ in range(3):  # the batch goes on beside the joiner's own copy
        decoder.step()
    got_tokens, got_logits = decode_alone(engine, question[found.tokens :], found.cache)
    want_tokens, want_logits = decode_alone(engine, question)
    assert got_tokens == want_tokens
    for step, (have, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        delta = mx.abs(have - want).max().item()
        assert delta <= LOGITS_ATOL, f"step {step}: max |dlogits| {delta}"
    decoder.run()


@pytest.mark.parametrize(
    ("question", "at_least"),
    [
        (tokens(50, 6), 1),  # nothing shared
        (DOC[:1], 1),  # the whole prompt: its last token is computed
        (DOC + tokens(5, 7), len(DOC) + 1),  # shares less than what memory or a file offers
    ],
)
def test_no_row_is_copied_unless_it_would_be_taken(tiny_model_dir, question, at_least):
    engine = Engine(load_tiny(tiny_model_dir))
    decoder = BatchDecoder(engine)
    decoder.add(DecodeRequest("doc", 4), engine.prefill(DOC, CHUNK_TOKENS))
    assert member_row_prefix(decoder.cache, [("doc", DOC)], question, at_least) is None
    found = member_row_prefix(decoder.cache, [("doc", DOC)], question, 1)
    assert (found is not None) == (at_least > 1)
    decoder.run()


def sharing(count: int, seed: int) -> list[int]:
    """A question sharing exactly DOC's first `count` tokens, then going its own way."""
    return DOC[:count] + [(DOC[count] + 1) % 1000] + tokens(20, seed)


@pytest.mark.parametrize(
    ("shared", "at_least", "reused"),
    [
        (40, 40, True),  # exactly the minimum
        (39, 40, False),  # one token less
        (41, 40, True),
        (1, 1, True),
        (0, 1, False),
    ],
)
def test_a_row_sharing_exactly_the_minimum_is_taken(tiny_model_dir, shared, at_least, reused):
    engine = Engine(load_tiny(tiny_model_dir))
    decoder = BatchDecoder(engine)
    decoder.add(DecodeRequest("doc", 4), engine.prefill(DOC, CHUNK_TOKENS))
    found = member_row_prefix(decoder.cache, [("doc", DOC)], sharing(shared, 9), at_least)
    assert (len(found.tokens) if found else None) == (shared if reused else None)
    decoder.run()


@pytest.mark.parametrize(("shared", "reused"), [(BLOCK_TOKENS, True), (BLOCK_TOKENS - 1, False)])
def test_a_joiner_reuses_a_row_from_one_block_on(
    tiny_model_dir, redis_conn, tmp_path, shared, reused
):
    """RankPrefixCache.find's minimum with nothing kept: a block (BLOCK_TOKENS). A member row
    sharing exactly that is taken; one token less, and the joiner computes its whole prompt."""
    engine = Engine(load_tiny(tiny_model_dir))
    decoder = BatchDecoder(engine)
    decoder.add(DecodeRequest("doc", 4), engine.prefill(DOC, CHUNK_TOKENS))
    view = view_of(engine, "node0", "single", "replicated")
    cache = RankPrefixCache(
        PrefixIndex(redis_conn), node_store(tmp_path, "node0", 10**9), view,
        f"tiny:{uuid.uuid4().hex}",
        rows=lambda t, at_least: member_row_prefix(decoder.cache, [("doc", DOC)], t, at_least),
    )  # fmt: skip
    found = cache.find(engine, sharing(shared, 10))
    if reused:
        assert found is not None
        assert (found.entry_id, found.source, found.tokens) == ("doc", "batch row", shared)
    else:
        assert found is None
    decoder.run()
