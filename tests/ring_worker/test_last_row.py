"""As a decode batch empties, the memory tier keeps the prompt KV of a job that left last
(ring_worker/batch_serve.last_row_memory, through BatchDecoder's `on_emptied`), so the next
question on its document neither recomputes it nor reads its file: on the CPU in float32, with a
real Redis index, that question starts from it and answers as recomputing its whole prompt does
(greedy tokens identical, every decode step's logits within 1e-4)."""

import uuid

import pytest

from admission.estimate import batch_buffer_tokens
from jobs.prefix_cache import BLOCK_TOKENS
from jobs.prefix_index import PrefixIndex
from ring_worker.engine.batch_cache import BatchCache
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
from ring_worker.engine.engines import Engine
from ring_worker.runtime.batch_serve import last_row_memory
from ring_worker.runtime.cache_store import node_store
from ring_worker.runtime.prefix_reuse import InMemory, RankPrefixCache, view_of
from tests.ring_worker.test_row_prefix import (
    CHUNK_TOKENS,
    DOC,
    LOGITS_ATOL,
    OTHER,
    decode_alone,
    tokens,
)
from tests.ring_worker.tiny import load_tiny


def emptied_into(engine: Engine, prompts: dict[str, list[int]], first_row: int):
    """A decoder whose emptying keeps what last_row_memory keeps, and the list it lands in."""
    kept: list[InMemory | None] = []

    def hook(cache: BatchCache, vacated: dict[str, int]) -> None:
        kept.append(last_row_memory(cache, vacated, prompts, first_row))

    return BatchDecoder(engine, on_emptied=hook), kept


def answers_as_recomputed(engine: Engine, held: InMemory, redis_conn, tmp_path) -> None:
    view = view_of(engine, "node0", "single", "replicated")
    prefix = RankPrefixCache(
        PrefixIndex(redis_conn), node_store(tmp_path, "node0", 10**9), view,
        f"tiny:{uuid.uuid4().hex}", memory=held,
    )  # fmt: skip
    question = DOC + tokens(15, 5)
    found = prefix.find(engine, question)
    assert found is not None
    assert (found.entry_id, found.source, found.tokens) == ("doc", "memory", len(DOC))
    got_tokens, got_logits = decode_alone(engine, question[found.tokens :], found.cache)
    want_tokens, want_logits = decode_alone(engine, question)
    assert got_tokens == want_tokens
    for step, (have, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        delta = abs(have - want).max().item()
        assert delta <= LOGITS_ATOL, f"step {step}: max |dlogits| {delta}"
    assert prefix.memory is None  # taken into the question's own cache


def test_the_longest_prompt_that_left_last_stays_in_memory(tiny_model_dir, redis_conn, tmp_path):
    engine = Engine(load_tiny(tiny_model_dir))
    prompts = {"short": tokens(40, 8), "doc": DOC + tokens(12, 4), "other": OTHER + tokens(9, 3)}
    decoder, kept = emptied_into(engine, prompts, first_row=1024)
    decoder.add(DecodeRequest("short", 3), engine.prefill(prompts["short"], CHUNK_TOKENS))
    for key in ("doc", "other"):  # they leave together; "other" moved into "short"'s row
        decoder.add(DecodeRequest(key, 20), engine.prefill(prompts[key], CHUNK_TOKENS))
    decoder.run()
    [held] = kept
    assert held is not None and held.entry_id == "doc" and held.tokens == prompts["doc"]
    assert held.layers[0][0].shape[2] == len(prompts["doc"])  # a copy of its prompt's part
    assert held.bytes == sum(k.nbytes + v.nbytes for k, v in held.layers)
    answers_as_recomputed(engine, held, redis_conn, tmp_path)


def test_a_row_of_its_own_stays_as_a_view(tiny_model_dir, redis_conn, tmp_path):
    engine = Engine(load_tiny(tiny_model_dir))
    prompt = DOC + tokens(12, 4)
    first_row = batch_buffer_tokens(len(prompt) + 16, 0)
    decoder, kept = emptied_into(engine, {"doc": prompt}, first_row)
    decoder.add(DecodeRequest("doc", 16), engine.prefill(prompt, CHUNK_TOKENS))
    decoder.run()
    [held] = kept
    assert held is not None and held.tokens == prompt
    layer = decoder.cache.layers[0]  # a new, empty cache: the batch's buffers were dropped
    assert layer.keys is None
    per_layer = 2 * held.layers[0][0].shape[1] * first_row * held.layers[0][0].shape[3] * 4
    assert held.bytes == per_layer * len(held.layers)  # the whole one-slot buffer, float32
    answers_as_recomputed(engine, held, redis_conn, tmp_path)


@pytest.mark.parametrize("first_row", [len(DOC) + 11, 1])
def test_no_prompt_longer_than_the_first_row_is_kept(tiny_model_dir, first_row):
    """The group's reservation keeps the row of the job that began the batch, no more."""
    engine = Engine(load_tiny(tiny_model_dir))
    prompts = {"doc": DOC + tokens(12, 4)}
    decoder, kept = emptied_into(engine, prompts, first_row)
    decoder.add(DecodeRequest("doc", 4), engine.prefill(prompts["doc"], CHUNK_TOKENS))
    decoder.run()
    assert kept == [None]


def test_a_share_under_a_block_is_not_taken(tiny_model_dir, redis_conn, tmp_path):
    """A chat template's head in common saves nothing, and a prefill that continues a reused
    prefix takes no checkpoints (ring_worker/runtime/job_run.py `checkpointed_prefill`)."""
    engine = Engine(load_tiny(tiny_model_dir))
    prompt = DOC + tokens(12, 4)
    decoder, kept = emptied_into(engine, {"doc": prompt}, first_row=1024)
    decoder.add(DecodeRequest("doc", 2), engine.prefill(prompt, CHUNK_TOKENS))
    decoder.run()
    [held] = kept
    view = view_of(engine, "node0", "single", "replicated")
    prefix = RankPrefixCache(
        PrefixIndex(redis_conn), node_store(tmp_path, "node0", 10**9), view,
        f"tiny:{uuid.uuid4().hex}", memory=held,
    )  # fmt: skip
    assert prefix.find(engine, DOC[: BLOCK_TOKENS - 1] + tokens(200, 9)) is None
    found = prefix.find(engine, DOC[:BLOCK_TOKENS] + tokens(200, 9))
    assert found is not None and found.tokens == BLOCK_TOKENS
