"""A rank process: the process entry, and one job's path through the engine (prefill, decode,
result), reporting through a JobIO. ring_worker/serve_loop.py loads the group and feeds it jobs
(one at a time, or batched: ring_worker/batch_serve.py).

This is the bridge from a job to the engine. Started fresh (`python -m ring_worker.rank_main`) by
a node agent or by `ringq run`; never forked from a process that has MLX initialised."""

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx

from jobs.errors import RingqError
from jobs.lifecycle import JobState
from jobs.schemas import GroupSpec, JobKind, JobResult, JobSpec
from jobs.settings import Settings
from jobs.tokenizer import ChatTokenizer
from ring_worker.checkpoint import end_checkpoints, start_checkpoints
from ring_worker.engine import Cancelled, DecodeResult, Engine, PrefillResult, ProgressFn
from ring_worker.job_io import FileJobIO, JobIO, RedisJobIO
from ring_worker.job_prefix import keep_after, memory_room, starting_point
from ring_worker.job_report import enter, job_result, kicking, throttled
from ring_worker.prefix_reuse import RankPrefixCache, Reuse, describe_source
from ring_worker.processes import exit_with_parent
from ring_worker.text_stream import DecodeText
from ring_worker.watchdog import Watchdog, loading_timeout_s

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
    report = kicking(watchdog, throttled(io, ctx.lead))
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
    """The job's prefill, checkpointed every RINGQ_CHECKPOINT_TOKENS (ring_worker/checkpoint.py)
    and continued from an earlier attempt's checkpoint when every rank holds one. A finished or
    cancelled prefill deletes this rank's part; a failed one keeps it for the retry."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ring_worker.rank_main")
    parser.add_argument("--group", type=Path, required=True, help="GroupSpec JSON file")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--redis-url", help="job in Redis (the service)")
    parser.add_argument("--job-file", type=Path, help="job JSON file (`ringq run`)")
    parser.add_argument("--events-file", type=Path, help="where `ringq run` reads events")
    parser.add_argument(
        "--standby",
        action="store_true",
        help="a node agent's spare rank: import and initialise the device now, then take the "
        "rank's arguments from stdin",
    )
    parser.add_argument("--from-standby", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    if "--standby" in argv:
        handed = await_handover()
        return 0 if handed is None else main(handed)
    args = parser.parse_args(argv)
    group = GroupSpec.model_validate_json(args.group.read_text())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s job={group.job_id} rank={args.rank} %(message)s",
        force=True,  # a spare rank logged before it knew its job
    )
    if args.from_standby:
        log.info("job %s rank %d: a spare rank took it", group.job_id, args.rank)
    settings = Settings()  # read once, at the process edge, and passed down
    if not args.from_standby:  # a spare rank watches its agent from the start
        exit_with_parent(settings.parent_pid)
    ctx = RankContext(group, args.rank, args.group.parent, settings)
    return run_guarded(ctx, make_io(args, ctx))


def await_handover() -> list[str] | None:
    """A spare rank: the imports (12 s of a cold rank's start on an H200 machine, mostly
    mlx-lm importing transformers) and the device's initialisation happen before any job needs
    them. Then one JSON line {argv, log} on stdin makes this the rank; EOF: exit."""
    exit_with_parent(Settings().parent_pid)
    mx.eval(mx.zeros((1,)))  # creates the device context (CUDA) now
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log.info("spare rank ready (pid %d)", os.getpid())
    line = sys.stdin.readline()
    if not line.strip():
        return None
    message = json.loads(line)
    log_fd = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return [*map(str, message["argv"]), "--from-standby"]


def run_guarded(ctx: RankContext, io: JobIO) -> int:
    """The process edge: a watchdog over the whole run; cancel exits 0 on every rank (rank 0
    records it); any other error is recorded on the job and exits 1."""
    group, rank = ctx.group, ctx.rank
    where = f"rank {rank} ({group.nodes[rank]})"
    stall_timeout_s = ctx.settings.stall_timeout_s
    watchdog = Watchdog(
        group.job_id, rank, stall_timeout_s, on_stall=lambda reason: io.fail(f"{where}: {reason}")
    ).start("loading", loading_timeout_s(stall_timeout_s))
    from ring_worker.serve_loop import serve  # it builds on the per-job path above

    try:
        serve(ctx, io, watchdog)
    except Cancelled as exc:  # before the model was loaded
        log.info("job %s rank %d: cancelled, %s", group.job_id, rank, exc)
        if rank == 0:
            io.cancelled(f"cancelled: {exc}")
    except RingqError as exc:  # the job or its model is unusable: another placement won't help
        log.exception("job %s rank %d failed", group.job_id, rank)
        io.fail(f"{where}: {exc}", retry=False)
        return 1
    except Exception as exc:  # process edge: record why, then exit non-zero
        log.exception("job %s rank %d failed", group.job_id, rank)
        io.fail(f"{where}: {type(exc).__name__}: {exc}")
        return 1
    finally:
        watchdog.stop()
    return 0


def make_io(args: argparse.Namespace, ctx: RankContext) -> JobIO:
    if args.redis_url:
        from jobs.redis_server import SERVICE_RIDE_OUT_S, connect
        from jobs.store import JobStore

        conn = connect(args.redis_url, ride_out_s=SERVICE_RIDE_OUT_S)
        store = JobStore(conn, ctx.settings.job_ttl_s)
        return RedisJobIO(store, ctx.group.job_id, ctx.group.group_id)
    return FileJobIO(args.job_file, args.events_file)


if __name__ == "__main__":
    sys.exit(main())
