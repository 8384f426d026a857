"""A rank's life after it starts: join the group, load the model once, then run the jobs the
group is given until it retires: one at a time (ring_worker/runtime/job_run.py), or in continuous
batches (ring_worker/runtime/batch_serve.py) where the layout allows and RINGQ_MAX_BATCH > 1."""

import logging
import time
from functools import partial
from typing import Any

import mlx.core as mx

from jobs.errors import ModelLoadError
from jobs.lifecycle import JobState
from jobs.model_catalog import resolve_model
from jobs.settings import group_batch_limit
from jobs.tokenizer import ChatTokenizer, load_tokenizer
from ring_worker.engine.batch_decode import batch_decode_supported
from ring_worker.engine.batch_decode import warm_up as warm_up_batch
from ring_worker.engine.decode_text import partial_result
from ring_worker.engine.devices import cap_device_memory
from ring_worker.engine.engines import Cancelled, Engine
from ring_worker.engine.group import join_group
from ring_worker.engine.models import load_for_this_device
from ring_worker.engine.pipeline import keep_stage
from ring_worker.engine.strategies import make_engine
from ring_worker.runtime.batch_serve import BatchServer
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.job_prefix import open_prefix_cache
from ring_worker.runtime.job_run import RankContext, run_job
from ring_worker.runtime.watchdog import Watchdog

log = logging.getLogger(__name__)
IDLE_GRACE_S = 60.0  # a warm group's ranks wait this much longer than its idle time
WARM_UP_ROWS = 4  # the widest batch a GPU group's warm-up steps


def serve(ctx: RankContext, io: JobIO, watchdog: Watchdog) -> None:
    """Load once and run the group's job; a warm group (group.idle_s > 0) then runs the jobs the
    dispatcher gives it, until it has been idle that long."""
    started = time.perf_counter()
    if ctx.lead:
        io.enter(JobState.LOADING, len(io.tokens()))
    engine, tokenizer = start_engine(ctx, io)
    warm_up(engine, io.chunk_tokens(), ctx)
    prefix = open_prefix_cache(ctx.settings, ctx.group, ctx.rank, engine, io)
    load_s = time.perf_counter() - started
    log.info("job %s rank %d: loaded %s in %.1fs", io.job_id, ctx.rank, ctx.group.model, load_s)
    if (max_batch := batch_limit(ctx, engine)) > 1:
        server = BatchServer(ctx, engine, tokenizer, watchdog, prefix, max_batch)
        server.run(io, load_s, lambda job: next_job(ctx, engine, job, watchdog))
        return
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
        if ctx.lead:  # the dispatcher lists every job in its group's batch (jobs/recovery.py)
            job.batch_ended(ctx.group)
        load_s = 0.0
        job = next_job(ctx, engine, job, watchdog)


def batch_limit(ctx: RankContext, engine: Engine) -> int:
    """How many jobs this group decodes together: 1 unless it is a warm group whose layout
    batches (single, ring with replicated KV) and RINGQ_MAX_BATCH allows more."""
    if not batch_decode_supported(engine):
        return 1
    return group_batch_limit(ctx.group, ctx.settings)


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
        if ctx.lead:
            job.batch_ended(group)
        io = job


def start_engine(ctx: RankContext, io: JobIO) -> tuple[Engine, ChatTokenizer]:
    """Join the group and load the model as its plan says. Ranks of a job cancelled meanwhile
    stop together, unless jobs may have joined the group while it started (it batches: the
    dispatcher offered it at once). Those wait on it, so it loads and serves them, and its
    first job ends at its first check."""
    group, rank = ctx.group, ctx.rank
    may_stop = group_batch_limit(group, ctx.settings) <= 1
    on_cpu = rank < len(group.devices) and group.devices[rank] == "cpu"
    if on_cpu:  # the plan puts this rank on CPU, GPU or not (admission.group_plan)
        mx.set_default_device(mx.cpu)
    else:
        cap_device_memory(ctx.settings.rank_memory_limit_bytes)
    mx_group = join_group(group.addresses, rank, ctx.scratch_dir, group.transport)
    if may_stop:
        stop_if_cancelled(mx_group, io, "before loading the model")
    source = resolve_model(group.model, allowed_dirs=ctx.settings.allowed_dirs)
    prune = None
    if group.strategy == "pipeline" and group.ranks > 1:
        prune = partial(keep_stage, rank=rank, size=group.ranks)
    try:
        planned_cpu = on_cpu if group.devices else None  # a plan without devices: look
        model = load_for_this_device(source, prune, group.compute_dtype, cpu=planned_cpu)
    except (OSError, ValueError, RuntimeError) as exc:  # a new placement would fail the same way
        raise ModelLoadError(f"cannot load model {group.model}: {exc}") from exc
    tokenizer = load_tokenizer(source)  # every rank: all must stop on the same EOS
    if may_stop:
        stop_if_cancelled(mx_group, io, "after loading the model")
    return make_engine(model, mx_group, group.strategy, group.exchange, group.kv_layout), tokenizer


def warm_up(engine: Engine, chunk_tokens: int, ctx: RankContext) -> None:
    """On GPUs, run the kernels the group's jobs will need once while loading: a prefill of two
    chunks and two decode steps on token 0, and in a group that batches a short batch
    (ring_worker/engine/batch_decode.py `warm_up`). The first job then starts with compiled
    kernels, graphs and NCCL set up."""
    if not ctx.settings.warm_up or mx.default_device().type != mx.gpu:
        return
    started = time.perf_counter()
    prefill = engine.prefill([0] * (2 * chunk_tokens), chunk_tokens)
    engine.decode(prefill, 2)
    limit = batch_limit(ctx, engine)
    steps = warm_up_batch(engine, min(limit, WARM_UP_ROWS)) if limit > 1 else None
    mx.clear_cache()
    log.info(
        "job %s rank %d: warmed up (%d-token chunks) in %.1fs; step ms by rows %s",
        ctx.group.job_id,
        ctx.rank,
        chunk_tokens,
        time.perf_counter() - started,
        {rows: round(1e3 * s, 2) for rows, s in steps.items()} if steps else {},
    )


def stop_if_cancelled(mx_group: Any, io: JobIO, when: str) -> None:
    """The ranks agree (one tiny collective) whether the job was cancelled; all raise if so."""
    votes = mx.array([int(io.should_stop())], dtype=mx.int32)
    if mx_group is not None:
        votes = mx.distributed.all_sum(votes, group=mx_group)
    if votes.item():
        raise Cancelled(f"stopped {when}")
