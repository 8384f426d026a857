"""Sequence-parallel Ring Attention for mlx-lm attention modules: the ring math lives here only.

Each rank holds one contiguous block of every prefill chunk. Per layer, a rank projects its own
tokens to Q/K/V (RoPE at absolute positions), then K/V blocks travel around the ring: at step s
rank r holds the block of rank (r - s) mod N. While the next block is in flight the current one
is attended to; blocks wholly in the future are never computed. Partial results are merged with
log-sum-exp. Every rank keeps every block it saw, so after a chunk each rank's KV cache holds the
whole chunk in order: replicated KV, and decode is plain mlx-lm on every rank.
"""

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Past-cache keys are attended in tiles of this many tokens so score matrices stay bounded.
PAST_TILE_TOKENS = 4096


@dataclass(frozen=True)
class ChunkSplit:
    """Block boundaries of one chunk over the ranks: rank r owns [bounds[r], bounds[r + 1])."""

    bounds: tuple[int, ...]

    @classmethod
    def even(cls, chunk_tokens: int, size: int) -> "ChunkSplit":
        if chunk_tokens < size:
            raise ValueError(f"chunk of {chunk_tokens} tokens cannot be split over {size} ranks")
        base, extra = divmod(chunk_tokens, size)
        bounds = [0]
        for rank in range(size):
            bounds.append(bounds[-1] + base + (1 if rank < extra else 0))
        return cls(tuple(bounds))

    def length(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]


@dataclass
class Ring:
    """A rank's view of its group, and the split of the chunk in prefill (None: run plainly)."""

    group: Any  # mx.distributed.Group
    split: ChunkSplit | None = None
    send_stream: Any = field(default_factory=lambda: mx.new_stream(mx.cpu))
    recv_stream: Any = field(default_factory=lambda: mx.new_stream(mx.cpu))

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


def partial_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool
) -> tuple[mx.array, mx.array]:
    """Attention of grouped queries over one K/V block, with its log-sum-exp.

    q: (B, kv_heads, group, Lq, D); k, v: (B, kv_heads, Lk, D). GQA without repeating K/V: the
    query heads sharing a KV head are a broadcast axis. `causal` aligns the diagonal of a square
    block (query i sees keys 0..i). Returns out (B, kv_heads, group, Lq, D) in float32 and lse
    (B, kv_heads, group, Lq, 1).
    """
    k = mx.expand_dims(k, 2).astype(mx.float32)
    v = mx.expand_dims(v, 2).astype(mx.float32)
    scores = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    if causal:
        lq, lk = scores.shape[-2:]
        visible = mx.arange(lq)[:, None] >= mx.arange(lk)[None]
        scores = mx.where(visible, scores, -mx.inf)
    # One exp per score (elementwise work dominates attention on CPU): p = exp(s - max).
    row_max = mx.max(scores, axis=-1, keepdims=True)
    weights = mx.exp(scores - row_max)
    row_sum = mx.sum(weights, axis=-1, keepdims=True)
    return (weights @ v) / row_sum, row_max + mx.log(row_sum)


def merge_partials(parts: list[tuple[mx.array, mx.array]]) -> mx.array:
    """Combine partial attentions over disjoint key sets into the exact softmax attention."""
    out, lse = parts[0]
    for other_out, other_lse in parts[1:]:
        new_lse = mx.logaddexp(lse, other_lse)
        out = out * mx.exp(lse - new_lse) + other_out * mx.exp(other_lse - new_lse)
        lse = new_lse
    return out


def project_qkv(attn: nn.Module, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
    """Q/K/V of mlx-lm's Llama or Qwen3 attention, RoPE applied at absolute positions."""
    batch, length, _ = x.shape
    q = attn.q_proj(x).reshape(batch, length, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q.transpose(0, 2, 1, 3), offset=offset)
    k = attn.rope(k.transpose(0, 2, 1, 3), offset=offset)
    return q, k, v.transpose(0, 2, 1, 3)


def rotate_blocks(ring: Ring, k: mx.array, v: mx.array, attend) -> list[tuple[mx.array, mx.array]]:
    """Pass K/V blocks around the ring; call attend(src, k, v) on each while the next travels.

    Returns every rank's block in rank order. Sends carry evaluated arrays, send and receive run
    on their own CPU streams, and the receive is posted before the current block's attention is
    evaluated, so communication overlaps compute.
    """
    assert ring.split is not None
    rank, size = ring.rank, ring.size
    blocks: list[tuple[mx.array, mx.array] | None] = [None] * size
    mx.eval(k, v)
    for step in range(size):
        src = (rank - step) % size
        blocks[src] = (k, v)
        pending: list[mx.array] = []
        if step < size - 1:
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            incoming = (rank - step - 1) % size
            shape_k = (*k.shape[:2], ring.split.length(incoming), k.shape[3])
            shape_v = (*v.shape[:2], ring.split.length(incoming), v.shape[3])
            sends = [
                mx.distributed.send(a, nxt, group=ring.group, stream=ring.send_stream)
                for a in (k, v)
            ]
            new_k = mx.distributed.recv(
                shape_k, k.dtype, prv, group=ring.group, stream=ring.recv_stream
            )
            new_v = mx.distributed.recv(
                shape_v, v.dtype, prv, group=ring.group, stream=ring.recv_stream
            )
            pending = [*sends, new_k, new_v]
            mx.async_eval(pending)
        computed = attend(src, k, v)
        mx.eval(*pending, *computed)
        if pending:
            k, v = new_k, new_v
    return [b for b in blocks if b is not None]


class RingAttention(nn.Module):
    """Wraps one mlx-lm attention module; runs the ring while `ring.split` is set."""

    def __init__(self, inner: nn.Module, ring: Ring):
        super().__init__()
        self.inner = inner
        self._ring = ring

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ring = self._ring
        if ring.split is None or cache is None:
            return self.inner(x, mask, cache)
        attn = self.inner
        start = cache.offset
        q, k, v = project_qkv(attn, x, start + ring.split.bounds[ring.rank])
        batch, _, length, head_dim = q.shape
        q = q.reshape(batch, attn.n_kv_heads, -1, length, head_dim)
        parts = attend_past(q, cache, attn.scale)

        def attend(src: int, block_k: mx.array, block_v: mx.array) -> list[mx.array]:
            if src > ring.rank:  # wholly in this rank's future
                return []
            part = partial_attention(q, block_k, block_v, attn.scale, causal=src == ring.rank)
            parts.append(part)
            return list(part)

        blocks = rotate_blocks(ring, k, v, attend)
        cache.update_and_fetch(
            mx.concatenate([b[0] for b in blocks], axis=2),
            mx.concatenate([b[1] for b in blocks], axis=2),
        )
        out = merge_partials(parts).astype(x.dtype)
        out = out.reshape(batch, -1, length, head_dim).transpose(0, 2, 1, 3)
        return attn.o_proj(out.reshape(batch, length, -1))


def attend_past(q: mx.array, cache: Any, scale: float) -> list[tuple[mx.array, mx.array]]:
    """Partial attentions of q over everything already in the cache (earlier chunks), tiled."""
    parts = []
    for start in range(0, cache.offset, PAST_TILE_TOKENS):
        end = min(start + PAST_TILE_TOKENS, cache.offset)
        k = cache.keys[..., start:end, :]
        v = cache.values[..., start:end, :]
        parts.append(partial_attention(q, k, v, scale, causal=False))
    return parts


def install_ring_attention(model: nn.Module, ring: Ring) -> None:
    """Replace every layer's self_attn with a RingAttention wrapper sharing `ring`."""
    for layer in model.layers:
        if not isinstance(layer.self_attn, RingAttention):
            layer.self_attn = RingAttention(layer.self_attn, ring)
