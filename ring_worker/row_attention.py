"""Decode attention for a batch whose rows hold different lengths, one fused call per row.

A batch step's rows end at different columns (ring_worker/batch_cache.py), so mlx-lm's
attention gets a boolean mask, and MLX's CUDA backend has no fused decode kernel that takes one:
on one H200 (8B shape, 32 rows of ~4K tokens) a masked step took 51 ms against 17 ms when every
row had the same length (bench/results/batch-decode.md). Here, on GPUs, each row attends to its
own columns [0, length] without a mask: the projections, RoPE and the cache update stay batched,
only the attention call is split per row (slices of the batch buffer, as mlx-lm's KVCache hands
its own buffer's slice to the fused kernel). Rows of one length are one call. On CPU, where
attention is not fused either way, the masked path stays.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import groupby
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ring_worker.batch_cache import SlotCache
from ring_worker.pacing import block, on_gpu
from ring_worker.ring_attention import RingAttention, project_qkv


class RowAttention(nn.Module):
    """One mlx-lm attention module, attending row by row when a batch's rows differ in length."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not isinstance(cache, SlotCache) or cache.rows.uniform:
            return self.inner(x, mask, cache)
        inner = self.inner
        q, k, v = project_qkv(inner, x, cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        out = mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(
                    q[start:stop],
                    keys[start:stop, :, : length + 1],
                    values[start:stop, :, : length + 1],
                    scale=inner.scale,
                )
                for start, stop, length in runs_of_equal_length(cache.rows.lengths)
            ],
            axis=0,
        )
        out = out.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)
        return inner.o_proj(out)


def runs_of_equal_length(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, length) of each run of consecutive rows that hold the same length."""
    runs, start = [], 0
    for length, group in groupby(lengths):
        stop = start + len(list(group))
        runs.append((start, stop, length))
        start = stop
    return runs


@contextmanager
def rows_attend_apart(model: nn.Module, force: bool = False) -> Iterator[None]:
    """Within (on a GPU, or `force`): every layer's innermost attention is a RowAttention (a
    ring's replicated decode calls its inner module, which is the one wrapped)."""
    if not (force or on_gpu()):
        yield
        return
    holders = []
    for layer in model.model.layers:
        attention = block(layer).self_attn
        holder = attention if isinstance(attention, RingAttention) else block(layer)
        name = "inner" if holder is attention else "self_attn"
        holders.append((holder, name, getattr(holder, name)))
    for holder, name, original in holders:
        setattr(holder, name, RowAttention(original))
    try:
        yield
    finally:
        for holder, name, original in holders:
            setattr(holder, name, original)
