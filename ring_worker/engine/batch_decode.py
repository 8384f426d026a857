"""Continuous batching: several prefilled sequences decode together, one forward pass per step.

- Prefill stays per sequence (`Engine.prefill`): mlx-lm's batched prefill measured ~3x slower
  than prefilling one after another on an H200.
- A prefilled sequence joins at the next step: its K/V is copied into one row of a `BatchCache`
  (ring_worker/engine/batch_cache.py) and its first token is sampled from its prefill logits.
- One step is one forward pass of plain mlx-lm modules over all rows, per-row sampling, and one
  vote (`Engine._vote`): the sampling rank's tokens and every rank's stop flags in one collective.
  As in mlx-lm's generate_step, step t + 1 is queued before step t's vote is read, so the device
  never waits for Python; a row that finishes at t wastes one row-step.
- A row leaves as soon as its vote is read (stop token, max_tokens, or cancel) and the last row
  moves into its slot. Where half the slots or more stand free the buffers halve, since a
  compiled step runs every slot (on an H100, 2 rows stepped in 8.2 ms in 2 slots and 12.4 ms in
  32); when the last row leaves they are dropped.
- Every rank must add the same sequences in the same order; rows then stay identical on every
  rank, since leaving depends only on the agreed votes.
Layouts: single and ring with replicated KV. Sharded-KV ring and pipeline decode one sequence at
a time (`batch_decode_supported`)."""

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from ring_worker.engine.batch_cache import BatchCache
from ring_worker.engine.compiled_step import CompiledStep
from ring_worker.engine.engines import Engine, PrefillResult, ProgressFn, RingEngine, StopFn
from ring_worker.engine.fused_linears import fuse_layers
from ring_worker.engine.pipeline import PipelineEngine
from ring_worker.engine.rows_attention import install_rows_attention

CLEAR_CACHE_STEPS = 256
WARM_UP_LENGTHS = (8, 16, 24)  # warm_up's rows: three lengths, so its steps mix them
MEASURED_ROWS = (1, 2, 4, 8, 16, 32)  # row counts (in as many slots) warm_up measures
MEASURED_STEPS = 8  # timed steps per row count, after two untimed
LogitsHook = Callable[[list[str], mx.array], None]  # (row keys, (rows, vocab) float32 logits)
# the batch emptied: its cache and the slot each sequence that left last vacated, by key, before
# the buffers are dropped (what the hook keeps of them stays alive)
EmptiedHook = Callable[[BatchCache, dict[str, int]], None]


@dataclass(frozen=True)
class DecodeRequest:
    """One sequence to decode: its own settings and callbacks."""

    key: str
    max_tokens: int
    temperature: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    seed: int = 0
    on_progress: ProgressFn | None = None
    should_stop: StopFn | None = None  # asked on every rank, every step the sequence is in
    stop_when: Callable[[list[int]], bool] | None = None  # after each token (stop strings)


@dataclass(frozen=True)
class SequenceResult:
    """What decoding did for one sequence. `cancelled` holds the reason when it was cancelled
    (its tokens so far are kept). `batch_size` is the mean number of rows of its steps."""

    key: str
    tokens: list[int]
    seconds: float
    batch_size: float
    max_batch_size: int
    cancelled: str | None = None


@dataclass
class StepTimes:
    """Where one batch's host time went, in seconds on this rank (from its first row joining
    to its last leaving; BatchServer logs it)."""

    steps: int = 0
    queue_s: float = 0.0  # building each step's graph, with its rows' cancel polls
    wait_s: float = 0.0  # reading the previous step's vote: the device's compute, mostly
    rows_s: float = 0.0  # per-row host work on the tokens: progress, stop strings, text
    drop_s: float = 0.0  # freeing the rows that left

    def line(self) -> str:
        per_step = 1000 / max(self.steps, 1)
        parts = [("graph", self.queue_s), ("wait", self.wait_s), ("rows", self.rows_s),
                 ("drop", self.drop_s)]  # fmt: skip
        shown = ", ".join(f"{name} {s:.2f}s ({s * per_step:.1f} ms/step)" for name, s in parts)
        return f"{self.steps} steps: {shown}"


@dataclass
class _Sequence:
    request: DecodeRequest
    started_s: float
    key: mx.array
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    rows_seen: int = 0
    max_rows: int = 0


def batch_decode_supported(engine: Engine) -> bool:
    """Single and ring with replicated KV decode in batches; the other layouts one at a time."""
    if isinstance(engine, PipelineEngine):
        return False
    return not (isinstance(engine, RingEngine) and engine.ring.kv_layout == "sharded")


class BatchDecoder:
    """Steps every sequence it holds together. `add` between steps; `step` until not `busy`."""

    def __init__(
        self,
        engine: Engine,
        on_logits: LogitsHook | None = None,
        max_batch: int | None = None,
        compiled: bool | None = None,
        on_emptied: EmptiedHook | None = None,
    ):
        """`max_batch`, if known, reserves that many rows up front (growing the KV buffers later
        copies every row). `compiled`: steps of two or more rows run as compiled functions
        (ring_worker/engine/compiled_step.py); by default where the rows kernels run (CUDA)."""
        if not batch_decode_supported(engine):
            raise ValueError(f"{type(engine).__name__} with this KV layout cannot batch decode")
        self.engine = engine
        self.on_logits, self.on_emptied = on_logits, on_emptied
        self.fused_rows = install_rows_attention(engine.model)  # CUDA: mixed lengths unmasked
        if self.fused_rows:
            fuse_layers(
                engine.model
            )  # and fewer matmuls a step (ring_worker/engine/fused_linears.py)
        compiling = self.fused_rows if compiled is None else compiled
        self.compiled = CompiledStep(engine.model) if compiling else None
        self._slots = max_batch or 1
        self.cache = BatchCache(len(engine.model.layers), self._slots)
        self._rows: list[_Sequence] = []  # in cache row order
        self._steps = 0
        self._vote: mx.array | None = None  # (2, rows): pending tokens, stop votes (lazy)
        self.times = StepTimes()

    @property
    def busy(self) -> bool:
        return bool(self._rows)

    @property
    def members(self) -> list[str]:
        return [s.request.key for s in self._rows]

    def _compiled_for(self, rows: int) -> CompiledStep | None:
        """The compiled step a step of `rows` rows runs: two rows or more, where steps compile;
        None: one row steps through mlx-lm's own path (its gemv), as one at a time runs it."""
        return self.compiled if rows > 1 else None

    def add(self, request: DecodeRequest, prefill: PrefillResult, move: bool = False) -> None:
        """Join at the next step (call between steps, on every rank in the same order). The
        prefill's KV is copied into the batch now, or with `move` moved (`prefill.cache` left
        empty: BatchCache.add), and its first token is sampled from its logits."""
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if request.key in self.members:
            raise ValueError(f"sequence {request.key!r} is already in the batch")
        sequence = _Sequence(request, time.perf_counter(), mx.random.key(request.seed))
        self.cache.add(prefill.cache, request.max_tokens, move)
        vote = self._vote_rows([sequence], prefill.logits[None])
        self._rows.append(sequence)
        self._vote = vote if self._vote is None else mx.concatenate([self._vote, vote], axis=1)
        mx.async_eval(self._vote, self.cache.state())

    def run(self) -> list[SequenceResult]:
        """Step until every sequence has left; results in the order they left."""
        done: list[SequenceResult] = []
        while self.busy:
            done.extend(self.step())
        return done

    def step(self) -> list[SequenceResult]:
        """Queue one forward pass over all rows, read the previous step's tokens; returns the
        sequences that left."""
        if not self._rows:
            return []
        times, began = self.times, time.perf_counter()
        upcoming = self._queue_step()
        assert self._vote is not None
        queued = time.perf_counter()
        tokens, stops = cast(list[list[int]], self._vote.tolist())
        read = time.perf_counter()
        leaving = [
            row
            for row, sequence in enumerate(self._rows)
            if self._take(sequence, tokens[row], stops[row])
        ]
        results = [self._result(self._rows[row], stops[row]) for row in leaving]
        taken = time.perf_counter()
        self._vote = self._drop(leaving, upcoming)
        times.steps += 1
        times.queue_s += queued - began
        times.wait_s += read - queued
        times.rows_s += taken - read
        times.drop_s += time.perf_counter() - taken
        return results

    # -- one step --------------------------------------------------------------------------

    def _queue_step(self) -> mx.array:
        """The forward pass of every row on its pending token, and the step's vote (lazy)."""
        assert self._vote is not None
        compiled = self._compiled_for(len(self._rows))
        if compiled is not None:
            logits = compiled(self.cache, self._vote[0])
        else:
            inputs = self._vote[0][:, None]
            logits = self.engine.model(inputs, cache=self.cache.layers)[:, -1].astype(mx.float32)
        if self.on_logits is not None:
            self.on_logits([s.request.key for s in self._rows], logits)
        vote = self._vote_rows(self._rows, logits)
        self.cache.rows.advance()
        for sequence in self._rows:
            sequence.steps += 1
            sequence.rows_seen += len(self._rows)
            sequence.max_rows = max(sequence.max_rows, len(self._rows))
        mx.async_eval(vote)
        self._steps += 1
        if self._steps % CLEAR_CACHE_STEPS == 0:
            mx.clear_cache()  # as mlx-lm: shapes change every step, the buffer cache fills up
        return vote

    def _vote_rows(self, sequences: list[_Sequence], logits: mx.array) -> mx.array:
        """(2, rows) summed over ranks: the sampling rank's tokens (the others add 0) and every
        rank's stop flags."""
        engine = self.engine
        sampled = sample_rows(sequences, logits)
        if engine.rank != engine.last_rank:
            sampled = mx.zeros_like(sampled)
        flags = [int(s.request.should_stop()) if s.request.should_stop else 0 for s in sequences]
        vote = mx.stack([sampled, mx.array(flags, dtype=mx.int32)])
        if engine.group is None:
            return vote
        return mx.distributed.all_sum(vote, group=engine.group)

    def _take(self, sequence: _Sequence, token: int, stop: int) -> bool:
        """Record a row's token; whether the sequence leaves now."""
        request = sequence.request
        if stop:
            return True
        sequence.tokens.append(token)
        if request.on_progress:
            request.on_progress("decode", len(sequence.tokens), request.max_tokens)
        if token in request.stop_ids or len(sequence.tokens) >= request.max_tokens:
            return True
        return request.stop_when is not None and request.stop_when(sequence.tokens)

    def _result(self, sequence: _Sequence, stop: int) -> SequenceResult:
        steps = max(sequence.steps, 1)
        return SequenceResult(
            key=sequence.request.key,
            tokens=sequence.tokens,
            seconds=time.perf_counter() - sequence.started_s,
            batch_size=sequence.rows_seen / steps if sequence.steps else 1.0,
            max_batch_size=max(sequence.max_rows, 1),
            cancelled=f"stopped after {len(sequence.tokens)} generated tokens" if stop else None,
        )

    def _drop(self, leaving: list[int], vote: mx.array) -> mx.array | None:
        """Free the leaving rows (the last row moves into each) and reorder `vote` to match."""
        if not leaving:
            return vote
        order = list(range(len(self._rows)))
        slots = {self._rows[row].request.key: row for row in leaving}  # vacated if all leave
        for row in sorted(leaving, reverse=True):
            self.cache.remove(row)
            order[row] = order[-1]
            order.pop()
            self._rows[row] = self._rows[-1]
            self._rows.pop()
        if not self._rows:
            mx.eval(vote)  # the last row's wasted step lets go of the buffers it reads
            if self.on_emptied is not None:
                self.on_emptied(self.cache, slots)
            self._release()
            return None
        self._fit_slots()
        return mx.take(vote, mx.array(order), axis=1)

    def _fit_slots(self) -> None:
        """Rows left: where half the slots or more stand free, halve them (as often as that
        holds), never below those reserved up front."""
        fewer = self.cache.slots
        while fewer // 2 >= max(len(self._rows), self._slots):
            fewer //= 2
        if fewer < self.cache.slots:
            self.cache.shrink(fewer)

    def _release(self) -> None:
        """The batch is empty: drop its KV buffers (they outlive rows that come and go) and
        MLX's cache of freed buffers, so an idle group holds no more than its weights and what
        `on_emptied` kept."""
        self.cache = BatchCache(len(self.engine.model.layers), self._slots)
        mx.clear_cache()


def warm_up(engine: Engine, max_batch: int = max(MEASURED_ROWS)) -> dict[int, float]:
    """Run what a batch's steps run, then time them: rows of three lengths join, decode
    together and leave at different steps; then MEASURED_ROWS rows (those up to `max_batch`) of
    different lengths decode MEASURED_STEPS steps each, in as many slots. Returns seconds per
    step by row count (the medians, short rows), for the group's log. Without it, a fresh GPU
    process compiles its kernels (NVRTC, 1-4 s each) inside its first batch's steps."""
    decoder = BatchDecoder(engine)
    for row, length in enumerate(WARM_UP_LENGTHS):
        request = DecodeRequest(key=str(row), max_tokens=row + 2)
        decoder.add(request, engine.prefill([0] * length, length))
    decoder.run()
    return {rows: _time_steps(engine, rows) for rows in MEASURED_ROWS if rows <= max_batch}


def _time_steps(engine: Engine, rows: int) -> float:
    """Median seconds per step of `rows` rows of different lengths, stepped as a batch is."""
    lengths = [WARM_UP_LENGTHS[0] * (row + 1) for row in range(rows)]
    prefills = [engine.prefill([0] * length, length) for length in lengths]
    return time_steps(engine, prefills, rows, MEASURED_STEPS + 2)


def time_steps(
    engine: Engine, prefills: list[PrefillResult], slots: int, steps: int, untimed: int = 1
) -> float:
    """Median seconds between step ends of `prefills` decoding together, as a batch steps, in
    buffers of `slots` slots (the gaps before the `untimed`-th step's end left out)."""
    decoder = BatchDecoder(engine, max_batch=slots)
    for row, prefill in enumerate(prefills):
        decoder.add(DecodeRequest(str(row), steps + 1), prefill)
    ends = []
    for _ in range(steps):
        decoder.step()
        ends.append(time.perf_counter())
    decoder.run()
    return statistics.median(b - a for a, b in itertools.pairwise(ends[untimed:]))


def sample_rows(sequences: list[_Sequence], logits: mx.array) -> mx.array:
    """One token per row: greedy where the temperature is 0, else a draw from the row's own
    PRNG key (split once per draw) at its own temperature."""
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    temperatures = [s.request.temperature for s in sequences]
    if not any(temperatures):
        return greedy
    drawn = []
    for row, sequence in enumerate(sequences):
        if not sequence.request.temperature:
            drawn.append(greedy[row])
            continue
        sequence.key, key = mx.random.split(sequence.key)
        scaled = logits[row] * (1 / sequence.request.temperature)
        drawn.append(mx.random.categorical(scaled, key=key).astype(mx.int32))
    return mx.stack(drawn)
