"""A decode batch's forward pass as one compiled MLX function (`mx.compile`), for steps of two or
more rows where ringq's rows attention runs (CUDA; the tests route it to `reference_attention`).

Why: on an H200 a step of 2-8 rows of the 8B shape is host-bound. Building its graph in Python
took 3.3-4.4 ms of a 10-14 ms step, and dispatching it (MLX's eval) most of the rest, while the
device worked ~1-2 ms (bench.step_cost_probe, h200-service/step-cost-aligned-2b25f71.json). A
compiled function builds the step by replaying its traced graph in C++, and fuses its
elementwise operations.

What is traced is the model as it runs eagerly: mlx-lm's modules, `RowsAttention`, the fused
linears, on this module's stand-ins for the batch's `Rows` and `SlotCache`. So that a trace
serves many steps:
- What changes every step is an input: the tokens, the column every row writes at (a dynamic
  slice update), and each row's RoPE offset, first column and visible keys.
- Every slot of the buffers steps, not only the rows in use (a free slot attends to the one
  column it writes, and its logits are dropped). Slots double as rows join and stay while the
  batch lives, so a join or a leave does not retrace.
- The attention kernels' split count is fixed per trace: `split_bucket(longest)` gives the
  kernels the split count the true longest row would.
A trace is made when the slots double, when the buffers grow (every CACHE_STEP_TOKENS columns or
at a join that relays them out) and when the split count changes.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ring_worker.batch_cache import BatchCache, Rows, SlotCache
from ring_worker.fused_linears import mlx_lm_attention
from ring_worker.ring_attention import project_qkv
from ring_worker.rows_attention import RowsAttention, split_bucket


class _TracedRows(Rows):
    """Rows inside a trace: the per-row values are the compiled function's inputs."""

    def __init__(self, offsets: mx.array, starts: mx.array, visible: mx.array, longest: int):
        super().__init__()
        self._offsets, self._first, self._seen, self._longest = offsets, starts, visible, longest

    @property
    def uniform(self) -> bool:
        return False  # rows of one length take the kernels too: one trace for both

    @property
    def longest(self) -> int:
        return self._longest

    @property
    def offset(self) -> mx.array:
        return self._offsets

    def mask(self) -> None:
        return None  # RowsAttention reads each row's own columns: no mask

    def visible(self) -> mx.array:
        return self._seen

    def starts(self) -> mx.array:
        return self._first


class _TracedSlotCache(SlotCache):
    """One layer's buffers inside a trace: the step's K/V go in at an input column."""

    def __init__(self, rows: Rows, keys: mx.array, values: mx.array, column: mx.array):
        super().__init__(rows)
        self.keys, self.values, self._column = keys, values, column

    def store(self, keys: mx.array, values: mx.array) -> None:
        assert self.keys is not None and self.values is not None
        self.keys = mx.slice_update(self.keys, keys, self._column, axes=(2,))
        self.values = mx.slice_update(self.values, values, self._column, axes=(2,))


class CompiledStep:
    """Steps a BatchCache's every slot through `model` by one token, compiled."""

    def __init__(self, model: nn.Module, split: bool = True):
        if not all(isinstance(layer.self_attn, RowsAttention) for layer in model.layers):
            raise ValueError("a compiled step needs rows attention on every layer")
        self.model = model
        self.split = split
        self.traces = 0  # how often the function was traced (its Python runs only then)
        self._forward = mx.compile(self._trace)
        self._before = mx.compile(self._before_store)
        self._after = mx.compile(self._after_store)
        self._head = mx.compile(self._logits)

    def __call__(self, cache: BatchCache, tokens: mx.array) -> mx.array:
        """Float32 logits (rows, vocab) of the rows' next tokens; every layer's K/V stored."""
        rows, layers = cache.rows, cache.layers
        for layer in layers:
            layer.reserve_step(len(rows))
        slots = layers[0].keys.shape[0] if layers[0].keys is not None else len(rows)
        free = slots - len(rows)
        lengths = rows.lengths + [0] * free
        column = rows.end
        inputs = mx.concatenate([tokens, mx.zeros((free,), tokens.dtype)])[:, None]
        offsets = mx.array(lengths)
        starts = mx.array([column - n for n in lengths], dtype=mx.int32)
        visible = mx.array([n + 1 for n in lengths], dtype=mx.int32)
        if self.split:
            return self._split_step(cache, inputs, offsets, starts, visible)[: len(rows)]
        buffers = [buffer for layer in layers for buffer in layer.state]
        logits, buffers = self._forward(
            inputs, mx.array([column]), offsets, starts, visible, buffers,
            split_bucket(rows.longest + 1),
        )  # fmt: skip
        for index, layer in enumerate(layers):
            layer.keys, layer.values = buffers[2 * index], buffers[2 * index + 1]
        return logits[: len(rows)]

    def _trace(
        self,
        inputs: mx.array,
        column: mx.array,
        offsets: mx.array,
        starts: mx.array,
        visible: mx.array,
        buffers: list[mx.array],
        longest: int,
    ) -> tuple[mx.array, list[mx.array]]:
        self.traces += 1
        rows = _TracedRows(offsets, starts, visible, longest - 1)
        caches = [
            _TracedSlotCache(rows, keys, values, column)
            for keys, values in zip(buffers[::2], buffers[1::2], strict=True)
        ]
        logits = self.model(inputs, cache=caches)[:, -1].astype(mx.float32)
        stored: list[Any] = [buffer for cache in caches for buffer in cache.state]
        return logits, stored

    def _split_step(
        self, cache: BatchCache, inputs: mx.array, offsets: mx.array, starts: mx.array,
        visible: mx.array,
    ) -> mx.array:  # fmt: skip
        """Each layer as two compiled calls around an eager store (a static slice update)."""
        column, longest = cache.rows.end, split_bucket(cache.rows.longest + 1)
        h = self.model.model.embed_tokens(inputs)
        for index, layer in enumerate(cache.layers):
            q, k, v = self._before(h, offsets, index)
            assert layer.keys is not None and layer.values is not None
            layer.keys[:, :, column : column + 1] = k
            layer.values[:, :, column : column + 1] = v
            h = self._after(h, q, layer.keys, layer.values, starts, visible, index, longest)
        return self._head(h)

    def _before_store(
        self, x: mx.array, offsets: mx.array, index: int
    ) -> tuple[mx.array, mx.array, mx.array]:
        self.traces += 1
        layer = self.model.layers[index]
        q, k, v = project_qkv(mlx_lm_attention(layer.self_attn), layer.input_layernorm(x), offsets)
        return q, k, v

    def _after_store(
        self, x: mx.array, q: mx.array, keys: mx.array, values: mx.array, starts: mx.array,
        visible: mx.array, index: int, longest: int,
    ) -> mx.array:  # fmt: skip
        layer = self.model.layers[index]
        attn = mlx_lm_attention(layer.self_attn)
        out = layer.self_attn._attend(q, keys, values, starts, visible, longest, attn.scale)
        out = out.astype(x.dtype).transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], -1)
        h = x + attn.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _logits(self, h: mx.array) -> mx.array:
        model = self.model
        out = model.model.norm(h)
        if model.args.tie_word_embeddings:
            out = model.model.embed_tokens.as_linear(out)
        else:
            out = model.lm_head(out)
        return out[:, -1].astype(mx.float32)
