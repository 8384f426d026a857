"""The pipeline strategy: layers split over the ranks, chunks flow.

Rank r holds a contiguous slice of the layers (rank 0 also embeds; the last rank also applies the
final norm and the LM head). Prefill takes M + N − 1 steps for M chunks on N ranks: at step t rank
r works on chunk t − r, and every rank joins every step's stop agreement. Within a step, the
hidden states a rank finished travel to r + 1 while it receives this step's input from r − 1;
send and receive run on their own CPU streams and carry evaluated arrays. Decode runs each token
through the stages; the last rank samples."""

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from admission.partition import split_layers
from ring_worker.engine.engines import Engine, Step, logits_from_hidden


def keep_stage(model: nn.Module, rank: int, size: int) -> range:
    """Drop the layers (and embedding / LM head) this rank does not run; returns its layers.
    Call it before the weights are evaluated and the dropped ones are never materialised.
    Idempotent for the same (rank, size)."""
    inner = model.model
    layers = split_layers(model.args.num_hidden_layers, size)[rank]
    kept = getattr(inner, "stage_layers", None)
    if kept is not None:
        if kept != layers:
            raise ValueError(f"model already holds layers {kept}, not {layers}")
        return layers
    first, last, tied = rank == 0, rank == size - 1, model.args.tie_word_embeddings
    inner.layers = inner.layers[layers.start : layers.stop]
    if not first and not (last and tied):
        del inner["embed_tokens"]
    if not last and "lm_head" in model:
        del model["lm_head"]
    inner.stage_layers = layers
    return layers


class PipelineEngine(Engine):
    overlap_decode = False  # stages send and receive: see Engine._post
    paced_layers = 0  # a stage's send/recv overlaps its compute; not measured paced

    def __init__(self, model: nn.Module, group: Any):
        super().__init__(model, group)
        assert self.group is not None, "a pipeline needs a group of two or more ranks"
        self.layers = keep_stage(model, self.rank, self.size)
        self.send_stream = mx.new_stream(mx.cpu)
        self.recv_stream = mx.new_stream(mx.cpu)

    @property
    def last_rank(self) -> int:
        return self.size - 1

    def _checkpoint(self, checkpoints: Any, cache: list[Any], done: int) -> None:
        """Not yet: the stages finish a chunk at different steps, so their parts would not
        describe the same prompt position."""

    def _prefill_steps(self, chunks: list[list[int]], cache: list[Any]) -> Iterator[Step]:
        rank, last_chunk = self.rank, len(chunks) - 1
        outgoing: mx.array | None = None  # finished last step, for rank + 1
        for step in range(len(chunks) + self.size - 1):
            index = step - rank
            working = 0 <= index <= last_chunk
            posted = [] if outgoing is None else [self._send(outgoing)]
            incoming = self._recv(len(chunks[index])) if working and rank > 0 else None
            mx.async_eval(*posted, *([] if incoming is None else [incoming]))
            if incoming is not None:
                # Materialise before computing on it: on CUDA a GPU graph consuming an in-flight
                # receive of the CPU stream hung (32K prompt, 8K chunks, 2xH200).
                mx.eval(incoming)
            outgoing, last_hidden = None, None
            if working:
                x = incoming if incoming is not None else mx.array([chunks[index]])
                hidden = self._stage(x, cache)
                mx.eval(hidden, [c.state for c in cache])
                if rank < self.last_rank:
                    outgoing = hidden
                elif index == last_chunk:
                    last_hidden = hidden[:, -1:]
            mx.eval(*posted)  # this step's send has landed before anyone agrees on stopping
            yield Step(index if working else None, last_hidden)

    def _decode_step(self, token: mx.array, cache: list[Any]) -> mx.array | None:
        """Synchronous: a stage materialises its input before computing on it (see prefill)."""
        x = token.reshape(1, 1) if self.rank == 0 else self._recv(1)
        mx.eval(x)
        hidden = self._stage(x, cache)
        if self.rank < self.last_rank:
            mx.eval(hidden)
            mx.eval(self._send(hidden))
            return None
        logits = logits_from_hidden(self.model, hidden)[0, -1].astype(mx.float32)
        mx.eval(logits)
        return logits

    def _stage(self, x: mx.array, cache: list[Any]) -> mx.array:
        """This rank's layers on token ids (rank 0) or on the previous stage's hidden states."""
        inner = self.model.model
        hidden = inner.embed_tokens(x) if self.rank == 0 else x
        mask = create_attention_mask(hidden, cache[0])
        for layer, layer_cache in zip(inner.layers, cache, strict=True):
            hidden = layer(hidden, mask, layer_cache)
        return inner.norm(hidden) if self.rank == self.last_rank else hidden

    def _send(self, hidden: mx.array) -> mx.array:
        return mx.distributed.send(hidden, self.rank + 1, group=self.group, stream=self.send_stream)

    def _recv(self, length: int) -> mx.array:
        norm = self.model.model.layers[0].input_layernorm.weight
        shape = (1, length, norm.shape[0])
        return mx.distributed.recv(
            shape, norm.dtype, self.rank - 1, group=self.group, stream=self.recv_stream
        )
