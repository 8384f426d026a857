"""A decode batch's forward pass through compiled MLX functions (`mx.compile`), for steps of two
or more rows where ringq's rows attention runs (CUDA; the tests route it to `reference_attention`).

Why: on an H200 a step of 2-8 rows of the 8B shape is host-bound (building its graph in Python
took 3.3-4.4 ms of a 10-14 ms step). A compiled function replays a traced graph in C++ and fuses
its elementwise operations: 9.2 against 11.1 ms a step at 2 rows, 10.6 against 12.9 at 8.

Each layer runs as two compiled calls around the K/V store, which stays an eager slice update at
a Python-int column: compiled, or as a dynamic slice update, MLX's CUDA backend copies the whole
buffer instead of writing in place (12.1 ms a step against 0.6 ms eagerly, 32 rows x 4.6K).
- Every slot of the buffers steps, not only the rows in use (a free slot attends to the one
  column it writes, and its logits are dropped), so most joins and leaves do not retrace; MLX
  keeps a trace per shape.
- RoPE offsets, first columns and visible counts are inputs; the attention kernels' split count
  is fixed per trace (`split_bucket(longest)`).
Each layer is traced again when the slots double, when the buffers grow and when the split count
changes."""

import mlx.core as mx
import mlx.nn as nn

from ring_worker.engine.batch_cache import BatchCache
from ring_worker.engine.fused_linears import mlx_lm_attention
from ring_worker.engine.ring_attention import project_qkv
from ring_worker.engine.rows_attention import RowsAttention, split_bucket


class CompiledStep:
    """Steps a BatchCache's every slot through `model` by one token, layer by layer compiled."""

    def __init__(self, model: nn.Module):
        if not all(isinstance(layer.self_attn, RowsAttention) for layer in model.layers):
            raise ValueError("a compiled step needs rows attention on every layer")
        self.model = model
        self.traces = 0  # how often a layer's two parts were traced (their Python runs only then)
        self._before = mx.compile(self._before_store)
        self._after = mx.compile(self._after_store)
        self._head = mx.compile(self._logits)

    def __call__(self, cache: BatchCache, tokens: mx.array) -> mx.array:
        """Float32 logits (rows, vocab) of the rows' next tokens; every layer's K/V stored."""
        rows = cache.rows
        keys = cache.layers[0].keys
        assert keys is not None
        free = keys.shape[0] - len(rows)
        lengths, column = rows.lengths + [0] * free, rows.end
        offsets = mx.array(lengths)
        starts = mx.array([column - n for n in lengths], dtype=mx.int32)
        visible = mx.array([n + 1 for n in lengths], dtype=mx.int32)
        longest = split_bucket(rows.longest + 1)
        inputs = mx.concatenate([tokens, mx.zeros((free,), tokens.dtype)])[:, None]
        h = self.model.model.embed_tokens(inputs)
        for index, layer in enumerate(cache.layers):
            q, k, v = self._before(h, offsets, index)
            layer.store(k, v)  # eager: in place (see above)
            assert layer.keys is not None and layer.values is not None
            h = self._after(h, q, layer.keys, layer.values, starts, visible, index, longest)
        return self._head(h)[: len(rows)]

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
        """The layer from its attention on (as RowsAttention and mlx-lm's block run it)."""
        self.traces += 1
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
