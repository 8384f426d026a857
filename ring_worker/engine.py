"""Prefill and decode over a ring group (or one device when the group is None). No Redis here."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from ring_worker.ring_attention import (
    ChunkSplit,
    Exchange,
    KVLayout,
    Ring,
    install_ring_attention,
)

ProgressFn = Callable[[str, int, int], None]  # (phase, done, total)
StopFn = Callable[[], bool]  # asked on every rank at each chunk / decode step


class Cancelled(Exception):
    """Some rank asked to stop; every rank agreed at the same chunk or decode-step boundary."""


@dataclass(frozen=True)
class PrefillResult:
    logits: mx.array  # (vocab,) float32 at the last prompt position, identical on every rank
    cache: list[Any]  # mlx-lm KV caches holding the whole prompt (replicated on every rank)
    prompt_tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeResult:
    tokens: list[int]
    seconds: float


class Engine:
    """One model on one rank; `ring` is None for the single-device path (plain mlx-lm)."""

    def __init__(
        self,
        model: nn.Module,
        group: Any = None,
        exchange: Exchange = "rotate",
        kv_layout: KVLayout = "replicated",
    ):
        self.model = model
        multi = group is not None and group.size() > 1
        self.ring = Ring(group, exchange, kv_layout) if multi else None
        if self.ring is not None:
            install_ring_attention(model, self.ring)

    @property
    def rank(self) -> int:
        return self.ring.rank if self.ring else 0

    def prefill(
        self,
        tokens: list[int],
        chunk_tokens: int,
        on_progress: ProgressFn | None = None,
        should_stop: StopFn | None = None,
    ) -> PrefillResult:
        """Chunked prefill. `should_stop`, if given, must be given on every rank: the ranks agree
        on it (one tiny collective) after every chunk and raise Cancelled together."""
        if not tokens:
            raise ValueError("cannot prefill an empty prompt")
        started = time.perf_counter()
        cache = make_prompt_cache(self.model)
        if self.ring is not None:
            self.ring.position, self.ring.past_lengths = 0, [0] * self.ring.size
        total = len(tokens)
        hidden = None
        for start in range(0, total, chunk_tokens):
            chunk = tokens[start : start + chunk_tokens]
            hidden = self._prefill_chunk(chunk, cache)
            done = start + len(chunk)
            if on_progress:
                on_progress("prefill", done, total)
            if should_stop is not None and self._agree_flags([0, int(should_stop())])[1]:
                raise Cancelled(f"stopped after {done} of {total} prompt tokens")
        logits = self._share_last_logits(hidden)
        return PrefillResult(logits, cache, total, time.perf_counter() - started)

    def _prefill_chunk(self, chunk: list[int], cache: list[Any]) -> mx.array | None:
        """Run one chunk; return the final hidden state on rank 0 (which holds the last token)."""
        ring = self.ring
        if ring is None or len(chunk) < 2 * ring.size:
            # Too short to split: every rank runs the whole chunk (identical results everywhere;
            # with sharded KV only the step owner, rank 0, keeps its K/V).
            if ring is not None:
                ring.step_owner = 0
            hidden = self._forward(chunk, cache)
            if ring is not None:
                ring.past_lengths[0] += len(chunk)
                ring.position += len(chunk)
            return hidden[:, -1:]
        split = ChunkSplit.zigzag(len(chunk), ring.size)
        ring.split = split
        try:
            hidden = self._forward(split.local_tokens(chunk, ring.rank), cache)
        finally:
            ring.split = None
        ring.past_lengths = [n + split.local_length(r) for r, n in enumerate(ring.past_lengths)]
        ring.position += len(chunk)
        return hidden[:, -1:] if ring.rank == ChunkSplit.last_token_rank else None

    def _forward(self, tokens: list[int], cache: list[Any]) -> mx.array:
        hidden = self.model.model(mx.array([tokens]), cache=cache)
        mx.eval(hidden, [c.state for c in cache])
        return hidden

    def _share_last_logits(self, hidden: mx.array | None) -> mx.array:
        """Logits of the last prompt position only, broadcast from rank 0, which holds it."""
        logits = None if hidden is None else logits_from_hidden(self.model, hidden)[0, -1]
        if self.ring is None:
            assert logits is not None
            return logits.astype(mx.float32)
        if logits is None or self.ring.rank != ChunkSplit.last_token_rank:
            logits = mx.zeros((self.model.args.vocab_size,), dtype=mx.float32)
        shared = mx.distributed.all_sum(logits.astype(mx.float32), group=self.ring.group)
        mx.eval(shared)
        return shared

    def decode(
        self,
        prefill: PrefillResult,
        max_tokens: int,
        *,
        temperature: float = 0.0,
        stop_ids: frozenset[int] = frozenset(),
        seed: int = 0,
        on_progress: ProgressFn | None = None,
        should_stop: StopFn | None = None,
    ) -> DecodeResult:
        """Replicated decode: every rank steps the full model; rank 0's token is broadcast
        together with the ranks' stop flags (one collective per token)."""
        started = time.perf_counter()
        mx.random.seed(seed)
        sampler = make_sampler(temp=temperature)
        logits, tokens = prefill.logits, list[int]()
        while len(tokens) < max_tokens:
            stop = int(should_stop()) if should_stop is not None else 0
            token, stopping = self._agree_flags([self._sampled(sampler(logits[None])), stop])
            if stopping:
                raise Cancelled(f"stopped after {len(tokens)} generated tokens")
            tokens.append(token)
            if on_progress:
                on_progress("decode", len(tokens), max_tokens)
            if token in stop_ids or len(tokens) == max_tokens:
                break
            logits = self._decode_step(token, prefill.cache)
        return DecodeResult(tokens, time.perf_counter() - started)

    def _decode_step(self, token: int, cache: list[Any]) -> mx.array:
        """Logits after `token`. Sharded KV: the step's K/V go to rank position % N, in turn."""
        ring = self.ring
        if ring is not None:
            ring.step_owner = ring.position % ring.size
        logits = self.model(mx.array([[token]]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(logits)  # every rank, now: sharded steps hold collectives every rank must join
        if ring is not None:
            ring.position += 1
        return logits

    def _sampled(self, sampled: mx.array) -> int:
        """Rank 0's sample counts; other ranks contribute 0 to the sum."""
        return cast(int, sampled.item()) if self.rank == 0 else 0

    def _agree_flags(self, values: list[int]) -> list[int]:
        """Element-wise sum over ranks (a broadcast from rank 0 when the others send zeros)."""
        if self.ring is None:
            return values
        summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.ring.group)
        return cast(list[int], summed.tolist())

    def gather_ints(self, value: int) -> list[int]:
        """One integer from every rank, in rank order (e.g. peak memory)."""
        if self.ring is None:
            return [value]
        mine = mx.zeros((self.ring.size,), dtype=mx.int64)
        mine[self.ring.rank] = value
        return cast(list[int], mx.distributed.all_sum(mine, group=self.ring.group).tolist())


def logits_from_hidden(model: nn.Module, hidden: mx.array) -> mx.array:
    """The LM head of mlx-lm's Llama / Qwen3 applied to already-normalised hidden states."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
