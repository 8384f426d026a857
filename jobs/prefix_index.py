"""The Redis index of kept KV prefixes: which entry (on which nodes, in which layout) holds which
block chain. Design: jobs/prefix_cache.py. JSON only."""

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import redis
from pydantic import ValidationError

from jobs import keys
from jobs.model_catalog import resolve_model
from jobs.prefix_cache import (
    BLOCK_TOKENS,
    PENDING_TTL_S,
    CacheEntry,
    PrefixHint,
    block_keys,
    choose_entry,
    longest_present,
)

log = logging.getLogger(__name__)


def model_key(model: str) -> str:
    """The model's identity for the hash chain: its name, and for a file on disk its size and
    mtime, so that new weights under an old name never match old KV. Only the identity: the
    caller has checked the model against RINGQ_ALLOWED_DIRS (dispatcher, rank)."""
    source = resolve_model(model, allowed_dirs=None)
    if source.format == "random":
        return f"random:{source.name}"
    try:
        stat = source.path.stat()
    except OSError:
        return f"{source.format}:{source.path}"
    return f"{source.format}:{source.path}:{stat.st_size}:{stat.st_mtime_ns}"


@dataclass(frozen=True)
class PrefixMatch:
    """The longest kept prefix of a prompt at block level: `blocks` full blocks, held by each
    of `entries` (the exact reuse, mid-block included, is settled against the entry's tokens)."""

    blocks: int
    entries: list[CacheEntry]

    @property
    def tokens(self) -> int:
        return self.blocks * BLOCK_TOKENS


class PrefixIndex:
    def __init__(self, conn: redis.Redis):
        self.conn = conn

    def add(self, entry: CacheEntry, tokens: Sequence[int]) -> None:
        """Index `entry` (its prompt `tokens`, of which the first entry.tokens are kept)."""
        chain = block_keys(entry.model_key, tokens[: entry.tokens])
        with self.conn.pipeline() as pipe:
            pipe.set(keys.prefix_entry(entry.id), entry.model_dump_json())
            pipe.set(keys.prefix_entry_tokens(entry.id), json.dumps(list(tokens[: entry.tokens])))
            for block in chain:
                pipe.sadd(keys.prefix_block(block), entry.id)
            pipe.zadd(keys.PREFIX_ENTRIES, {entry.id: entry.last_used_at})
            pipe.execute()

    def match(self, model_key: str, tokens: Sequence[int]) -> PrefixMatch:
        chain = block_keys(model_key, tokens)
        if not chain:
            return PrefixMatch(0, [])
        with self.conn.pipeline(transaction=False) as pipe:
            for block in chain:
                pipe.exists(keys.prefix_block(block))
            present = [bool(n) for n in pipe.execute()]
        blocks = longest_present(present)
        if blocks == 0:
            return PrefixMatch(0, [])
        ids = sorted(_text(i) for i in self.conn.smembers(keys.prefix_block(chain[blocks - 1])))
        return PrefixMatch(blocks, self.entries(ids))

    def get(self, entry_id: str) -> CacheEntry | None:
        found = self.entries([entry_id])
        return found[0] if found else None

    def entries(self, ids: Iterable[str]) -> list[CacheEntry]:
        ids = list(ids)
        if not ids:
            return []
        raws = self.conn.mget([keys.prefix_entry(i) for i in ids])
        found = []
        for entry_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue
            try:
                found.append(CacheEntry.model_validate_json(raw))
            except ValidationError:
                log.warning("prefix cache entry %s: unreadable record in Redis, ignored", entry_id)
        return found

    def tokens(self, entry_id: str) -> list[int] | None:
        raw = self.conn.get(keys.prefix_entry_tokens(entry_id))
        if raw is None:
            return None
        try:
            tokens = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens

    def listing(self) -> list[CacheEntry]:
        """Every entry, most recently used first."""
        raw = self.conn.zrevrange(keys.PREFIX_ENTRIES, 0, -1)
        ids = [_text(cast(bytes | str, i)) for i in raw]
        return self.entries(ids)

    def touch(self, entry_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        entry = self.get(entry_id)
        if entry is None:
            return
        with self.conn.pipeline() as pipe:
            pipe.set(keys.prefix_entry(entry_id), _used(entry, now).model_dump_json())
            pipe.zadd(keys.PREFIX_ENTRIES, {entry_id: now})
            pipe.execute()

    def remove(self, entry_id: str) -> CacheEntry | None:
        """Forget an entry (its files are the store's business); returns what was removed."""
        entry = self.get(entry_id)
        tokens = self.tokens(entry_id) or []
        with self.conn.pipeline() as pipe:
            if entry is not None:
                for block in block_keys(entry.model_key, tokens[: entry.tokens]):
                    pipe.srem(keys.prefix_block(block), entry_id)
            pipe.delete(keys.prefix_entry(entry_id), keys.prefix_entry_tokens(entry_id))
            pipe.zrem(keys.PREFIX_ENTRIES, entry_id)
            pipe.execute()
        return entry


class PendingPrefixes:
    """Prompts being prefilled right now, by block chain: a job whose prefix another job is
    computing waits for it instead of computing it too (one prefill, many questions). A marker
    expires after `ttl_s`, and one of a job that ended is ignored."""

    def __init__(self, conn: redis.Redis, ttl_s: float):
        self.conn = conn
        self.ttl_s = ttl_s

    def mark(self, job_id: str, model_key: str, tokens: Sequence[int]) -> None:
        with self.conn.pipeline(transaction=False) as pipe:
            for block in block_keys(model_key, tokens):
                pipe.set(keys.prefix_pending(block), job_id, px=int(self.ttl_s * 1000))
            pipe.execute()

    def longest(self, model_key: str, tokens: Sequence[int]) -> tuple[str, int] | None:
        """(job id, blocks) of the in-flight prefill sharing most leading blocks, if any."""
        chain = block_keys(model_key, tokens)
        if not chain:
            return None
        owners = self.conn.mget([keys.prefix_pending(b) for b in chain])
        blocks = longest_present([o is not None for o in owners])
        if blocks == 0:
            return None
        return _text(cast(bytes | str, owners[blocks - 1])), blocks

    def clear(self, job_id: str, model_key: str, tokens: Sequence[int]) -> None:
        names = [keys.prefix_pending(b) for b in block_keys(model_key, tokens)]
        if not names:
            return
        owners = self.conn.mget(names)
        mine = [
            n for n, o in zip(names, owners, strict=True) if o is not None and _text(o) == job_id
        ]
        if mine:
            self.conn.delete(*mine)


def read_hint(
    conn: redis.Redis, model: str, tokens: Sequence[int], job_id: str, ended: Callable[[str], bool]
) -> PrefixHint:
    """What the dispatcher plans with: the longest kept prefix (where, from which job) and the
    longest in-flight prefill of the same prefix by another job that has not `ended`."""
    key = model_key(model)
    match = PrefixIndex(conn).match(key, tokens)
    best = choose_entry(match.entries, [])
    pending = PendingPrefixes(conn, PENDING_TTL_S).longest(key, tokens)
    if pending is not None and (pending[0] == job_id or ended(pending[0])):
        pending = None
    return PrefixHint(
        kept_tokens=match.tokens if best is not None else 0,
        kept_nodes=tuple(best.nodes()) if best is not None else (),
        kept_from=f"job {best.id} ({best.describe()})" if best is not None else None,
        pending_job=pending[0] if pending else None,
        pending_tokens=pending[1] * BLOCK_TOKENS if pending else 0,
    )


def _used(entry: CacheEntry, now: float) -> CacheEntry:
    return entry.model_copy(update={"last_used_at": now})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
