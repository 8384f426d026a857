"""A rank process's edge: a watchdog over the whole run, and how each way of ending is recorded."""

import logging

from jobs.errors import RingqError
from ring_worker.engine.engines import Cancelled
from ring_worker.runtime.job_io import JobIO
from ring_worker.runtime.job_run import RankContext
from ring_worker.runtime.serve_loop import serve
from ring_worker.runtime.watchdog import Watchdog, loading_timeout_s

log = logging.getLogger(__name__)


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
