"""The memory tier counts against the group's reservation (ring_worker/engine/memory_tier.py): a
warm
rank's in-memory prompt KV stays beside the next job only if it fits in the room the reservation
leaves; else it leaves memory and the prefix is read from its disk copy. A real Redis index, real
files and a tiny float32 model; answers equal recomputing."""

import uuid

import pytest

from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobSpec, Placement
from jobs.store import JobStore
from ring_worker.engine.engines import Engine
from ring_worker.engine.memory_tier import memory_room_bytes, merge_adjacent
from ring_worker.runtime.job_io import RedisJobIO
from ring_worker.runtime.job_prefix import memory_room
from ring_worker.runtime.prefix_reuse import RankPrefixCache
from tests.ring_worker.prefix_rank import CHUNK_TOKENS, MAX_TOKENS
from tests.ring_worker.test_prefix_reuse import (
    DOC,
    DOC_TOKENS,
    forget,
    question,
    random_tokens,
    recomputed,
    single_cache,
)
from tests.ring_worker.tiny import load_tiny, save_tiny

OTHER_DOC = random_tokens(DOC_TOKENS, 2)


@pytest.mark.parametrize(
    ("ranges", "merged"),
    [
        ([], []),
        ([(0, 700)], [(0, 700)]),
        ([(0, 700), (700, 760)], [(0, 760)]),  # reused prefix, then the rest: one view
        ([(0, 64), (448, 512), (512, 576)], [(0, 64), (448, 576)]),  # zigzag blocks
        ([(64, 128), (0, 64)], [(64, 128), (0, 64)]),  # cache order is kept
    ],
)
def test_merge_adjacent(ranges, merged):
    assert merge_adjacent(ranges) == merged


def placement(bytes_per_node: int, job_bytes_per_node: int | None) -> Placement:
    return Placement(
        strategy="single",
        ranks=1,
        nodes=["n0"],
        group_id="g",
        bytes_per_node=bytes_per_node,
        job_bytes_per_node=job_bytes_per_node,
    )


@pytest.mark.parametrize(
    ("reserved", "own", "room"),
    [
        (100, 60, 40),  # the group ran a larger job: room beside this one
        (100, 100, 0),  # this job is the largest yet: no room
        (100, None, 0),  # a record from before the field: no room
        (100, 130, 0),  # never negative
    ],
)
def test_memory_room_is_the_reservation_beyond_the_jobs_own_need(reserved, own, room):
    assert memory_room_bytes(placement(reserved, own)) == room
    assert memory_room_bytes(None) == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama", layers=4)


def ask(cache: RankPrefixCache, engine: Engine, tokens: list[int], room_bytes: int | None):
    """One job on a warm rank: bound the memory tier, prefill from what is kept, decode, keep."""
    reused = cache.find(engine, tokens, room_bytes)
    memory_during_job = cache.memory
    rest = tokens[reused.tokens :] if reused else tokens
    prefill = engine.prefill(rest, CHUNK_TOKENS, cache=reused.cache if reused else None)
    decoded = engine.decode(prefill, MAX_TOKENS)
    cache.keep(engine, f"m{uuid.uuid4().hex[:6]}", tokens, prefill, reused)
    return decoded.tokens, reused, memory_during_job


def kv_bytes_of_prompt(engine: Engine, tokens: int) -> int:
    args = engine.model.args
    per_token_layer = 2 * args.num_key_value_heads * args.head_dim * 4  # float32 keys + values
    return per_token_layer * args.num_hidden_layers * tokens


@pytest.mark.parametrize("fits", [False, True])
def test_a_memory_copy_is_held_beside_the_next_job_only_within_the_room(
    model_dir, redis_conn, tmp_path, fits
):
    model = load_tiny(model_dir)
    engine = Engine(model)
    cache = single_cache(model_dir, redis_conn, tmp_path, engine)
    first = DOC + question(1)
    try:
        ask(cache, engine, first, room_bytes=0)
        held = cache.memory
        assert held is not None and held.tokens == first
        # the job's cache is trimmed to its prompt (the answer's KV and spare room go)
        assert held.bytes == kv_bytes_of_prompt(engine, len(first))
        [entry] = [e for e in cache.index.listing() if e.model_key == cache.model_key]
        other = OTHER_DOC + question(2)  # another document: the copy is of no use to it
        room = held.bytes if fits else held.bytes - 1
        answer, reused, during = ask(cache, engine, other, room)
        assert answer == recomputed(model, other) and reused is None
        assert during is held if fits else during is None  # else evicted before the prefill
        # the evicted prefix is still on disk: a question on it reads the file
        again = DOC + question(3)
        cache.forget()  # the other document's copy is not the one we want to read
        answer, reused, _ = ask(cache, engine, again, 0)
        assert answer == recomputed(model, again)
        assert reused is not None and reused.tokens == DOC_TOKENS
        assert reused.entry_id == entry.id and reused.source != "memory"
    finally:
        forget(redis_conn, model_dir)


def test_a_job_that_starts_from_the_memory_copy_takes_it_over(model_dir, redis_conn, tmp_path):
    """Its KV is copied into the job's cache (which the job's own estimate counts): the tier
    lets it go even with no room, and holds the new job's prompt afterwards."""
    model = load_tiny(model_dir)
    engine = Engine(model)
    cache = single_cache(model_dir, redis_conn, tmp_path, engine)
    try:
        ask(cache, engine, DOC + question(1), room_bytes=0)
        second = DOC + question(2)
        answer, reused, during = ask(cache, engine, second, room_bytes=0)
        assert answer == recomputed(model, second)
        assert reused is not None and reused.source == "memory" and reused.tokens == DOC_TOKENS
        assert during is None
        assert cache.memory is not None and cache.memory.tokens == second
    finally:
        forget(redis_conn, model_dir)


def test_a_rank_reads_its_room_from_the_jobs_placement(redis_conn):
    """What the dispatcher recorded (jobs/dispatcher.py) is what the rank bounds its tier by."""
    store = JobStore(redis_conn)
    job_id = f"room-{uuid.uuid4().hex[:8]}"
    store.create(job_id, JobSpec(kind=JobKind.GENERATE, document="d", prompt="q", model="m"))
    io = RedisJobIO(store, job_id, "g")
    assert memory_room(io) == 0  # not placed yet
    store.transition(job_id, JobState.ADMITTED, placement=placement(100, 60))
    assert memory_room(io) == 40
