"""Prefill and decode on one rank of a group, for each strategy. No Redis here.

- `Engine`: one device, plain mlx-lm modules (the `single` strategy and the baseline).
- `RingEngine`: sequence parallel; every rank holds every layer, attention is ring attention.
- `PipelineEngine` (ring_worker/pipeline.py): layers split over ranks, chunks flow rank to rank.
`ring_worker/strategies.py` picks one for a group.

The loops (chunking, progress, agreeing on a stop, sampling) live here once; a strategy says how
one prefill step and one decode step run, and which rank holds the last position.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
WARM_UP_TOKENS = 1024  # K/V all-gathered once when a ring engine starts (RingEngine._warm_up)


class Cancelled(Exception):
    """Some rank asked to stop; every rank agreed at the same chunk or decode-step boundary."""


@dataclass(frozen=True)
class PrefillResult:
    logits: mx.array  # (vocab,) float32 at the last prompt position, identical on every rank
    cache: list[Any]  # this rank's mlx-lm KV caches (what they hold depends on the strategy)
    prompt_tokens: int
    seconds: float
    # Positions whose K/V this prefill added to this rank's cache, in cache order (all of them
    # but on a sharded ring); a continued cache holds its earlier positions before these.
    ranges: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class DecodeResult:
    tokens: list[int]
    seconds: float


@dataclass(frozen=True)
class Step:
    """What one prefill step did on this rank: the chunk it finished (None when idle) and, after
    the prompt's last chunk on the rank holding the last position, that position's hidden state."""

    chunk: int | None
    last_hidden: mx.array | None = None


class Engine:
    """One model on one rank. This base class is the single-device path: mlx-lm's own modules,
    chunked prefill, the LM head applied to the last position only."""

    overlap_decode = True  # queue decode step t + 1 before reading step t's vote

    def __init__(self, model: nn.Module, group: Any = None):
        self.model = model
        self.group = group if group is not None and group.size() > 1 else None

    @property
    def rank(self) -> int:
        return self.group.rank() if self.group is not None else 0

    @property
    def size(self) -> int:
        return self.group.size() if self.group is not None else 1

    @property
    def last_rank(self) -> int:
        """The rank that holds the last position's hidden state and samples decode tokens."""
        return 0

    # -- prefill ---------------------------------------------------------------------------

    def prefill(
        self,
        tokens: list[int],
        chunk_tokens: int,
        on_progress: ProgressFn | None = None,
        should_stop: StopFn | None = None,
        cache: list[Any] | None = None,
    ) -> PrefillResult:
        """Chunked prefill. Progress goes (0, total), then once per chunk up to (total, total) on
        every rank, for every strategy. `should_stop`, if given, must be given on every rank: the
        ranks agree on it (one tiny collective) after every step and raise Cancelled together.
        `cache`: this rank's KV cache of earlier tokens that `tokens` continue, in this engine's
        layout (ring_worker/kv_reshard.py builds one from a kept prefix); every rank passes one
        or none."""
        if not tokens:
            raise ValueError("cannot prefill an empty prompt")
        started = time.perf_counter()
        total = len(tokens)
        chunks = [tokens[s : s + chunk_tokens] for s in range(0, total, chunk_tokens)]
        ends = [min((i + 1) * chunk_tokens, total) for i in range(len(chunks))]
        cache = make_prompt_cache(self.model) if cache is None else cache
        start = self._begin_prefill(cache)
        if on_progress:
            on_progress("prefill", 0, total)
        hidden = None
        for step in self._prefill_steps(chunks, cache):
            if step.last_hidden is not None:
                hidden = step.last_hidden
            if step.chunk is not None and on_progress:
                on_progress("prefill", ends[step.chunk], total)
            if should_stop is not None and self._agree_flags([0, int(should_stop())])[1]:
                done = ends[step.chunk] if step.chunk is not None else 0
                raise Cancelled(f"stopped after {done} of {total} prompt tokens")
        logits = self._share_last_logits(hidden)
        ranges = tuple(self._added_ranges(start, total))
        return PrefillResult(logits, cache, total, time.perf_counter() - started, ranges)

    def _begin_prefill(self, cache: list[Any]) -> int:
        """Position of the prompt's first token: the tokens the cache already stands for."""
        return cache[0].offset if cache else 0

    def _added_ranges(self, start: int, total: int) -> list[tuple[int, int]]:
        return [(start, start + total)]

    def _prefill_steps(self, chunks: list[list[int]], cache: list[Any]) -> Iterator[Step]:
        """Like mlx-lm's prefill, a chunk before the last evaluates the caches alone, which
        skips its last layer's MLP and the final norm; the last chunk runs that MLP on its last
        position only (0.07-0.09 s of 10.8 s at 128K tokens, Llama-3-8B shape, one H200)."""
        for index, chunk in enumerate(chunks[:-1]):
            self.model.model(mx.array([chunk]), cache=cache)
            mx.eval([c.state for c in cache])
            yield Step(index)
        with last_position_mlp(self.model):
            hidden = self._forward(chunks[-1], cache)
        yield Step(len(chunks) - 1, hidden[:, -1:])

    def _forward(self, tokens: list[int], cache: list[Any]) -> mx.array:
        hidden = self.model.model(mx.array([tokens]), cache=cache)
        mx.eval(hidden, [c.state for c in cache])
        return hidden

    def _share_last_logits(self, hidden: mx.array | None) -> mx.array:
        """Logits of the last prompt position only, sent from the rank that holds it to all."""
        logits = None
        if hidden is not None and self.rank == self.last_rank:
            logits = logits_from_hidden(self.model, hidden)[0, -1]
        if self.group is None:
            assert logits is not None
            return logits.astype(mx.float32)
        if logits is None:
            logits = mx.zeros((self.model.args.vocab_size,), dtype=mx.float32)
        shared = mx.distributed.all_sum(logits.astype(mx.float32), group=self.group)
        mx.eval(shared)
        return shared

    # -- decode ----------------------------------------------------------------------------

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
        """Every rank takes part in every step. A step's vote (the sampling rank's token and
        every rank's stop flag, one collective) stays on the device and feeds the next step,
        which is queued before the vote is read on the host (mlx-lm's async_eval overlap): the
        device never waits for Python. On a stop token one queued step is wasted, as in mlx-lm."""
        started = time.perf_counter()
        mx.random.seed(seed)
        sampler = make_sampler(temp=temperature)
        tokens = list[int]()
        vote = self._post(self._vote(sampler, prefill.logits, should_stop))
        while len(tokens) < max_tokens:
            upcoming = None
            if len(tokens) + 1 < max_tokens:
                logits = self._decode_step(vote[:1], prefill.cache)
                upcoming = self._post(self._vote(sampler, logits, should_stop))
            token, stopping = cast(list[int], vote.tolist())
            if stopping:
                raise Cancelled(f"stopped after {len(tokens)} generated tokens")
            tokens.append(token)
            if on_progress:
                on_progress("decode", len(tokens), max_tokens)
            if token in stop_ids or upcoming is None:
                break
            vote = upcoming
        return DecodeResult(tokens, time.perf_counter() - started)

    def _post(self, vote: mx.array) -> mx.array:
        """Start evaluating a vote: every rank's is under way before any rank waits on a step.
        Where steps send and receive (a pipeline), the vote must have landed first: MLX's ring
        backend carries collectives and send/recv over the same connections (3 ranks deadlocked
        when they overlapped)."""
        if self.overlap_decode:
            mx.async_eval(vote)
        else:
            mx.eval(vote)
        return vote

    def _decode_step(self, token: mx.array, cache: list[Any]) -> mx.array | None:
        """Logits after `token` (shape (1,), maybe not evaluated yet); None on ranks that do
        not sample. Lazy: the caller evaluates them with the step's vote."""
        return self.model(token.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32)

    def _vote(
        self,
        sampler: Callable[[mx.array], mx.array],
        logits: mx.array | None,
        should_stop: StopFn | None,
    ) -> mx.array:
        """[token, stop votes] summed over ranks: the sampling rank's token (the others add 0,
        still computed from their logits so that every rank evaluates its whole step) and every
        rank's stop flag. Lazy."""
        stop = mx.array([int(should_stop()) if should_stop is not None else 0], dtype=mx.int32)
        if logits is None:
            token = mx.zeros((1,), dtype=mx.int32)
        else:
            token = sampler(logits[None]).astype(mx.int32) * int(self.rank == self.last_rank)
        vote = mx.concatenate([token.reshape(1), stop])
        return vote if self.group is None else mx.distributed.all_sum(vote, group=self.group)

    # -- agreement -------------------------------------------------------------------------

    def _agree_flags(self, values: list[int]) -> list[int]:
        """Element-wise sum over ranks (a broadcast when only one rank sends non-zeros)."""
        if self.group is None:
            return values
        summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        return cast(list[int], summed.tolist())

    def gather_ints(self, value: int) -> list[int]:
        """One integer from every rank, in rank order (e.g. peak memory)."""
        if self.group is None:
            return [value]
        mine = mx.zeros((self.size,), dtype=mx.int64)
        mine[self.rank] = value
        return cast(list[int], mx.distributed.all_sum(mine, group=self.group).tolist())


class RingEngine(Engine):
    """Sequence parallel: each chunk is split zigzag over the ranks; attention is ring attention
    (ring_worker/ring_attention.py), everything else runs on each rank's own tokens."""

    def __init__(
        self,
        model: nn.Module,
        group: Any,
        exchange: Exchange = "rotate",
        kv_layout: KVLayout = "replicated",
    ):
        super().__init__(model, group)
        assert self.group is not None, "a ring needs a group of two or more ranks"
        self.ring = Ring(self.group, exchange, kv_layout)
        install_ring_attention(model, self.ring)
        self._warm_up()

    def _warm_up(self) -> None:
        """One all_gather the size of a layer's K/V for WARM_UP_TOKENS and one vote, while
        loading: NCCL connects its peers lazily, at the first collective, which would otherwise
        land in the first job's prefill."""
        kv_dim = self.model.layers[0].self_attn.inner.k_proj.weight.shape[0]
        payload = mx.zeros((WARM_UP_TOKENS, kv_dim), dtype=mx.float32)  # = K and V in bf16
        mx.eval(
            mx.distributed.all_gather(payload, group=self.group),
            mx.distributed.all_sum(mx.zeros((2,), dtype=mx.int32), group=self.group),
        )

    @property
    def last_rank(self) -> int:
        return ChunkSplit.last_token_rank

    def _begin_prefill(self, cache: list[Any]) -> int:
        """Sharded: the ranks' caches hold disjoint positions, in any order (attention over a
        past is order-free), so the prompt starts after all of them (one collective)."""
        ring = self.ring
        held = cache[0].offset
        if ring.kv_layout == "sharded":
            ring.past_lengths = self.gather_ints(held)
            ring.position = sum(ring.past_lengths)
        else:
            ring.past_lengths, ring.position = [0] * ring.size, held
        ring.added = []
        return ring.position

    def _added_ranges(self, start: int, total: int) -> list[tuple[int, int]]:
        if self.ring.kv_layout == "sharded":
            return list(self.ring.added)
        return super()._added_ranges(start, total)

    def _prefill_steps(self, chunks: list[list[int]], cache: list[Any]) -> Iterator[Step]:
        for index, chunk in enumerate(chunks):
            hidden = self._ring_chunk(chunk, cache)
            last = index == len(chunks) - 1 and hidden is not None
            yield Step(index, hidden[:, -1:] if last and hidden is not None else None)

    def _ring_chunk(self, chunk: list[int], cache: list[Any]) -> mx.array | None:
        """Run one chunk; return the hidden states on the rank that holds the chunk's last token."""
        ring = self.ring
        if len(chunk) < 2 * ring.size:
            # Too short to split: every rank runs the whole chunk (identical results everywhere;
            # with sharded KV only the step owner, rank 0, keeps its K/V).
            ring.step_owner = 0
            hidden = self._forward(chunk, cache)
            if ring.rank == 0:
                ring.added.append((ring.position, ring.position + len(chunk)))
            ring.past_lengths[0] += len(chunk)
            ring.position += len(chunk)
            return hidden
        split = ChunkSplit.zigzag(len(chunk), ring.size)
        ring.split = split
        try:
            hidden = self._forward(split.local_tokens(chunk, ring.rank), cache)
        finally:
            ring.split = None
        ring.past_lengths = [n + split.local_length(r) for r, n in enumerate(ring.past_lengths)]
        ring.added += [
            (ring.position + split.bounds[b], ring.position + split.bounds[b + 1])
            for b in split.blocks_of(ring.rank)
        ]
        ring.position += len(chunk)
        return hidden if ring.rank == ChunkSplit.last_token_rank else None

    def _decode_step(self, token: mx.array, cache: list[Any]) -> mx.array | None:
        """Every rank steps the full model. Sharded KV: the step's K/V go to rank position % N,
        in turn, and the step's logits must be evaluated on every rank (collectives inside:
        `_vote` makes every rank's vote depend on its logits)."""
        ring = self.ring
        ring.step_owner = ring.position % ring.size
        logits = super()._decode_step(token, cache)
        ring.position += 1
        return logits


class LastPositionMLP(nn.Module):
    """An MLP applied to the last position only. In mlx-lm's Llama / Qwen3 blocks the residual
    add then broadcasts it over every position: only the last one is right, and only it is read."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x[:, -1:])


@contextmanager
def last_position_mlp(model: nn.Module) -> Iterator[None]:
    """Within: the model's last layer computes its MLP for the last position only."""
    layer = model.model.layers[-1]
    mlp = layer.mlp
    layer.mlp = LastPositionMLP(mlp)
    try:
        yield
    finally:
        layer.mlp = mlp


def logits_from_hidden(model: nn.Module, hidden: mx.array) -> mx.array:
    """The LM head of mlx-lm's Llama / Qwen3 applied to already-normalised hidden states."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)
