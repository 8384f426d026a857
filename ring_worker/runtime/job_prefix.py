"""The bridge from a job to prefix reuse (ring_worker/runtime/prefix_reuse.py): where its prefill
starts
(--cache-from JOB, or automatically from a kept prefix) and what it keeps afterwards. A rank
process opens one `RankPrefixCache` per group; it lives across the group's jobs (memory tier)."""

import logging

from jobs.errors import InvalidJobError
from jobs.prefix_cache import PENDING_TTL_S
from jobs.prefix_index import PendingPrefixes
from jobs.schemas import GroupSpec, JobSpec
from jobs.settings import Settings
from ring_worker.engine.engines import Engine, PrefillResult
from ring_worker.engine.memory_tier import memory_room_bytes
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.prefix_reuse import RankPrefixCache, Reuse, rank_prefix_cache

log = logging.getLogger(__name__)


def open_prefix_cache(
    settings: Settings, group: GroupSpec, rank: int, engine: Engine, io: JobIO
) -> RankPrefixCache | None:
    """None for `ringq run` (no Redis: nothing is kept or matched)."""
    conn = io.prefix_conn()
    if conn is None:
        return None
    return rank_prefix_cache(
        conn, settings.home, settings.cache_bytes, engine, group.nodes[rank],
        group.strategy, group.kv_layout, group.model,
    )  # fmt: skip


def memory_room(io: JobIO) -> int:
    """Room for the memory tier beside this job in its group's reservation
    (ring_worker/engine/memory_tier.py); 0 for a job without one (not yet placed, or `ringq run`,
    which has no memory tier: see open_prefix_cache)."""
    return memory_room_bytes(io.placement())


def starting_point(
    prefix: RankPrefixCache | None,
    engine: Engine,
    spec: JobSpec,
    tokens: list[int],
    automatic: bool,
    room_bytes: int | None = None,
) -> Reuse | None:
    """The kept prefix this job's prefill continues, if any (every rank gets the same answer);
    the memory tier is bounded by `room_bytes` before the prefill starts."""
    if prefix is not None and (spec.cache_from is not None or not automatic):
        prefix.bound_memory(room_bytes)
    if spec.cache_from is not None:
        if prefix is None:
            raise InvalidJobError("cache_from needs the service (ringq submit)")
        found = prefix.find_entry(engine, spec.cache_from, tokens)
        if found is None:
            raise InvalidJobError(
                f"cache_from: job {spec.cache_from}'s KV cache is not kept on this node "
                "(dropped or evicted: see `ringq cache list`)"
            )
        return found
    return prefix.find(engine, tokens, room_bytes) if prefix is not None and automatic else None


def keep_after(
    prefix: RankPrefixCache | None,
    engine: Engine,
    job_id: str,
    spec: JobSpec,
    tokens: list[int],
    prefill: PrefillResult,
    reused: Reuse | None,
    automatic: bool,
) -> None:
    """After the job's result is written, on every rank: keep its prompt KV (pinned for
    --keep-cache), then (rank 0) let jobs waiting for this prefill go."""
    if prefix is None:
        return
    if automatic or spec.keep_cache:
        prefix.keep(engine, job_id, tokens, prefill, reused, pinned=spec.keep_cache)
    if prefix.view.rank == 0 and automatic:
        PendingPrefixes(prefix.index.conn, PENDING_TTL_S).clear(job_id, prefix.model_key, tokens)
