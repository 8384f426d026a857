"""Rebuild a rank's KV cache from the shards of a kept prefix, whatever layout made them: keys
carry RoPE at absolute positions and a past is wholly visible, so every layout is a
cut-and-concatenate of every other (jobs/prefix_cache.py). No I/O here."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

Ranges = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class ShardKV:
    layer_start: int
    ranges: tuple[tuple[int, int], ...]
    layers: list[tuple[mx.array, mx.array]]  # (keys, values) per layer, (1, kv_heads, L, D)

    def holds_layer(self, layer: int) -> bool:
        return self.layer_start <= layer < self.layer_start + len(self.layers)


def clip_ranges(ranges: Ranges, end: int) -> list[tuple[int, int]]:
    """The positions below `end`, in the same order."""
    return [(start, min(stop, end)) for start, stop in ranges if start < end]


def trim_to_prefix(cache: Sequence[Any], tokens: int) -> bool:
    """Cut each plain KVCache to its first `tokens` entries, in buffers of exactly that size, a
    layer at a time (each old buffer goes before the next layer's copy is made). The kept
    prompt is then whole arrays, which MLX writes to a file as they are: a view of a larger
    buffer is copied first, every layer at once (30 GB more at 524K tokens of the Qwen2.5-1M
    shape). False, untouched: not plain KVCaches, or one holds fewer entries."""
    if not cache or any(type(c) is not KVCache or c.offset < tokens for c in cache):
        return False
    for layer in cache:
        if layer.keys.shape[2] != tokens:
            layer.keys = mx.contiguous(layer.keys[..., :tokens, :])
            layer.values = mx.contiguous(layer.values[..., :tokens, :])
            mx.eval(layer.keys, layer.values)
        layer.offset = tokens
    return True


def even_split(tokens: int, rank: int, size: int) -> list[tuple[int, int]]:
    """Rank `rank`'s contiguous share of positions [0, tokens) over `size` ranks."""
    base, extra = divmod(tokens, size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return [(start, stop)] if stop > start else []


def kv_at(shards: Sequence[ShardKV], layer: int, want: Ranges) -> tuple[mx.array, mx.array] | None:
    """Layer `layer`'s K/V at the positions `want` (in that order); None if a shard is missing."""
    keys, values = [], []
    for start, stop in want:
        cursor = start
        while cursor < stop:
            piece = _find(shards, layer, cursor, stop)
            if piece is None:
                return None
            k, v, cursor = piece
            keys.append(k)
            values.append(v)
    if not keys:
        return None
    if len(keys) == 1:  # a view, not a copy
        return keys[0], values[0]
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)


def _find(
    shards: Sequence[ShardKV], layer: int, cursor: int, stop: int
) -> tuple[mx.array, mx.array, int] | None:
    """The longest run from `cursor` (below `stop`) that one shard holds, and where it ends."""
    for shard in shards:
        if not shard.holds_layer(layer):
            continue
        offset = 0
        for start, end in shard.ranges:
            if start <= cursor < end:
                upto = min(end, stop)
                first = offset + cursor - start
                k, v = shard.layers[layer - shard.layer_start]
                last = first + upto - cursor
                return k[..., first:last, :], v[..., first:last, :], upto
            offset += end - start
    return None


def build_cache(shards: Sequence[ShardKV], layers: range, want: Ranges) -> list[KVCache] | None:
    """mlx-lm KV caches for `layers` holding the positions `want`; None if shards lack some."""
    caches = []
    for layer in layers:
        kv = kv_at(shards, layer, want)
        if kv is None:
            return None
        cache = KVCache()
        # the arrays themselves, not a copy into a fresh buffer (`update_and_fetch`): a copy
        # held the loaded file and the new cache at once, twice a 128K prompt's KV (16 GiB
        # each on the 8B), and a joining job's load ran a batched H200 group out of memory.
        # The next chunk's update grows the buffer one layer at a time, as after any chunk.
        cache.state = (kv[0], kv[1], kv[0].shape[2])
        caches.append(cache)
    return caches


def cache_arrays(
    cache: Sequence[KVCache], ranges: Ranges, keep: Ranges
) -> list[tuple[mx.array, mx.array]]:
    """The K/V of the positions `keep` from a live cache whose positions are `ranges` (cache
    order): what a rank writes to disk after its job (e.g. the prompt only, not the answer)."""
    shard = ShardKV(0, tuple(ranges), [(c.keys, c.values) for c in cache])
    out = []
    for layer in range(len(cache)):
        kv = kv_at([shard], layer, keep)
        if kv is None:
            raise ValueError(f"the cache does not hold positions {list(keep)}")
        out.append(kv)
    return out
