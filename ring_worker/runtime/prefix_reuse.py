"""A rank's side of automatic prefix reuse (design: jobs/prefix_cache.py): find a kept prefix of
the prompt and rebuild this rank's part of it; after the job, keep this rank's prompt KV on disk
and (rank 0) index the entry. The ranks of a group agree on what they reuse (two collectives):
any disagreement or failed load means every rank recomputes."""

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import redis

from jobs import keys
from jobs.prefix_cache import (
    BLOCK_TOKENS,
    CacheEntry,
    CacheShard,
    Layout,
    choose_entry,
    exact_reuse_tokens,
    worth_a_file,
    worth_keeping,
)
from jobs.prefix_index import PrefixIndex, model_key
from ring_worker.engine.engines import Engine, PrefillResult
from ring_worker.engine.kv_reshard import (
    ShardKV,
    build_cache,
    cache_arrays,
    clip_ranges,
    even_split,
    trim_to_prefix,
)
from ring_worker.engine.memory_tier import merge_adjacent, pinned_bytes, room_text
from ring_worker.runtime.cache_store import CacheStore, node_store, read_cache_file

log = logging.getLogger(__name__)
Ranges = list[tuple[int, int]]


@dataclass(frozen=True)
class RankView:
    """Where one rank sits: what part of a kept prefix it needs."""

    node: str
    rank: int
    size: int
    layout: Layout
    kv_layout: str  # "replicated" | "sharded" (ring); "replicated" otherwise
    layers: range  # this rank's layers: all, or a pipeline stage's
    kv_dtype: str

    @property
    def sharded(self) -> bool:
        return self.layout == "ring" and self.kv_layout == "sharded"

    @property
    def writers(self) -> list[int]:
        """The ranks whose KV files make an entry: each stage or shard; replicated, rank 0."""
        return list(range(self.size)) if self.layout == "pipeline" or self.sharded else [0]


@dataclass(frozen=True)
class Reuse:
    entry_id: str  # the job whose prompt KV it is
    source: str  # where it came from, for the job's result: "memory" or the entry's layout
    tokens: int  # prompt tokens taken from it
    cache: list[Any]  # this rank's rebuilt KV caches
    ranges: Ranges  # the positions they hold, in cache order


@dataclass(frozen=True)
class InMemory:
    """The previous job's prompt KV, still in this rank's memory (a warm group's next job on the
    same document starts from it without reading a file)."""

    entry_id: str
    tokens: list[int]
    layers: list[tuple[Any, Any]]  # (keys, values) per layer of this rank, in cache order
    ranges: Ranges
    bytes: int = 0  # what it keeps alive (ring_worker/engine/memory_tier.py)
    source: str = "memory"  # or "batch row": a decoding member's row (RankPrefixCache.rows)

    def reuse(self, view: RankView, tokens: list[int], at_least: int = 1) -> Reuse | None:
        """This rank's cache of the prefix `tokens` share with it, if at least `at_least`."""
        reuse = exact_reuse_tokens(self.tokens, tokens)
        if reuse < max(at_least, 1):
            return None
        want = clip_ranges(self.ranges, reuse) if view.sharded else [(0, reuse)]
        shard = ShardKV(view.layers.start, tuple(self.ranges), self.layers)
        cache = build_cache([shard], view.layers, want)
        return None if cache is None else Reuse(self.entry_id, self.source, reuse, cache, want)


# a batch's best row for a joiner's tokens, if it shares at least so many
RowPrefix = Callable[[list[int], int], InMemory | None]


def view_of(engine: Engine, node: str, layout: Layout, kv_layout: str) -> RankView:
    model = engine.model
    layers = getattr(engine, "layers", range(model.args.num_hidden_layers))
    dtype = model.model.layers[0].input_layernorm.weight.dtype
    return RankView(node, engine.rank, engine.size, layout, kv_layout, layers, str(dtype))


def wanted_positions(view: RankView, entry: CacheEntry, reuse: int) -> Ranges:
    """Sharded ring: the same shard when the entry was made by a sharded ring of this size,
    else an even contiguous share; every other layout: the whole prefix."""
    if not view.sharded:
        return [(0, reuse)]
    if entry.layout == "ring" and entry.kv_layout == "sharded" and entry.ranks == view.size:
        mine = [s for s in entry.shards if s.rank == view.rank]
        if mine:
            return clip_ranges(mine[0].ranges, reuse)
    return even_split(reuse, view.rank, view.size)


def find_reuse(
    index: PrefixIndex, model_key: str, tokens: list[int], view: RankView
) -> Reuse | None:
    """This rank's part of the longest kept prefix of `tokens`, or None (recompute)."""
    match = index.match(model_key, tokens)
    usable = [e for e in match.entries if e.kv_dtype == view.kv_dtype]
    entry = choose_entry(usable, [view.node])
    return None if entry is None else reuse_entry(index, entry, tokens, view)


def reuse_entry(
    index: PrefixIndex, entry: CacheEntry, tokens: list[int], view: RankView
) -> Reuse | None:
    """This rank's part of `entry` as far as `tokens` share it; None (the entry forgotten if
    its files are gone or broken) to recompute."""
    kept = index.tokens(entry.id) or []
    reuse = exact_reuse_tokens(kept[: entry.tokens], tokens)
    if reuse <= 0:
        return None
    want = wanted_positions(view, entry, reuse)
    shards = load_shards(entry, view.layers, want)
    cache = build_cache(shards, view.layers, want) if shards is not None else None
    if cache is None:
        log.warning("prefix cache %s (%s): files missing or unreadable here, forgotten; the job "
                    "recomputes", entry.id, entry.describe())  # fmt: skip
        index.remove(entry.id)
        return None
    index.touch(entry.id)
    return Reuse(entry.id, entry.describe(), reuse, cache, want)


def load_shards(entry: CacheEntry, layers: range, want: Ranges) -> list[ShardKV] | None:
    """The entry's shard files this rank needs, read here; None if one is unreadable."""
    shards = []
    for shard in entry.shards:
        if shard.layer_stop <= layers.start or shard.layer_start >= layers.stop:
            continue
        if not any(a < e and s < b for a, b in want for s, e in shard.ranges):
            continue
        found = read_cache_file(Path(shard.file))
        if found is None:
            return None
        cache, _ = found
        layer_kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]
        shards.append(ShardKV(shard.layer_start, tuple((a, b) for a, b in shard.ranges), layer_kv))
    return shards


def agree_on_reuse(engine: Engine, found: Reuse | None) -> Reuse | None:
    """Every rank reuses the same entry for the same tokens, or none does."""
    tokens = found.tokens if found is not None else -1
    tag = _tag(found.entry_id) if found is not None else -1
    if len(set(engine.gather_ints(tokens))) == 1 and len(set(engine.gather_ints(tag))) == 1:
        return found if tokens > 0 else None
    return None


def cache_positions(reused: Reuse | None, prefill: PrefillResult) -> Ranges:
    """The positions this rank's cache holds after prefill, in cache order."""
    return (list(reused.ranges) if reused is not None else []) + list(prefill.ranges)


def prompt_only(cache: Sequence[Any], positions: Ranges, prompt_tokens: int) -> Ranges:
    """The cache's positions cut to the prompt's, where they are one run from the cache's first
    entry: the live cache is trimmed to them (the answer's KV, and its buffers' spare room, go;
    the job is done with them), so what is remembered and written is whole buffers, never views
    that the file write would copy (kv_reshard.trim_to_prefix). Else `positions` unchanged."""
    merged = merge_adjacent(positions)
    keep = clip_ranges(merged, prompt_tokens)
    if len(merged) == 1 and keep and trim_to_prefix(cache, keep[0][1] - keep[0][0]):
        return keep
    return positions


def keep_shard(
    store: CacheStore,
    view: RankView,
    entry_id: str,
    cache: Sequence[Any],
    positions: Ranges,
    prompt_tokens: int,
    pinned: bool = False,
) -> tuple[CacheShard | None, list[str]]:
    """Write this rank's KV of the prompt's positions; the shard record (None if not kept) and
    the entries whose files the store evicted to make room."""
    keep = clip_ranges(positions, prompt_tokens)
    layers = cache_arrays(cache, positions, keep) if keep else []
    metadata = {"entry": entry_id, "rank": str(view.rank), "ranges": json.dumps(keep),
                "layer_start": str(view.layers.start)}  # fmt: skip
    saved = store.save(f"{entry_id}.r{view.rank}", layers, metadata, pinned) if layers else None
    evicted = sorted({f.name.rsplit(".r", 1)[0] for f in saved.evicted}) if saved else []
    if saved is None or saved.path is None:
        return None, evicted
    shard = CacheShard(
        node=view.node, rank=view.rank, file=str(saved.path), layer_start=view.layers.start,
        layer_stop=view.layers.stop, ranges=keep, bytes=saved.path.stat().st_size,
    )  # fmt: skip
    return shard, evicted


def publish_shard(conn: redis.Redis, entry_id: str, shard: CacheShard | None, rank: int) -> None:
    conn.hset(
        keys.prefix_entry_shards(entry_id), str(rank), shard.model_dump_json() if shard else ""
    )


def register_entry(
    index: PrefixIndex,
    entry_id: str,
    model_key: str,
    view: RankView,
    tokens: list[int],
    pinned: bool = False,
) -> CacheEntry | None:
    """Rank 0, after every rank published its shard: index the entry if every shard was kept."""
    conn = index.conn
    raw = conn.hgetall(keys.prefix_entry_shards(entry_id))
    conn.delete(keys.prefix_entry_shards(entry_id))
    texts = {int(k): v.decode() if isinstance(v, bytes) else v for k, v in raw.items()}
    if not all(texts.get(rank) for rank in view.writers):
        log.info("job %s: prefix not kept (a rank kept no shard)", entry_id)
        return None
    shards = [CacheShard.model_validate_json(texts[rank]) for rank in view.writers]
    now = time.time()
    entry = CacheEntry(
        id=entry_id, model_key=model_key, tokens=len(tokens), layout=view.layout,
        ranks=view.size, kv_layout="sharded" if view.sharded else "replicated",
        kv_dtype=view.kv_dtype, shards=shards, pinned=pinned, created_at=now, last_used_at=now,
        blocks=len(tokens) // BLOCK_TOKENS,
    )  # fmt: skip
    index.add(entry, tokens)
    return entry


def should_keep(prompt_tokens: int, reused: Reuse | None, pinned: bool) -> bool:
    return pinned or worth_keeping(prompt_tokens, reused.tokens if reused else 0)


def file_pays_off(prefill: PrefillResult, prompt_tokens: int, held_tokens: int) -> bool:
    """This rank's file (its `held_tokens` positions of the prompt) against recomputing the
    whole prompt at this prefill's rate."""
    if prefill.prompt_tokens <= 0:
        return True
    recompute_s = prefill.seconds * prompt_tokens / prefill.prompt_tokens
    file_bytes = held_tokens * sum(cache_bytes_per_token(c) for c in prefill.cache)
    return worth_a_file(recompute_s, file_bytes)


def cache_bytes_per_token(cache: Any) -> int:
    """K and V bytes per position of one layer's KVCache on this rank (none for a layer it does
    not hold: a pipeline stage's)."""
    keys = getattr(cache, "keys", None)
    if keys is None or keys.shape[2] == 0:
        return 0
    return 2 * keys.nbytes // (keys.shape[0] * keys.shape[2])


@dataclass
class RankPrefixCache:
    """One rank's handle on prefix reuse: the index, its node's store, where it sits, and the
    previous job's prompt KV in memory."""

    index: PrefixIndex
    store: CacheStore
    view: RankView
    model_key: str
    memory: InMemory | None = None
    rows: RowPrefix | None = None  # a batching group's: its decoding members' prompts

    def find(
        self, engine: Engine, tokens: list[int], room_bytes: int | None = None
    ) -> Reuse | None:
        """This rank's part of the kept prefix every rank of the group can use, if any: the
        longer of the one in memory and a batch member's row, when it covers at least what the
        index offers and a block (a prefill continuing a reused prefix takes no checkpoints). The
        memory tier is then bounded by `room_bytes` (ring_worker/engine/memory_tier.py)."""
        # a chat template's head (under a block) saves nothing, and costs the checkpoints
        at_least = max(self.index.match(self.model_key, tokens).tokens, BLOCK_TOKENS)
        memory = self.memory
        in_memory = memory.reuse(self.view, tokens, at_least) if memory is not None else None
        # a row is copied only where it would be taken: a copy beside the memory's, both a
        # 128K document's KV, could run a GPU out of memory
        longer = in_memory.tokens + 1 if in_memory is not None else at_least
        row = self.rows(tokens, longer) if self.rows is not None else None
        in_row = row.reuse(self.view, tokens) if row is not None else None
        nearby = in_row if in_row is not None else in_memory
        if nearby is not None:
            found = agree_on_reuse(engine, nearby)
            extends_memory = found is not None and found is in_memory
            self.bound_memory(0 if extends_memory else room_bytes)  # now the job's own KV
            return found
        self.bound_memory(room_bytes)
        return agree_on_reuse(engine, find_reuse(self.index, self.model_key, tokens, self.view))

    def bound_memory(self, room_bytes: int | None) -> None:
        """Drop the memory copy if it is larger than `room_bytes` (None: unbounded); a kept
        prefix's files stay on disk."""
        memory = self.memory
        if memory is None or room_bytes is None or memory.bytes <= room_bytes:
            return
        self.memory = None
        log.info("rank %d: job %s's prompt KV (%d bytes) left memory: %s", self.view.rank,
                 memory.entry_id, memory.bytes, room_text(room_bytes))  # fmt: skip

    def find_entry(self, engine: Engine, entry_id: str, tokens: list[int]) -> Reuse | None:
        """The named entry (`--cache-from JOB`), if every rank can use it."""
        entry = self.index.get(entry_id)
        found = reuse_entry(self.index, entry, tokens, self.view) if entry is not None else None
        return agree_on_reuse(engine, found)

    def prefill(
        self, engine: Engine, tokens: list[int], chunk_tokens: int, **options: Any
    ) -> tuple[PrefillResult, Reuse | None]:
        """Prefill `tokens`, starting from a kept prefix when every rank can load one."""
        reused = self.find(engine, tokens)
        rest = tokens[reused.tokens :] if reused is not None else tokens
        cache = reused.cache if reused is not None else None
        return engine.prefill(rest, chunk_tokens, cache=cache, **options), reused

    def remember(
        self, entry_id: str, tokens: list[int], cache: Sequence[Any], positions: Ranges
    ) -> None:
        """Hold the prompt's KV for the next job (views of the live cache's buffers where its
        positions are contiguous: single, replicated, pipeline)."""
        positions = merge_adjacent(positions)
        keep = clip_ranges(positions, len(tokens))
        self.memory = None
        if keep:
            layers = cache_arrays(cache, positions, keep)
            mx.eval(layers)
            held = pinned_bytes(cache, layers, view=len(keep) == 1)
            self.memory = InMemory(entry_id, list(tokens), layers, keep, held)

    def forget(self) -> None:
        self.memory = None

    def hold(self, held: InMemory) -> None:
        """Hold a prompt's KV taken elsewhere (a batch's last row) for the next job."""
        self.memory = held
        log.info("rank %d: job %s's prompt KV (%d tokens, %d bytes) stays in memory from its "
                 "batch row", self.view.rank, held.entry_id, len(held.tokens),
                 held.bytes)  # fmt: skip

    def keep(
        self,
        engine: Engine,
        entry_id: str,
        tokens: list[int],
        prefill: PrefillResult,
        reused: Reuse | None,
        pinned: bool = False,
    ) -> CacheEntry | None:
        """After the job, on every rank: remember the prompt's KV in memory, and keep it on disk
        if it is worth it (see jobs/prefix_cache.py); rank 0 returns the indexed entry."""
        view = self.view
        positions = prompt_only(prefill.cache, cache_positions(reused, prefill), len(tokens))
        self.remember(entry_id, tokens, prefill.cache, positions)
        if not should_keep(len(tokens), reused, pinned):
            return None
        held = sum(stop - start for start, stop in clip_ranges(positions, len(tokens)))
        pays = file_pays_off(prefill, len(tokens), held)
        if not (pinned or all(engine.gather_ints(int(pays)))):
            return None  # decided together: each rank's own timing differs a little
        # Failures are logged, never raised, between the two collectives: every rank must
        # reach both, and the job's answer already stands.
        if view.rank in view.writers:
            try:
                self._write(entry_id, tokens, prefill, positions, pinned)
            except (OSError, ValueError, redis.RedisError) as exc:
                log.warning("job %s rank %d: prefix not kept: %s", entry_id, view.rank, exc)
        engine.gather_ints(0)  # every shard is published before rank 0 reads them
        entry = None
        if view.rank == 0:
            try:
                entry = register_entry(self.index, entry_id, self.model_key, view, tokens, pinned)
            except (ValueError, redis.RedisError) as exc:
                log.warning("job %s rank 0: prefix not indexed: %s", entry_id, exc)
        engine.gather_ints(0)  # indexed before any rank looks for the next job's prefix
        return entry

    def _write(
        self,
        entry_id: str,
        tokens: list[int],
        prefill: PrefillResult,
        positions: Ranges,
        pinned: bool,
    ) -> None:
        shard, evicted = keep_shard(
            self.store, self.view, entry_id, prefill.cache, positions, len(tokens), pinned
        )
        for gone in evicted:
            self.index.remove(gone)
        publish_shard(self.index.conn, entry_id, shard, self.view.rank)


def _tag(entry_id: str) -> int:
    return int(hashlib.sha256(entry_id.encode()).hexdigest()[:12], 16)


def rank_prefix_cache(
    conn: redis.Redis,
    home: Path,
    budget_bytes: int | None,
    engine: Engine,
    node: str,
    layout: Layout,
    kv_layout: str,
    model: str,
) -> RankPrefixCache:
    """A rank's handle, from its group's facts (RINGQ_HOME, RINGQ_CACHE_BYTES)."""
    view = view_of(engine, node, layout, kv_layout)
    store = node_store(home, node, budget_bytes)
    return RankPrefixCache(PrefixIndex(conn), store, view, model_key(model))


def describe_source(reused: Reuse | None) -> str | None:
    """For the job's result and `ringq status`: where its cached tokens came from."""
    if reused is None:
        return None
    return f"job {reused.entry_id} ({reused.source})"


@dataclass(frozen=True)
class Dropped:
    entry: CacheEntry
    deleted: list[str]  # files deleted here
    elsewhere: list[str]  # files not on this machine: that node's LRU frees them


def drop_entry(index: PrefixIndex, entry_id: str) -> Dropped | None:
    """Forget an entry and delete its files that this machine can reach."""
    entry = index.remove(entry_id)
    if entry is None:
        return None
    deleted, elsewhere = [], []
    for shard in entry.shards:
        path = Path(shard.file)
        if path.is_file():
            path.unlink(missing_ok=True)
            deleted.append(shard.file)
        else:
            elsewhere.append(f"{shard.node}:{shard.file}")
    return Dropped(entry, deleted, elsewhere)
