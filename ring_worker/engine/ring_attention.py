"""Sequence-parallel Ring Attention for mlx-lm attention modules: the ring math lives here only.

Every prefill chunk is cut into 2N blocks and split zigzag: rank r owns blocks r and 2N-1-r, so
causal work is even across ranks. Per layer, a rank projects its own tokens to Q/K/V (RoPE at
absolute positions) and the ranks share their K/V:
- `rotate`: K/V travel around the ring, overlapped with attention over the block in hand;
  partial attentions are merged with log-sum-exp; block pairs wholly in the future are skipped.
- `allgather`: one all_gather per layer, then one causal attention call per query block over its
  whole prefix, each prefix a slice of one buffer.
KV layouts after each chunk:
- `replicated`: every rank keeps every block; decode is plain mlx-lm on every rank.
- `sharded`: a rank keeps only its own blocks (1/N of the KV); past KV travels or is gathered one
  layer at a time. A decode step runs the new tokens on every rank, one owner rank stores their
  K/V, and every rank's partial attention over its own KV is merged with log-sum-exp."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from admission.partition import PAST_TILE_TOKENS
from admission.vocabulary import Exchange, KVLayout
from ring_worker.engine.fused_linears import project_heads

KV = tuple[mx.array, mx.array]


@dataclass(frozen=True)
class ChunkSplit:
    """2N block boundaries of one chunk; rank r owns blocks r and 2N-1-r (zigzag)."""

    bounds: tuple[int, ...]
    size: int

    @classmethod
    def zigzag(cls, chunk_tokens: int, size: int) -> "ChunkSplit":
        blocks = 2 * size
        if chunk_tokens < blocks:
            raise ValueError(f"chunk of {chunk_tokens} tokens cannot be cut into {blocks} blocks")
        base, extra = divmod(chunk_tokens, blocks)
        bounds = [0]
        for block in range(blocks):
            bounds.append(bounds[-1] + base + (1 if block < extra else 0))
        return cls(tuple(bounds), size)

    def blocks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank

    def block_length(self, block: int) -> int:
        return self.bounds[block + 1] - self.bounds[block]

    def local_length(self, rank: int) -> int:
        return sum(self.block_length(b) for b in self.blocks_of(rank))

    def local_tokens(self, chunk: list[int], rank: int) -> list[int]:
        return [t for b in self.blocks_of(rank) for t in chunk[self.bounds[b] : self.bounds[b + 1]]]

    # The chunk's last token is in block 2N-1, which rank 0 owns.
    last_token_rank = 0


@dataclass
class Ring:
    """A rank's view of its group, and the split of the chunk in prefill (None: run plainly)."""

    group: Any  # mx.distributed.Group
    exchange: Exchange = "rotate"
    kv_layout: KVLayout = "replicated"
    split: ChunkSplit | None = None  # set while a chunk is prefilled over the ring
    position: int = 0  # absolute position of the first token of the current step
    past_lengths: list[int] = field(default_factory=list)  # sharded: tokens each rank holds
    step_owner: int = 0  # sharded: the rank that stores the current step's K/V
    added: list[tuple[int, int]] = field(default_factory=list)  # positions stored this prefill
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
    return merge_with_lse(parts)[0]


def merge_with_lse(parts: list[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """merge_partials, keeping the combined log-sum-exp (to merge again across ranks). A part
    over no keys is (0, -inf) and drops out."""
    out, lse = parts[0]
    for other_out, other_lse in parts[1:]:
        new_lse = mx.logaddexp(lse, other_lse)
        out = out * safe_exp(lse - new_lse) + other_out * safe_exp(other_lse - new_lse)
        lse = new_lse
    return out, lse


def safe_exp(x: mx.array) -> mx.array:
    """exp, with nan (from -inf - -inf) read as 0: a part over no keys weighs nothing."""
    return mx.where(mx.isnan(x), 0.0, mx.exp(x))


def visibility(query_block: int, key_block: int) -> str:
    """How a query block sees a key block under the causal mask: 'full', 'causal' or 'none'."""
    if key_block < query_block:
        return "full"
    return "causal" if key_block == query_block else "none"


def project_qkv(
    attn: nn.Module, x: mx.array, offset: int | mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """Q/K/V of mlx-lm's Llama or Qwen attention (Qwen2: biased projections), RoPE applied at
    absolute positions (one offset, or one per row of a decode batch)."""
    q, k, v = project_heads(attn, x)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = attn.rope(q.transpose(0, 2, 1, 3), offset=offset)
    k = attn.rope(k.transpose(0, 2, 1, 3), offset=offset)
    return q, k, v.transpose(0, 2, 1, 3)


def split_pair(kv: KV, first_length: int) -> tuple[KV, KV]:
    """A rank's (k, v) holds its two blocks back to back; cut them apart."""
    k, v = kv
    first = (k[..., :first_length, :], v[..., :first_length, :])
    second = (k[..., first_length:, :], v[..., first_length:, :])
    return first, second


def rotate_blocks(
    ring: Ring, mine: KV, attend: Callable[[int, KV], list[mx.array]], lengths: list[int]
) -> list[KV]:
    """Pass each rank's K/V around the ring; call attend(src, kv) on each while the next one
    travels. Returns every rank's K/V in rank order.

    Sends carry evaluated arrays, send and receive run on their own CPU streams, and the receive
    is posted before the current attention is evaluated, so communication overlaps compute.
    """
    assert ring.split is not None
    rank, size = ring.rank, ring.size
    held: list[KV | None] = [None] * size
    kv = mine
    mx.eval(*kv)
    for step in range(size):
        src = (rank - step) % size
        held[src] = kv
        pending: list[mx.array] = []
        if step < size - 1:
            incoming = (rank - step - 1) % size
            pending = post_exchange(ring, kv, lengths[incoming])
            mx.async_eval(pending)
        computed = attend(src, kv)
        mx.eval(*pending, *computed)
        if pending:
            kv = (pending[2], pending[3])
    return [h for h in held if h is not None]


def post_exchange(ring: Ring, kv: KV, incoming_length: int) -> list[mx.array]:
    """Send (k, v) to rank r+1 and receive rank r-1's; returns [send k, send v, recv k, recv v]."""
    nxt, prv = (ring.rank + 1) % ring.size, (ring.rank - 1) % ring.size
    sends = [mx.distributed.send(a, nxt, group=ring.group, stream=ring.send_stream) for a in kv]
    recvs = [
        mx.distributed.recv(
            (*a.shape[:2], incoming_length, a.shape[3]),
            a.dtype,
            prv,
            group=ring.group,
            stream=ring.recv_stream,
        )
        for a in kv
    ]
    return [*sends, *recvs]


def gather_blocks(ring: Ring, mine: KV, lengths: list[int]) -> list[KV]:
    """Every rank's K/V with one all_gather (K and V side by side, padded to the longest rank,
    then trimmed). One collective, so every rank pairs them up in the same order."""
    k, v = mine
    both = mx.concatenate([k, v.astype(k.dtype)], axis=-1)
    pad = max(lengths) - both.shape[2]
    if pad:
        both = mx.pad(both, [(0, 0), (0, 0), (0, pad), (0, 0)])
    gathered = mx.distributed.all_gather(both, group=ring.group)
    dim = k.shape[-1]
    return [
        (gathered[r : r + 1, :, :length, :dim], gathered[r : r + 1, :, :length, dim:])
        for r, length in enumerate(lengths)
    ]


def blocks_in_order(split: ChunkSplit, per_rank: list[KV]) -> list[KV]:
    """The chunk's 2N K/V blocks in position order, from each rank's pair of blocks."""
    blocks: list[KV | None] = [None] * (2 * split.size)
    for rank, kv in enumerate(per_rank):
        first, second = split.blocks_of(rank)
        blocks[first], blocks[second] = split_pair(kv, split.block_length(first))
    return [b for b in blocks if b is not None]


class RingAttention(nn.Module):
    """Wraps one mlx-lm attention module: a ring chunk while `ring.split` is set, a sharded step
    when the KV layout is sharded, and the plain module otherwise."""

    def __init__(self, inner: nn.Module, ring: Ring):
        super().__init__()
        self.inner = inner
        self._ring = ring

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        ring = self._ring
        if cache is None:
            return self.inner(x, mask, cache)
        if ring.split is not None:
            out = self._ring_chunk(x, cache)
        elif ring.kv_layout == "sharded":
            out = self._sharded_step(x, cache)
        else:
            return self.inner(x, mask, cache)
        out = out.astype(x.dtype).transpose(0, 2, 1, 3)
        return self.inner.o_proj(out.reshape(x.shape[0], x.shape[1], -1))

    def _ring_chunk(self, x: mx.array, cache: Any) -> mx.array:
        ring = self._ring
        queries, mine = self._project_local(x)
        sharded = ring.kv_layout == "sharded"
        payload = with_local_past(mine, cache) if sharded else mine
        if ring.exchange == "allgather":
            per_rank = gather_blocks(ring, payload, self._payload_lengths())
            outs = self._prefix_outputs(queries, per_rank, cache)
        else:
            outs, per_rank = self._rotate(queries, payload, cache)
            self._store(self._chunk_blocks(per_rank), cache)
        return mx.concatenate(outs, axis=2)

    def _chunk_blocks(self, per_rank: list[KV]) -> list[KV]:
        """The current chunk's 2N K/V blocks in position order, from every rank's payload."""
        split = self._ring.split
        assert split is not None
        kept = [split_past(kv, self._past_length(r))[1] for r, kv in enumerate(per_rank)]
        return blocks_in_order(split, kept)

    def _store(self, blocks: list[KV], cache: Any) -> KV:
        """Append the chunk's K/V to the cache (replicated: every block; sharded: this rank's
        two); returns the cache's keys and values up to its new end."""
        ring = self._ring
        split = ring.split
        assert split is not None
        if ring.kv_layout == "sharded":
            blocks = [blocks[b] for b in split.blocks_of(ring.rank)]
        return cache.update_and_fetch(
            mx.concatenate([k for k, _ in blocks], axis=2),
            mx.concatenate([v for _, v in blocks], axis=2),
        )

    def _past_length(self, rank: int) -> int:
        ring = self._ring
        return ring.past_lengths[rank] if ring.kv_layout == "sharded" else 0

    def _payload_lengths(self) -> list[int]:
        split = self._ring.split
        assert split is not None
        return [self._past_length(r) + split.local_length(r) for r in range(self._ring.size)]

    def _project_local(self, x: mx.array) -> tuple[list[mx.array], KV]:
        """Queries of this rank's two blocks, and its K/V (both blocks back to back)."""
        ring = self._ring
        split, start = ring.split, ring.position
        assert split is not None
        first, second = split.blocks_of(ring.rank)
        cut = split.block_length(first)
        qa, ka, va = project_qkv(self.inner, x[:, :cut], start + split.bounds[first])
        qb, kb, vb = project_qkv(self.inner, x[:, cut:], start + split.bounds[second])
        mine = (mx.concatenate([ka, kb], axis=2), mx.concatenate([va, vb], axis=2))
        return [qa, qb], mine

    def _prefix_outputs(
        self, queries: list[mx.array], per_rank: list[KV], cache: Any
    ) -> list[mx.array]:
        """All-gather path: one causal SDPA per query block over every earlier key and its own,
        each a slice of one buffer (no copy of the past per block). Replicated: the cache, once
        the chunk is stored in it. Sharded: every rank's past, then the chunk, concatenated once."""
        ring = self._ring
        split = ring.split
        assert split is not None
        blocks = self._chunk_blocks(per_rank)
        keys, values = self._store(blocks, cache)
        if ring.kv_layout == "sharded":
            pasts = [split_past(kv, self._past_length(r))[0] for r, kv in enumerate(per_rank)]
            ordered = [p for p in pasts if p[0].shape[2]] + blocks
            keys = mx.concatenate([k for k, _ in ordered], axis=2)
            values = mx.concatenate([v for _, v in ordered], axis=2)
        past_length = keys.shape[2] - split.bounds[-1]
        return [
            prefix_attention(self.inner, q, keys, values, past_length + split.bounds[block + 1])
            for q, block in zip(queries, split.blocks_of(ring.rank), strict=True)
        ]

    def _rotate(
        self, queries: list[mx.array], payload: KV, cache: Any
    ) -> tuple[list[mx.array], list[KV]]:
        ring, attn = self._ring, self.inner
        split = ring.split
        assert split is not None
        own_blocks = split.blocks_of(ring.rank)
        grouped = [group_heads(q, attn.n_kv_heads) for q in queries]
        local_past = attend_past if ring.kv_layout == "replicated" else no_past
        parts = [local_past(q, cache, attn.scale) for q in grouped]

        def attend(src: int, kv: KV) -> list[mx.array]:
            computed: list[mx.array] = []
            (past_k, past_v), blocks = split_past(kv, self._past_length(src))
            pair = split_pair(blocks, split.block_length(split.blocks_of(src)[0]))
            for q, query_block, q_parts in zip(grouped, own_blocks, parts, strict=True):
                if past_k.shape[2]:
                    q_parts.append(partial_attention(q, past_k, past_v, attn.scale, False))
                    computed.extend(q_parts[-1])
                for key_block, (k, v) in zip(split.blocks_of(src), pair, strict=True):
                    seen = visibility(query_block, key_block)
                    if seen != "none":
                        part = partial_attention(q, k, v, attn.scale, causal=seen == "causal")
                        q_parts.append(part)
                        computed.extend(part)
            return computed

        per_rank = rotate_blocks(ring, payload, attend, self._payload_lengths())
        outs = [ungroup_heads(merge_partials(p)) for p in parts]
        return outs, per_rank

    def _sharded_step(self, x: mx.array, cache: Any) -> mx.array:
        """New tokens computed on every rank; the step owner stores their K/V; partial
        attentions over each rank's own KV are merged across ranks (one all_gather)."""
        ring, attn = self._ring, self.inner
        q, k, v = project_qkv(attn, x, ring.position)
        grouped = group_heads(q, attn.n_kv_heads)
        parts = attend_past(grouped, cache, attn.scale)
        if ring.rank == ring.step_owner:
            parts.append(partial_attention(grouped, k, v, attn.scale, causal=True))
            cache.update_and_fetch(k, v)
        if parts:
            out, lse = merge_with_lse(parts)
        else:  # this rank holds none of the keys yet
            out = mx.zeros((*grouped.shape[:-1], v.shape[-1]), dtype=mx.float32)
            lse = mx.full((*grouped.shape[:-1], 1), -mx.inf, dtype=mx.float32)
        # One collective for both: two independent all_gathers could run in a different order on
        # different ranks (each rank's graph differs) and pair up wrongly.
        both = mx.distributed.all_gather(mx.concatenate([out, lse], axis=-1), group=ring.group)
        dim = out.shape[-1]
        merged = merge_partials(
            [(both[r : r + 1, ..., :dim], both[r : r + 1, ..., dim:]) for r in range(ring.size)]
        )
        return ungroup_heads(merged)


def with_local_past(mine: KV, cache: Any) -> KV:
    """This rank's stored K/V (earlier chunks) followed by its blocks of the current chunk."""
    if not cache.offset:
        return mine
    past_k = cache.keys[..., : cache.offset, :]
    past_v = cache.values[..., : cache.offset, :]
    return mx.concatenate([past_k, mine[0]], axis=2), mx.concatenate([past_v, mine[1]], axis=2)


def split_past(kv: KV, past_length: int) -> tuple[KV, KV]:
    """A payload is a rank's past K/V then its current blocks; cut them apart."""
    return split_pair(kv, past_length)


def no_past(q: mx.array, cache: Any, scale: float) -> list[tuple[mx.array, mx.array]]:
    """Sharded layout: the past arrives with the rotating payloads, none is attended locally."""
    return []


def group_heads(q: mx.array, kv_heads: int) -> mx.array:
    batch, heads, length, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads, length, dim)


def ungroup_heads(out: mx.array) -> mx.array:
    batch, kv_heads, group, length, dim = out.shape
    return out.reshape(batch, kv_heads * group, length, dim)


def prefix_attention(
    attn: nn.Module, q: mx.array, keys: mx.array, values: mx.array, end: int
) -> mx.array:
    """One causal SDPA call of a query block whose last key is `end - 1`, over keys[:end] (MLX
    aligns the causal mask to the end when queries are fewer than keys)."""
    k, v = keys[..., :end, :], values[..., :end, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=attn.scale, mask="causal")


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
