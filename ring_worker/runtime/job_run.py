"""One job's path through the engine on one rank: prefill (from a kept prefix or a checkpoint
where one matches), decode, result, reported through a JobIO. ring_worker/runtime/serve_loop.py
loads the group and feeds it jobs, one at a time (`run_job`) or batched
(ring_worker/runtime/batch_serve.py)."""

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx

from jobs.lifecycle import JobState
from jobs.schemas import GroupSpec, JobKind, JobResult, JobSpec
from jobs.settings import Settings
from jobs.tokenizer import ChatTokenizer
from ring_worker.engine.checkpoint import end_checkpoints, start_checkpoints
from ring_worker.engine.engines import (
    Cancelled,
    DecodeResult,
    Engine,
    PrefillResult,
    ProgressFn,
    model_prefill_flops,
)
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.job_prefix import keep_after, memory_room, starting_point
from ring_worker.runtime.job_report import enter, job_result, kicking, throttled
from ring_worker.runtime.prefix_reuse import RankPrefixCache, Reuse, describe_source
from ring_worker.runtime.text_stream import DecodeText
from ring_worker.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankContext:
    """What a rank was started with: its group's plan, its rank, its scratch dir and settings."""

    group: GroupSpec
    rank: int
    scratch_dir: Path
    settings: Settings

    @property
    def lead(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Prefilled:
    """A job whose prompt is in the KV cache: what its result and kept prefix need."""

    spec: JobSpec
    tokens: list[int]
    prefill: PrefillResult
    start: Reuse | None  # the kept prefix it continued, if any
    started_at: float  # unix s, as the prefill began
    report: ProgressFn  # the job's progress callback (watchdog kick, throttled report)
    automatic: bool  # automatic prefix reuse is on


def run_job(
    engine: Engine,
    tokenizer: ChatTokenizer,
    ctx: RankContext,
    io: JobIO,
    watchdog: Watchdog,
    load_s: float,
    prefix: RankPrefixCache | None = None,
) -> None:
    """One job alone on the group: prefill, then (generate) decode, then the result."""
    mx.reset_peak_memory()  # this job's peak: not the warm-up's, nor an earlier job's
    job = prefill_job(engine, ctx, io, watchdog, prefix)
    spec = job.spec
    decoded = DecodeResult([], 0.0)
    if spec.kind == JobKind.GENERATE:
        enter(io, ctx.lead, watchdog, JobState.DECODE, len(job.tokens))
        # stop strings; the lead streams the text
        text = DecodeText(io, tokenizer, spec.stop, ctx.lead)
        decoded = engine.decode(
            job.prefill,
            spec.max_tokens,
            temperature=spec.temperature,
            stop_ids=tokenizer.eos_token_ids,
            seed=spec.seed or 0,
            on_progress=job.report,
            should_stop=io.should_stop,
            stop_when=text.stop_when,
        )
        text.close(decoded.tokens)
    watchdog.kick("finishing")
    peaks = engine.gather_ints(mx.get_peak_memory())
    if spec.keep_cache:  # a pinned cache is ready when its job is: --cache-from may follow at once
        keep_prefix(engine, prefix, io, job)
    if ctx.lead:
        io.finish(finished_result(tokenizer, job, load_s, decoded, peaks))
    if not spec.keep_cache:  # after the result: its KV is kept while the user reads it
        keep_prefix(engine, prefix, io, job)
    log.info("job %s rank %d: done", io.job_id, ctx.rank)


def prefill_job(
    engine: Engine,
    ctx: RankContext,
    io: JobIO,
    watchdog: Watchdog,
    prefix: RankPrefixCache | None,
) -> Prefilled:
    """The job's prompt into a KV cache (from a kept prefix where one matches), on every rank."""
    spec, tokens = io.spec(), io.tokens()
    automatic = ctx.settings.prefix_cache == "on"
    start = starting_point(prefix, engine, spec, tokens, automatic, memory_room(io))
    cache, reused = (start.cache, start.tokens) if start is not None else (None, 0)
    cost = partial(model_prefill_flops, engine.model.args)
    report = kicking(watchdog, throttled(io, ctx.lead, cost=cost))
    enter(io, ctx.lead, watchdog, JobState.PREFILL, len(tokens) - reused)
    started_at = time.time()
    prefill = checkpointed_prefill(engine, ctx, io, tokens, report, cache, reused)
    return Prefilled(spec, tokens, prefill, start, started_at, report, automatic)


def keep_prefix(engine: Engine, prefix: RankPrefixCache | None, io: JobIO, job: Prefilled) -> None:
    keep_after(
        prefix, engine, io.job_id, job.spec, job.tokens, job.prefill, job.start, job.automatic
    )


def finished_result(
    tokenizer: ChatTokenizer,
    job: Prefilled,
    load_s: float,
    decoded: DecodeResult,
    peaks: list[int],
    batch_size: int = 1,
) -> JobResult:
    result = job_result(job.spec, tokenizer, len(job.tokens), load_s, job.prefill, decoded, peaks)
    extra = {
        "prefill_started_at": job.started_at,
        "cached_tokens": job.start.tokens if job.start is not None else 0,
        "cache_source": describe_source(job.start),
        "batch_size": batch_size,
    }
    return result.model_copy(update=extra)


def checkpointed_prefill(
    engine: Engine,
    ctx: RankContext,
    io: JobIO,
    tokens: list[int],
    report: ProgressFn,
    cache: list | None,
    reused: int,
) -> PrefillResult:
    """The job's prefill, checkpointed every RINGQ_CHECKPOINT_TOKENS and continued from an
    earlier attempt's checkpoint when every rank holds one. A finished or cancelled prefill
    deletes this rank's part; a failed one keeps it for the retry."""
    saver, resume = None, None
    if cache is None:
        group = ctx.group
        saver, resume = start_checkpoints(
            ctx.settings.home,
            ctx.settings.checkpoint_tokens,
            ctx.settings.checkpoint_budget_bytes,
            io.job_id,
            f"{group.strategy}-{group.kv_layout}-{len(group.nodes)}",
            ctx.rank,
            engine.gather_ints,
            io.chunk_tokens(),
            len(tokens),
            on_change=partial(io.checkpointed, group, ctx.rank),
            node=group.nodes[ctx.rank],
            after_s=ctx.settings.checkpoint_after_s,
        )
    try:
        prefill = engine.prefill(
            tokens[reused:],
            io.chunk_tokens(),
            on_progress=report,
            should_stop=io.should_stop,
            cache=cache,
            checkpoints=saver,
            resume=resume,
        )
    except BaseException as exc:
        end_checkpoints(saver, keep=not isinstance(exc, Cancelled))
        raise
    end_checkpoints(saver, keep=False)
    return prefill
