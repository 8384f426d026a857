"""In a group that decodes in batches, a job's prompt KV moves into a batch row; the memory
tier's copy of the same KV stays beside it only within the room its reservation leaves
(ring_worker/runtime/batch_serve.py `keep_beside_batch`, ring_worker/engine/memory_tier.py). Its
disk copy is
kept either way. A real Redis, real files and a tiny float32 model."""

import time
import uuid

import pytest

from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobSpec, Placement
from jobs.store import JobStore
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
from ring_worker.engine.engines import Engine
from ring_worker.runtime.batch_serve import keep_beside_batch, without_kv
from ring_worker.runtime.job_io import RedisJobIO
from ring_worker.runtime.job_run import Prefilled
from ring_worker.runtime.prefix_reuse import Reuse
from tests.ring_worker.prefix_rank import CHUNK_TOKENS, MAX_TOKENS
from tests.ring_worker.test_prefix_reuse import DOC, forget, question, single_cache
from tests.ring_worker.tiny import load_tiny, save_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama", layers=2)


def placed_job(store: JobStore, reserved_bytes: int, own_bytes: int) -> RedisJobIO:
    job_id = f"bm-{uuid.uuid4().hex[:8]}"
    store.create(job_id, JobSpec(kind=JobKind.GENERATE, document="d", prompt="q", model="m"))
    placement = Placement(
        strategy="single", ranks=1, nodes=["node0"], group_id="g",
        bytes_per_node=reserved_bytes, job_bytes_per_node=own_bytes,
    )  # fmt: skip
    store.transition(job_id, JobState.ADMITTED, placement=placement)
    return RedisJobIO(store, job_id, "g")


@pytest.mark.parametrize("room", ["none", "enough"])
def test_the_memory_copy_beside_a_batch_row_stays_only_within_the_room(
    model_dir, redis_conn, tmp_path, room
):
    engine = Engine(load_tiny(model_dir))
    prefix = single_cache(model_dir, redis_conn, tmp_path, engine)
    tokens = DOC + question(1)
    spec = JobSpec(kind=JobKind.GENERATE, document="d", prompt="q", model="m")
    prefill = engine.prefill(tokens, CHUNK_TOKENS)
    job = Prefilled(spec, tokens, prefill, None, time.time(), lambda *_: None, True)
    held_bytes = sum(c.keys.nbytes + c.values.nbytes for c in prefill.cache)
    own = 10**9
    io = placed_job(JobStore(redis_conn), own + (held_bytes if room == "enough" else 0), own)
    decoder = BatchDecoder(engine)
    try:
        keep_beside_batch(engine, prefix, io, job)
        decoder.add(DecodeRequest("bm", MAX_TOKENS), prefill, move=True)  # the KV moves
        if room == "none":  # a fresh group, or a job that joined a busy batch
            assert prefix.memory is None
        else:  # a warm group that held more for an earlier, larger job
            assert prefix.memory is not None and prefix.memory.bytes <= held_bytes
        [entry] = [e for e in prefix.index.listing() if e.model_key == prefix.model_key]
        assert entry.id == io.job_id and entry.tokens == len(tokens)  # on disk either way
        decoder.run()
    finally:
        forget(redis_conn, model_dir)


def test_a_member_keeps_no_kv_of_the_prefix_it_started_from(model_dir):
    """The prefill extends the kept prefix's caches (`start.cache` is `prefill.cache`): a
    member that kept either held its whole prompt's KV beside its batch row."""
    engine = Engine(load_tiny(model_dir))
    first = engine.prefill(list(range(40)), CHUNK_TOKENS)
    start = Reuse("e", "memory", 40, first.cache, [(0, 40)])
    prefill = engine.prefill(list(range(40, 48)), CHUNK_TOKENS, cache=start.cache)
    assert prefill.cache[0] is start.cache[0]  # the same KVCache objects, extended
    spec = JobSpec(kind=JobKind.GENERATE, document="d", prompt="q", model="m")
    job = Prefilled(spec, list(range(48)), prefill, start, 0.0, lambda *a: None, True)
    kept = without_kv(job)
    assert kept.prefill.cache == [] and kept.start is not None and kept.start.cache == []
    assert (kept.start.entry_id, kept.start.tokens) == ("e", 40)  # what its result shows
    assert kept.prefill.prompt_tokens == prefill.prompt_tokens
