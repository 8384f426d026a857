"""One forward pass of a decode batch's rows and a chunk of a joining job's prompt together
(chunked prefill riding on the batch's steps, as SGLang's and vLLM's mixed batches).

Why: a job that joins a running batch used to prefill alone between two steps, and every member
waited for it. A decode step of a few rows is bound by reading the weights; a prompt chunk of a
few hundred tokens is bound by its matmuls. Run as one, every projection and MLP matmul reads
its weights once for both, so the members decode a token on each of the joiner's chunks and the
joiner's prefill costs them only what its chunk adds to their step.

Per layer: one norm and one q/k/v matmul over the rows' tokens and the chunk's, laid side by
side as one sequence ((1, rows + chunk, dim)); then RoPE and attention apart, each at its own
positions against its own KV (the rows against the batch's, as a decode step: ring_worker/
rows_attention.py; the chunk causally against its own mlx-lm KV cache, as a plain prefill); then
one o_proj and one MLP over both again. Nothing mixes across positions except attention, so each
row's logits and the chunk's K/V are the ones the rows' own step and the chunk's own prefill
compute, up to the summation order of a larger matmul.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ring_worker.batch_cache import BatchCache, SlotCache
from ring_worker.fused_linears import mlx_lm_attention, project_heads
from ring_worker.pacing import block
from ring_worker.ring_attention import rope_heads
from ring_worker.rows_attention import RowsAttention, masked_step_attention


def ride_forward(
    model: nn.Module, cache: BatchCache, tokens: mx.array, chunk: mx.array, chunk_cache: list[Any]
) -> tuple[mx.array, mx.array]:
    """Step the batch's rows on `tokens` ((rows,) int) and prefill `chunk` ((1, length) int)
    into `chunk_cache` (mlx-lm KV caches holding the chunk's earlier positions), op by op.
    Returns the rows' float32 logits (rows, vocab) and the chunk's last position's normalised
    hidden state (1, 1, dim), as a prefill's last chunk hands to `logits_from_hidden`."""
    rows = tokens.shape[0]
    h = embed(model, tokens, chunk)
    row_offset, chunk_offset = cache.rows.offset, chunk_cache[0].offset
    for index, (slots, own) in enumerate(zip(cache.layers, chunk_cache, strict=True)):
        layer = block(model.layers[index])
        projected = project(layer, h, rows, row_offset, chunk_offset)
        h = finish(layer, h, *attend(layer, projected, slots, own))
    return head(model, h, rows)


class CompiledRide:
    """ride_forward with each layer's projections and its o_proj and MLP as compiled functions
    (`mx.compile`), the K/V stores and the attention between them op by op, as CompiledStep
    runs a decode step (ring_worker/compiled_step.py: a store inside a compiled function copied
    the batch's whole buffers). Op by op, a ride step of the 8B shape spent about 17 ms building
    its graph on an H100, rows or not: 1.9x the time the same chunk and a decode step took one
    after the other (h200-service/overlap-probe-rows-*-ride-h100-steps-16.json). A layer is
    traced once per row count and chunk length; RoPE offsets are inputs."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._project = mx.compile(self._project_layer)
        self._finish = mx.compile(self._finish_layer)
        self._head = mx.compile(lambda h, rows: head(model, h, rows))

    def __call__(
        self, cache: BatchCache, tokens: mx.array, chunk: mx.array, chunk_cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """As ride_forward."""
        rows = tokens.shape[0]
        h = embed(self.model, tokens, chunk)
        row_offset = mx.array(cache.rows.lengths)
        chunk_offset = mx.array([chunk_cache[0].offset])
        for index, (slots, own) in enumerate(zip(cache.layers, chunk_cache, strict=True)):
            projected = self._project(h, row_offset, chunk_offset, index, rows)
            layer = block(self.model.layers[index])
            h = self._finish(h, *attend(layer, projected, slots, own), index)
        logits, hidden = self._head(h, rows)
        return logits, hidden

    def _project_layer(
        self, h: mx.array, row_offset: mx.array, chunk_offset: mx.array, index: int, rows: int
    ) -> tuple[mx.array, ...]:
        return project(block(self.model.layers[index]), h, rows, row_offset, chunk_offset)

    def _finish_layer(
        self, h: mx.array, row_out: mx.array, chunk_out: mx.array, index: int
    ) -> mx.array:
        return finish(block(self.model.layers[index]), h, row_out, chunk_out)


def embed(model: nn.Module, tokens: mx.array, chunk: mx.array) -> mx.array:
    """The rows' tokens and the chunk's as one sequence: (1, rows + length, dim)."""
    embed_tokens = model.model.embed_tokens
    return mx.concatenate([embed_tokens(tokens)[None], embed_tokens(chunk)], axis=1)


def project(
    layer: nn.Module, h: mx.array, rows: int, row_offset: int | mx.array,
    chunk_offset: int | mx.array,
) -> tuple[mx.array, ...]:  # fmt: skip
    """One norm and one q/k/v matmul over both; the rows' q/k/v as a decode step's (rows, heads,
    1, dim), the chunk's as a prefill's (1, heads, length, dim), each RoPE'd at its positions."""
    attn = mlx_lm_attention(layer.self_attn)
    q, k, v = project_heads(attn, layer.input_layernorm(h), fused=True)
    row = rope_heads(attn, q[0, :rows, None], k[0, :rows, None], v[0, :rows, None], row_offset)
    own = rope_heads(attn, q[:, rows:], k[:, rows:], v[:, rows:], chunk_offset)
    return (*row, *own)


def attend(
    layer: nn.Module, projected: tuple[mx.array, ...], slots: SlotCache, own: Any
) -> tuple[mx.array, mx.array]:
    """Store each part's K/V in its own cache and attend: the rows as a decode step, the chunk
    causally after its cache's positions, as a plain prefill."""
    qr, kr, vr, qc, kc, vc = projected
    attn = mlx_lm_attention(layer.self_attn)
    if isinstance(layer.self_attn, RowsAttention):
        row_out = layer.self_attn.step_attention(qr, kr, vr, slots, attn.scale)
    else:
        row_out = masked_step_attention(qr, kr, vr, slots, attn.scale)
    keys, values = own.update_and_fetch(kc, vc)
    mask = "causal" if qc.shape[2] > 1 else None
    chunk_out = mx.fast.scaled_dot_product_attention(qc, keys, values, scale=attn.scale, mask=mask)
    return row_out, chunk_out


def finish(layer: nn.Module, h: mx.array, row_out: mx.array, chunk_out: mx.array) -> mx.array:
    """The layer from its attention on, one o_proj and one MLP over both parts."""
    attn = mlx_lm_attention(layer.self_attn)
    rows, length = row_out.shape[0], chunk_out.shape[2]
    out = mx.concatenate(
        [row_out.astype(h.dtype).transpose(2, 0, 1, 3).reshape(1, rows, -1),
         chunk_out.astype(h.dtype).transpose(0, 2, 1, 3).reshape(1, length, -1)],
        axis=1,
    )  # fmt: skip
    h = h + attn.o_proj(out)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def head(model: nn.Module, h: mx.array, rows: int) -> tuple[mx.array, mx.array]:
    """The rows' float32 logits and the chunk's last normalised hidden state."""
    ends = model.model.norm(mx.concatenate([h[:, :rows], h[:, -1:]], axis=1))
    if model.args.tie_word_embeddings:
        logits = model.model.embed_tokens.as_linear(ends[:, :rows])
    else:
        logits = model.lm_head(ends[:, :rows])
    return logits[0].astype(mx.float32), ends[:, -1:]
