"""The ranks a node's agent runs, kept in Redis (keys.node_ranks), so that the node's next agent
knows what its predecessor left behind.

An agent killed and started again under the same name before its heartbeat lapses never looks
gone, and while another node's rank renews the group's lease nothing finds the group lost. The
ranks died with the old agent (ring_worker/runtime/processes.py), so the new one, once
registered, reports every rank an earlier incarnation recorded lost (jobs.recovery retries or
fails its jobs), frees the group's reservation here, and kills the rank should it still run (a
platform without PR_SET_PDEATHSIG)."""

import logging

import psutil
import redis

from jobs import keys
from jobs.recovery import lose_group_jobs
from jobs.reservations import Reservations
from jobs.schemas import NodeRank
from jobs.settings import Settings

log = logging.getLogger(__name__)


def record_rank(conn: redis.Redis, node: str, rank: NodeRank) -> None:
    field = rank_field(rank.group.group_id, rank.rank)
    conn.hset(keys.node_ranks(node), field, rank.model_dump_json())


def forget_rank(conn: redis.Redis, node: str, group_id: str, rank: int) -> None:
    conn.hdel(keys.node_ranks(node), rank_field(group_id, rank))


def recorded_rank(conn: redis.Redis, node: str, group_id: str, rank: int) -> NodeRank | None:
    raw = conn.hget(keys.node_ranks(node), rank_field(group_id, rank))
    return NodeRank.model_validate_json(raw) if raw else None


def rank_field(group_id: str, rank: int) -> str:
    return f"{group_id}:{rank}"  # a node may run several ranks of one group


def process_started_at(pid: int) -> float:
    """When process `pid` started (0.0 if it is gone): with the pid, what tells it from a later
    process that reused the pid."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def lose_predecessor_ranks(
    conn: redis.Redis,
    settings: Settings,
    node: str,
    incarnation: str,
    reservations: Reservations,
) -> list[NodeRank]:
    """Report lost every rank that an agent of `node` other than `incarnation` recorded (its
    jobs are retried), free their reservations on `node`; returns those ranks."""
    lost = []
    for field, raw in conn.hgetall(keys.node_ranks(node)).items():
        rank = NodeRank.model_validate_json(raw)
        if rank.incarnation == incarnation:
            continue
        kill_leftover(rank)
        lose_rank(conn, settings, node, rank)
        reservations.release(rank.group.group_id, node)
        conn.hdel(keys.node_ranks(node), field)
        lost.append(rank)
    return lost


def lose_rank(conn: redis.Redis, settings: Settings, node: str, rank: NodeRank) -> None:
    reason = (
        f"rank {rank.rank} on node {node} was lost: its node agent was restarted (the rank "
        "was started by the previous one)"
    )
    outcomes = lose_group_jobs(conn, settings, rank.group, reason)
    for job_id, outcome in outcomes.items() or [(rank.group.job_id, None)]:
        log.warning("job %s rank %d: %s (%s)", job_id, rank.rank, reason, outcome or "handled")


def kill_leftover(rank: NodeRank) -> None:
    """SIGKILL the rank's process if it still runs: the same pid, started at the same time."""
    try:
        process = psutil.Process(rank.pid)
        if rank.started_at and process.create_time() == rank.started_at:
            log.warning(
                "job %s rank %d: killing pid %d, left by the previous agent",
                rank.group.job_id,
                rank.rank,
                rank.pid,
            )
            process.kill()
    except psutil.Error:  # gone already
        pass
