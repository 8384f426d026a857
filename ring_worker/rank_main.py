"""A rank process: join the group, load the model, run the group's job, report through a JobIO.

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
from typing import Any

import mlx.core as mx

from jobs.errors import ModelLoadError, RingqError
from jobs.lifecycle import JobState
from jobs.model_catalog import resolve_model
from jobs.schemas import GroupSpec, JobKind, JobResult, JobSpec, Progress
from jobs.settings import Settings
from jobs.tokenizer import ChatTokenizer, load_tokenizer
from ring_worker.checkpoint import end_checkpoints, start_checkpoints
from ring_worker.decode_text import cut_at_stop, partial_result
from ring_worker.devices import cap_device_memory
from ring_worker.engine import Cancelled, DecodeResult, Engine, PrefillResult, ProgressFn
from ring_worker.group import join_group
from ring_worker.job_io import FileJobIO, JobIO, RedisJobIO
from ring_worker.job_prefix import keep_after, open_prefix_cache, starting_point
from ring_worker.models import load_for_this_device
from ring_worker.pipeline import keep_stage
from ring_worker.prefix_reuse import RankPrefixCache, describe_source
from ring_worker.processes import exit_with_parent
from ring_worker.strategies import make_engine
from ring_worker.text_stream import DecodeText
from ring_worker.watchdog import Watchdog, loading_timeout_s

log = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 0.25
IDLE_GRACE_S = 60.0  # a warm group's ranks wait this much longer than its idle time


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


def serve(ctx: RankContext, io: JobIO, watchdog: Watchdog) -> None:
    """Load once and run the group's job; a warm group (group.idle_s > 0) then runs the jobs the
    dispatcher gives it, until it has been idle that long."""
    started = time.perf_counter()
    if ctx.lead:
        io.enter(JobState.LOADING, len(io.tokens()))
    engine, tokenizer = start_engine(ctx, io)
    prefix = open_prefix_cache(ctx.settings, ctx.group, ctx.rank, engine, io)
    load_s = time.perf_counter() - started
    log.info("job %s rank %d: loaded %s in %.1fs", io.job_id, ctx.rank, ctx.group.model, load_s)
    job: JobIO | None = io
    while job is not None:
        try:
            run_job(engine, tokenizer, ctx, job, watchdog, load_s, prefix)
        except Cancelled as exc:  # every rank stops this job together; the group lives on
            log.info("job %s rank %d: cancelled, %s", job.job_id, ctx.rank, exc)
            if ctx.lead:
                spec = job.spec()
                partial = partial_result(tokenizer, exc.tokens, len(job.tokens()), spec.stop)
                job.cancelled(f"cancelled: {exc}", partial)
        load_s = 0.0
        job = next_job(ctx, engine, job, watchdog)


def run_job(
    engine: Engine,
    tokenizer: ChatTokenizer,
    ctx: RankContext,
    io: JobIO,
    watchdog: Watchdog,
    load_s: float,
    prefix: RankPrefixCache | None = None,
) -> None:
    lead = ctx.lead
    spec, tokens = io.spec(), io.tokens()
    automatic = ctx.settings.prefix_cache == "on"
    start = starting_point(prefix, engine, spec, tokens, automatic)
    cache, reused = (start.cache, start.tokens) if start is not None else (None, 0)
    report = kicking(watchdog, throttled(io, lead))
    mx.reset_peak_memory()  # this job's peak: not the warm-up's, nor an earlier job's
    enter(io, lead, watchdog, JobState.PREFILL, len(tokens) - reused)
    prefill_started_at = time.time()
    prefill = checkpointed_prefill(engine, ctx, io, tokens, report, cache, reused)
    decoded = DecodeResult([], 0.0)
    if spec.kind == JobKind.GENERATE:
        enter(io, lead, watchdog, JobState.DECODE, len(tokens))
        text = DecodeText(io, tokenizer, spec.stop, lead)  # stop strings; the lead streams text
        decoded = engine.decode(
            prefill,
            spec.max_tokens,
            temperature=spec.temperature,
            stop_ids=tokenizer.eos_token_ids,
            seed=spec.seed or 0,
            on_progress=report,
            should_stop=io.should_stop,
            stop_when=text.stop_when,
        )
        text.close(decoded.tokens)
    watchdog.kick("finishing")
    peaks = engine.gather_ints(mx.get_peak_memory())
    if spec.keep_cache:  # a pinned cache is ready when its job is: --cache-from may follow at once
        keep_after(prefix, engine, io.job_id, spec, tokens, prefill, start, automatic)
    if lead:
        result = job_result(spec, tokenizer, len(tokens), load_s, prefill, decoded, peaks)
        extra = {"prefill_started_at": prefill_started_at, "cached_tokens": reused,
                 "cache_source": describe_source(start)}  # fmt: skip
        io.finish(result.model_copy(update=extra))
    if not spec.keep_cache:  # after the result: its KV is kept while the user reads it
        keep_after(prefix, engine, io.job_id, spec, tokens, prefill, start, automatic)
    log.info("job %s rank %d: done", io.job_id, ctx.rank)


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


def next_job(ctx: RankContext, engine: Engine, io: JobIO, watchdog: Watchdog) -> JobIO | None:
    """A warm group's next job: every rank waits in Redis for the dispatcher's word and all get
    the same. The dispatcher hands a job over before it records the placement, so every rank
    waits for that record, and the ranks agree to skip a job that never became theirs (it was
    cancelled meanwhile). None: the group retires."""
    group = ctx.group
    if group.idle_s <= 0:
        return None
    while True:
        watchdog.kick("idle", group.idle_s + IDLE_GRACE_S)
        job = io.next_job(group, ctx.rank, watchdog.kick)
        if job is None:
            log.info("group %s rank %d: idle, retiring", group.group_id, ctx.rank)
            return None
        votes = engine.gather_ints(int(job.await_placement()))
        if all(votes):
            if ctx.lead:
                job.enter(JobState.LOADING, len(job.tokens()))  # already loaded: straight on
            return job
        log.info(
            "group %s rank %d: job %s is not ours, skipped", group.group_id, ctx.rank, job.job_id
        )
        io = job


def start_engine(ctx: RankContext, io: JobIO) -> tuple[Engine, ChatTokenizer]:
    """Join the group and load the model as its plan says; ranks of a job cancelled meanwhile
    stop together."""
    group, rank = ctx.group, ctx.rank
    on_cpu = rank < len(group.devices) and group.devices[rank] == "cpu"
    if on_cpu:  # the plan puts this rank on CPU, GPU or not (admission.group_plan)
        mx.set_default_device(mx.cpu)
    else:
        cap_device_memory(ctx.settings.rank_memory_limit_bytes)
    mx_group = join_group(group.addresses, rank, ctx.scratch_dir, group.transport)
    stop_if_cancelled(mx_group, io, "before loading the model")
    source = resolve_model(group.model)
    prune = None
    if group.strategy == "pipeline" and group.ranks > 1:
        prune = partial(keep_stage, rank=rank, size=group.ranks)
    try:
        planned_cpu = on_cpu if group.devices else None  # a plan without devices: look
        model = load_for_this_device(source, prune, group.compute_dtype, cpu=planned_cpu)
    except (OSError, ValueError, RuntimeError) as exc:  # a new placement would fail the same way
        raise ModelLoadError(f"cannot load model {group.model}: {exc}") from exc
    tokenizer = load_tokenizer(source)  # every rank: all must stop on the same EOS
    stop_if_cancelled(mx_group, io, "after loading the model")
    engine = make_engine(model, mx_group, group.strategy, group.exchange, group.kv_layout)
    warm_up(engine, io.chunk_tokens(), ctx)
    return engine, tokenizer


def warm_up(engine: Engine, chunk_tokens: int, ctx: RankContext) -> None:
    """On GPUs, run the kernels the group's jobs will need once while loading: a prefill of two
    chunks (the first chunk's shapes and one with a past) and two decode steps, on token 0. The
    first job then starts with compiled kernels, graphs and NCCL set up (cold vs warm in
    bench/results/h200-service/). CPU kernels need no warm-up."""
    if not ctx.settings.warm_up or mx.default_device().type != mx.gpu:
        return
    started = time.perf_counter()
    prefill = engine.prefill([0] * (2 * chunk_tokens), chunk_tokens)
    engine.decode(prefill, 2)
    mx.clear_cache()
    log.info(
        "job %s rank %d: warmed up (%d-token chunks) in %.1fs",
        ctx.group.job_id,
        ctx.rank,
        chunk_tokens,
        time.perf_counter() - started,
    )


def stop_if_cancelled(mx_group: Any, io: JobIO, when: str) -> None:
    """The ranks agree (one tiny collective) whether the job was cancelled; all raise if so."""
    votes = mx.array([int(io.should_stop())], dtype=mx.int32)
    if mx_group is not None:
        votes = mx.distributed.all_sum(votes, group=mx_group)
    if votes.item():
        raise Cancelled(f"stopped {when}")


def enter(io: JobIO, lead: bool, watchdog: Watchdog, phase: JobState, total: int) -> None:
    watchdog.kick(phase.value)
    if lead:
        io.enter(phase, total)


def job_result(
    spec: JobSpec,
    tokenizer: ChatTokenizer,
    prompt_tokens: int,
    load_s: float,
    prefill: PrefillResult,
    decoded: DecodeResult,
    peaks: list[int],
) -> JobResult:
    generated = decoded.tokens
    text = tokenizer.decode([t for t in generated if t not in tokenizer.eos_token_ids])
    return JobResult(
        text=cut_at_stop(text, spec.stop) if spec.kind == JobKind.GENERATE else None,
        prompt_tokens=prompt_tokens,
        generated_tokens=len(generated),
        prompt_tps=prefill.prompt_tokens / prefill.seconds,  # the tokens computed
        generation_tps=len(generated) / decoded.seconds if decoded.seconds else 0.0,
        load_s=load_s,
        prefill_s=prefill.seconds,
        decode_s=decoded.seconds,
        peak_memory_bytes=peaks,
    )


def kicking(watchdog: Watchdog, report: ProgressFn) -> ProgressFn:
    """The engine's progress callback (every rank, each chunk / decode step): a watchdog kick,
    then the throttled report."""

    def on_progress(phase: str, done: int, total: int) -> None:
        watchdog.kick(phase)
        report(phase, done, total)

    return on_progress


@dataclass
class _ReportClock:
    phase: str = ""
    phase_started_s: float = 0.0
    last_write_s: float = 0.0


def throttled(io: JobIO, lead: bool):
    """Progress callback for the engine: rank 0 writes at most every PROGRESS_INTERVAL_S, and
    always the first and last update of a phase."""
    clock = _ReportClock()

    def report(phase: str, done: int, total: int) -> None:
        if not lead:
            return
        now = time.perf_counter()
        if phase != clock.phase:
            clock.phase, clock.phase_started_s = phase, now
        if done not in (1, total) and now - clock.last_write_s < PROGRESS_INTERVAL_S:
            return
        clock.last_write_s = now
        elapsed = max(now - clock.phase_started_s, 1e-9)
        io.progress(
            Progress(
                phase=JobState(phase),
                processed=done,
                total=total,
                prompt_tps=done / elapsed if phase == "prefill" else 0.0,
                generation_tps=done / elapsed if phase == "decode" else 0.0,
            )
        )

    return report


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
    exit_with_parent()
    ctx = RankContext(group, args.rank, args.group.parent, settings)
    return run_guarded(ctx, make_io(args, ctx))


def await_handover() -> list[str] | None:
    """A spare rank: the imports (12 s of a cold rank's start on an H200 machine, mostly
    mlx-lm importing transformers) and the device's initialisation happen before any job needs
    them. Then one JSON line {argv, log} on stdin makes this the rank; EOF: exit."""
    exit_with_parent()
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
