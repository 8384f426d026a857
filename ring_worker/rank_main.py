"""A rank process's entry: parse, build, run. Started fresh (`python -m ring_worker.rank_main`) by a
node agent or by `ringq run`; never forked from a process that has MLX initialised."""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import mlx.core as mx

from jobs.schemas import GroupSpec
from jobs.settings import Settings
from ring_worker.runtime.job_io import FileJobIO, JobIO, RedisJobIO
from ring_worker.runtime.job_run import RankContext
from ring_worker.runtime.processes import exit_with_parent
from ring_worker.runtime.rank_edge import run_guarded

log = logging.getLogger(__name__)


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
