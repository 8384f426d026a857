"""Continuous batching in a warm group: the serve loop of a group whose layout decodes in batches
(single; ring with replicated KV) when RINGQ_MAX_BATCH > 1.

- Each job is prefilled alone (`prefill_job`), then joins the `BatchDecoder` at the next step;
  a prefill job runs whole (`run_job`).
- Between two decode steps every rank takes the jobs handed to the busy group (`JobIO.joined`:
  rank 0 pops them, one collective tells the others how many) and the ranks vote, one collective
  per job, that each is placed on this group.
- A sequence that leaves has its result written at once; its bytes come off the group's
  reservation (`batch_ended`).
- With nothing to decode and nothing handed over, the group waits for its next job as a warm
  group does (`next_job`), and retires when idle.

Every rank runs this loop in the same order on the same agreed words and votes, so every rank
adds and drops the same rows at the same steps. An error other than a job's own cancel ends the
group: the reconciler retries every job of its batch (jobs/recovery.py)."""

import cProfile
import io as text_io
import logging
import math
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from admission.estimate import batch_buffer_tokens
from jobs.lifecycle import JobState
from jobs.prefix_cache import exact_reuse_tokens
from jobs.schemas import JobKind
from jobs.tokenizer import ChatTokenizer
from ring_worker.engine.batch_cache import BatchCache
from ring_worker.engine.batch_decode import (
    BatchDecoder,
    DecodeRequest,
    SequenceResult,
    StepTimes,
)
from ring_worker.engine.decode_text import partial_result
from ring_worker.engine.engines import Cancelled, DecodeResult, Engine, ProgressFn
from ring_worker.engine.memory_tier import pinned_bytes
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.job_prefix import memory_room
from ring_worker.runtime.job_report import (
    PROGRESS_INTERVAL_S,
    ReportClock,
    enter,
    kicking,
    throttled,
)
from ring_worker.runtime.job_run import (
    Prefilled,
    RankContext,
    finished_result,
    keep_prefix,
    prefill_job,
    run_job,
)
from ring_worker.runtime.prefix_reuse import InMemory, RankPrefixCache
from ring_worker.runtime.text_stream import DecodeText
from ring_worker.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)
NextJob = Callable[[JobIO], JobIO | None]  # the warm group's wait for its next job


@dataclass(frozen=True)
class _Member:
    """A job decoding in the batch: what its result needs (its prefill without the KV)."""

    io: JobIO
    job: Prefilled
    load_s: float
    text: DecodeText  # its stop strings, and (lead rank) its text streamed as it decodes
    clock: ReportClock  # its decode progress's throttle
    began: float  # perf_counter when it began to join (its prefill and records)


def pace(rows: int) -> float:
    """How much less often a member of a batch of `rows` streams its text and reports its
    progress than a job decoding alone: sqrt(rows). At the fixed cadence a 32-row step on the
    CPU spent 44 % of its time streaming text and reporting progress."""
    return max(1.0, math.sqrt(rows))


class BatchServer:
    def __init__(
        self,
        ctx: RankContext,
        engine: Engine,
        tokenizer: ChatTokenizer,
        watchdog: Watchdog,
        prefix: RankPrefixCache | None,
        max_batch: int,
    ):
        self.ctx, self.engine, self.tokenizer = ctx, engine, tokenizer
        self.watchdog, self.prefix, self.max_batch = watchdog, prefix, max_batch
        # rows grow as jobs join (doubling), not reserved for max_batch up front: the group's
        # reservation grows by each joining job's KV, not by max_batch rows (32 on CUDA)
        self.decoder = BatchDecoder(
            engine, on_emptied=self.keep_last_row if prefix is not None else None
        )
        self.first_row = 0  # columns of the row of the job that began the batch, as admitted
        self.members: dict[str, _Member] = {}
        self.joins = JoinTimes()
        self.profile: cProfile.Profile | None = None
        if prefix is not None:  # a joiner may start from a member's row (its document's KV)
            prefix.rows = self.row_prefix

    def run(self, first: JobIO, load_s: float, next_job: NextJob) -> None:
        """Serve `first`, every job that joins while the group decodes, and the warm group's
        next jobs, until it retires."""
        pending, last = [first], first
        while True:
            for io in pending:
                self.start(io, load_s)
                load_s, last = 0.0, io
            if self.decoder.busy:
                self.step()
                pending = self.take_joined(last)
                continue
            following = next_job(last)
            if following is None:
                return
            pending = [following]

    def start(self, io: JobIO, load_s: float) -> None:
        """Prefill the job alone; a generate job then joins the batch at the next step."""
        if self.profile is None and self.ctx.lead and self.ctx.settings.batch_profile_dir:
            self.profile = cProfile.Profile()
            self.profile.enable()
        began = time.perf_counter()
        try:
            self.join(io, load_s)
        finally:
            self.joins.count += 1
            self.joins.total_s += time.perf_counter() - began

    def join(self, io: JobIO, load_s: float) -> None:
        lead, group, began = self.ctx.lead, self.ctx.group, time.perf_counter()
        if lead:
            io.batch_started(group)
        try:
            if io.spec().kind != JobKind.GENERATE:
                run_job(
                    self.engine, self.tokenizer, self.ctx, io, self.watchdog, load_s, self.prefix
                )
                self.leave(io)
                return
            prefill_began = time.perf_counter()
            job = prefill_job(self.engine, self.ctx, io, self.watchdog, self.prefix)
            prefill_s = time.perf_counter() - prefill_began
            self.joins.prefill_s += prefill_s
        except Cancelled as exc:  # every rank stops this job's prefill together
            log.info("job %s rank %d: cancelled, %s", io.job_id, self.ctx.rank, exc)
            if lead:
                io.cancelled(f"cancelled: {exc}")
            self.leave(io)
            return
        enter(io, lead, self.watchdog, JobState.DECODE, len(job.tokens))
        text, clock = DecodeText(io, self.tokenizer, job.spec.stop, lead), ReportClock()
        report = kicking(self.watchdog, throttled(io, lead, clock))
        if not self.decoder.busy:
            self.first_row = batch_buffer_tokens(len(job.tokens) + job.spec.max_tokens, 0)
        keep_beside_batch(self.engine, self.prefix, io, job)
        self.decoder.add(self.request(io, job, text, report), job.prefill, move=True)
        self.members[io.job_id] = _Member(io, without_kv(job), load_s, text, clock, began)
        self.pace_members()

    def row_prefix(self, tokens: list[int], at_least: int) -> InMemory | None:
        """A question joining the batch of its document's first question starts from that
        member's row (`member_row_prefix`)."""
        known = {key: member.job.tokens for key, member in self.members.items()}
        prompts = [(key, known.get(key, [])) for key in self.decoder.members]  # in row order
        return member_row_prefix(self.decoder.cache, prompts, tokens, at_least)

    def keep_last_row(self, cache: BatchCache, vacated: dict[str, int]) -> None:
        """The batch emptied: the memory tier keeps a prompt of the jobs that left last
        (`last_row_memory`)."""
        assert self.prefix is not None
        prompts = {key: self.members[key].job.tokens for key in vacated if key in self.members}
        held = last_row_memory(cache, vacated, prompts, self.first_row)
        if held is not None:
            self.prefix.hold(held)

    def request(
        self, io: JobIO, job: Prefilled, text: DecodeText, report: ProgressFn
    ) -> DecodeRequest:
        spec = job.spec
        return DecodeRequest(
            key=io.job_id,
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            stop_ids=frozenset(self.tokenizer.eos_token_ids),
            seed=spec.seed or 0,
            on_progress=report,
            should_stop=io.should_stop,
            stop_when=text.stop_when,
        )

    def pace_members(self) -> None:
        factor = pace(len(self.members))
        for member in self.members.values():
            member.text.pace(factor)
            member.clock.interval_s = PROGRESS_INTERVAL_S * factor

    def step(self) -> None:
        """One decode step, then the results of the sequences that left the batch."""
        results = self.decoder.step()
        ended = time.perf_counter()
        for result in results:
            self.finish(result)
        self.joins.results_s += time.perf_counter() - ended
        if results:
            self.pace_members()
        if not self.decoder.busy:  # the batch is over: where its time went
            log.info("group %s rank %d: batch of %s; %s", self.ctx.group.group_id,
                     self.ctx.rank, self.joins.line(), self.decoder.times.line())  # fmt: skip
            self.decoder.times, self.joins = StepTimes(), JoinTimes()
            self.write_profile()

    def write_profile(self) -> None:
        """RINGQ_BATCH_PROFILE_DIR: the batch's 40 costliest functions (cumulative time)."""
        profile, folder = self.profile, self.ctx.settings.batch_profile_dir
        if profile is None or folder is None:
            return
        profile.disable()
        self.profile = None
        found = text_io.StringIO()
        pstats.Stats(profile, stream=found).sort_stats("cumulative").print_stats(40)
        name = f"batch-{self.ctx.group.group_id}-{time.time_ns()}.txt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(found.getvalue())
        except OSError as exc:  # diagnostics: never the batch's end
            log.warning("cannot write the batch profile %s: %s", folder / name, exc)

    def finish(self, result: SequenceResult) -> None:
        """A sequence left the batch: its result (or its cancel, with what it generated)."""
        member = self.members.pop(result.key)
        io, job = member.io, member.job
        self.watchdog.kick("finishing")
        peaks = self.engine.gather_ints(mx.get_peak_memory())  # every rank, same order
        if self.ctx.lead and result.cancelled is not None:
            prompt_tokens, stops = len(job.tokens), job.spec.stop
            partial = partial_result(self.tokenizer, result.tokens, prompt_tokens, stops)
            io.cancelled(f"cancelled: {result.cancelled}", partial)
        elif self.ctx.lead:
            member.text.close(result.tokens)  # the rest of its streamed text
            decoded = DecodeResult(result.tokens, result.seconds)
            batch_size = result.max_batch_size
            io.finish(
                finished_result(self.tokenizer, job, member.load_s, decoded, peaks, batch_size)
            )
        self.leave(io)
        what = "cancelled" if result.cancelled else "done"
        log.info("job %s rank %d: %s", io.job_id, self.ctx.rank, what)

    def leave(self, io: JobIO) -> None:
        if self.ctx.lead:
            io.batch_ended(self.ctx.group)

    def take_joined(self, last: JobIO) -> list[JobIO]:
        """The jobs handed to the group since the last step that every rank finds placed on
        it (the others are skipped by all)."""
        if len(self.members) >= self.max_batch:
            return []  # full: the dispatcher hands over nothing more (same count on every rank)
        began = time.perf_counter()
        try:
            return self.agreed_joins(last)
        finally:
            self.joins.handoff_s += time.perf_counter() - began

    def agreed_joins(self, last: JobIO) -> list[JobIO]:
        """The hand-off itself: every rank takes rank 0's count, then votes on each job."""
        ctx = self.ctx
        joined = last.joined(ctx.group, ctx.rank, lambda count: self.engine.gather_ints(count)[0])
        ready = []
        for io in joined:
            self.watchdog.kick("joining")
            if all(self.engine.gather_ints(int(io.await_placement()))):
                if ctx.lead:
                    io.enter(JobState.LOADING, len(io.tokens()))  # already loaded: straight on
                ready.append(io)
                continue
            log.info("group %s rank %d: job %s is not ours, skipped", ctx.group.group_id,
                     ctx.rank, io.job_id)  # fmt: skip
            self.leave(io)
        return ready


@dataclass
class JoinTimes:
    """One batch's jobs joining and leaving, in seconds on this rank: `start` (prefill, records,
    the copy into its row, keeping its KV), `take_joined` (the hand-off between steps) and
    `finish` (the results of the jobs that left)."""

    count: int = 0
    total_s: float = 0.0
    prefill_s: float = 0.0
    handoff_s: float = 0.0
    results_s: float = 0.0

    def line(self) -> str:
        rest = self.total_s - self.prefill_s
        return (f"{self.count} jobs: prefill {self.prefill_s:.2f}s, joining {rest:.2f}s, "
                f"hand-off {self.handoff_s:.2f}s, "
                f"results {self.results_s:.2f}s")  # fmt: skip


def member_row_prefix(
    cache: BatchCache, prompts: list[tuple[str, list[int]]], tokens: list[int], at_least: int = 1
) -> InMemory | None:
    """The batch row (`prompts`: each row's job and prompt, in row order) whose prompt starts
    most like `tokens`, sharing at least `at_least` tokens, as a copy of the shared part's KV,
    for a joiner to continue without reading a file or recomputing. The same on every rank."""
    shared, best = max(at_least, 1) - 1, None
    for row, (key, prompt) in enumerate(prompts):
        common = exact_reuse_tokens(prompt, tokens)
        if common > shared:
            shared, best = common, (row, key, prompt)
    if best is None:
        return None
    row, key, prompt = best
    layers = cache.row_prefix(row, shared)
    return InMemory(key, prompt[:shared], layers, [(0, shared)], source="batch row")


def last_row_memory(
    cache: BatchCache, vacated: dict[str, int], prompts: dict[str, list[int]], first_row: int
) -> InMemory | None:
    """What the memory tier keeps as a batch empties: the longest prompt of the jobs that left
    last (`vacated`: their slots; `prompts`: theirs), for the next job on its document. Only a
    prompt no longer than `first_row`, the row of the job that began the batch: the group's
    reservation keeps that row when the batch's growth is given back. A one-slot buffer keeps
    its row as a view; else the prompt's part is copied and the buffer freed."""
    fits = {key: p for key, p in prompts.items() if key in vacated and 1 < len(p) <= first_row}
    if not fits:
        return None
    key = max(fits, key=lambda k: len(fits[k]))
    tokens, view = fits[key], cache.slots == 1 and cache.capacity <= first_row
    layers = cache.row_prefix(vacated[key], len(tokens), view=view)
    held = pinned_bytes(cache.layers, layers, view)
    return InMemory(key, list(tokens), layers, [(0, len(tokens))], held)


def without_kv(job: Prefilled) -> Prefilled:
    """What a batch member keeps of its prefill while it decodes: its result's figures, not
    its KV (the batch's row holds a copy), nor the kept prefix it started from, which the
    prefill extended (kept, a 128K question on the 8B held 16 GiB per member)."""
    start = replace(job.start, cache=[]) if job.start is not None else None
    prefill = replace(job.prefill, cache=[], logits=mx.zeros((1,)))
    return replace(job, prefill=prefill, start=start)


def keep_beside_batch(
    engine: Engine, prefix: RankPrefixCache | None, io: JobIO, job: Prefilled
) -> None:
    """Keep the prompt's KV as after any job, before it moves into the batch's row. The
    memory copy stays only within the room beside this job's own estimate
    (ring_worker/engine/memory_tier.py); a joined job has no room, so its copy leaves at once
    and the move frees the prompt's buffers layer by layer."""
    keep_prefix(engine, prefix, io, job)
    if prefix is not None:
        prefix.bound_memory(memory_room(io))
