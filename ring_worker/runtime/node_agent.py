"""The node agent: one per machine. Registers the node with a heartbeat, works its RQ command
queue (no fork) and starts rank processes, fresh interpreters, when the dispatcher asks. It never
imports MLX. When a rank exits non-zero the agent reports the group lost (jobs.recovery retries
or fails its job); agents kill their ranks of failed groups, so no process is left behind. Ranks
exit by themselves when their agent dies, and the node's next agent reports their groups lost
(ring_worker/runtime/node_ranks.py)."""

import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

from jobs import keys
from jobs.errors import JobNotFoundError, RingqError
from jobs.recovery import lose_group_jobs
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec, NodeInfo, NodeRank
from jobs.settings import Settings, group_batch_limit
from jobs.store import JobStore
from jobs.submit import node_queue
from jobs.workers import service_worker
from ring_worker.engine.devices import cuda_memory_bytes, gpu_name, node_backend, visible_gpus
from ring_worker.runtime.checkpoint_sweep import SWEEP_INTERVAL_S, sweep_checkpoints
from ring_worker.runtime.node_ranks import (
    forget_rank,
    lose_predecessor_ranks,
    process_started_at,
    record_rank,
)
from ring_worker.runtime.processes import rank_environment, spawn_rank, terminate_all
from ring_worker.runtime.stall import StallWatch
from ring_worker.runtime.standby import StandbyRank

log = logging.getLogger(__name__)
MONITOR_INTERVAL_S = 0.2
LOG_TAIL_LINES = 8


# Set the GPU's owner to ARGV[1] for ARGV[2] ms unless another agent owns it; returns that
# other owner, or nil when the GPU is (now) ARGV[1]'s.
_OWN_GPU = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then
    return owner
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return nil
"""
_FREE_GPU = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    redis.call('DEL', KEYS[1])
end
"""


@dataclass
class RankProcess:
    group: GroupSpec
    rank: int
    process: subprocess.Popen
    log_path: Path


class NodeAgent:
    def __init__(
        self,
        name: str,
        conn: redis.Redis,
        redis_url: str,
        settings: Settings,
        *,
        address: str = "127.0.0.1",
        memory_limit_bytes: int | None = None,
        share_gpu: bool = False,
    ):
        self.name = name
        self.conn = conn
        self.redis_url = redis_url
        self.settings = settings
        self.address = address
        self.memory_limit_bytes = memory_limit_bytes
        self.store = JobStore(conn, settings.job_ttl_s)
        self.started_at = time.time()
        self.incarnation = uuid.uuid4().hex  # this start's: a restarted agent's differs
        self.ranks: list[RankProcess] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.reservations = Reservations(conn, settings.reservation_lease_s)
        self.stalls = StallWatch(self.store, settings, name)
        self.scratch = settings.home / "nodes" / name
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.backend = node_backend(settings.backend)
        gpus = visible_gpus() if self.backend == "cuda" else []
        self.gpu = gpus[0] if gpus else None  # an agent owns one GPU (`ringq node --gpus`)
        self.share_gpu = share_gpu
        self._own_gpu = conn.register_script(_OWN_GPU)
        self._free_gpu = conn.register_script(_FREE_GPU)
        self.host = socket.gethostname()
        self.standby: StandbyRank | None = None
        if settings.standby_rank == "on" or (
            settings.standby_rank == "auto" and self.backend != "cpu"
        ):
            env = self.rank_env(self.settings.backend, local_ranks=1, local_rank=0)
            self.standby = StandbyRank(env, settings.home / "logs" / f"{name}-standby.log")

    def info(self) -> NodeInfo:
        """Memory admission may plan with: the GPU's on CUDA nodes, host memory elsewhere."""
        host = psutil.virtual_memory()
        free, total = node_memory_bytes(
            self.backend,
            self.gpu,
            cuda_memory_bytes() if self.backend == "cuda" else None,
            (host.available, host.total),
        )
        limit = min(self.memory_limit_bytes or total, total)
        available = min(limit, free)
        device = "cpu" if self.gpu is None else f"cuda:{self.gpu} {gpu_name(self.gpu)}".strip()
        return NodeInfo(
            name=self.name,
            backend=self.backend,
            memory_bytes=limit,
            available_bytes=available,
            free_bytes=free,
            address=self.address,
            device=device if self.backend != "metal" else "metal",
            gpu=None if self.gpu is None else f"{self.host}/{self.gpu}",
            pid=os.getpid(),
            started_at=self.started_at,
            heartbeat_at=time.time(),
            incarnation=self.incarnation,
        )

    def claim_gpu(self) -> None:
        """Own this agent's GPU, or stop with a clear error when another live agent does: two
        ranks on one GPU would fail later in NCCL. `share_gpu` (ringq up --nodes N > GPUs)
        shares on purpose. Each heartbeat claims again, to renew the claim: one that expired
        (an agent stuck for node_ttl_s) and was taken by another agent stays the other's."""
        if self.gpu is None or self.share_gpu:
            return
        owner = self._own_gpu(
            keys=[keys.gpu_owner(self.host, self.gpu)],
            args=[self.name, int(self.settings.node_ttl_s * 1000)],
        )
        if owner is not None:
            owner_name = owner.decode() if isinstance(owner, bytes) else str(owner)
            raise RingqError(
                f"GPU {self.gpu} on {self.host} already belongs to node {owner_name}: give each "
                "node agent its own GPU (`ringq node --gpus N`), or stop the other agent"
            )

    def start_rank(self, group: GroupSpec, rank: int) -> bool:
        """Start one rank, unless its group is already failed or its job has moved on (a command
        left in the queue of an agent that was down)."""
        if (why := self.stale(group)) is not None:
            log.info("job %s rank %d: not started, %s", group.job_id, rank, why)
            self.reservations.release(group.group_id, self.name)
            return False
        group_dir = self.scratch / group.group_id
        group_dir.mkdir(parents=True, exist_ok=True)
        spec_path = group_dir / f"group-rank{rank}.json"
        spec_path.write_text(group.model_dump_json())
        log_path = self.settings.home / "logs" / f"{group.group_id}-rank{rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            "-m",
            "ring_worker.rank_main",
            "--group",
            str(spec_path),
            "--rank",
            str(rank),
            "--redis-url",
            self.redis_url,
        ]
        local_ranks = sum(1 for n in group.nodes if n == self.name)
        backend = rank_backend(group, rank, self.settings.backend)
        process = None
        if self.standby is not None and local_ranks == 1 and backend in ("auto", self.backend):
            process = self.standby.take(argv, log_path)
        if process is None:
            local_rank = group.nodes[:rank].count(self.name)
            process = spawn_rank(argv, self.rank_env(backend, local_ranks, local_rank), log_path)
        self.remember(RankProcess(group, rank, process, log_path))
        log.info("job %s rank %d: started pid %d on %s", group.job_id, rank, process.pid, self.name)
        return True

    def remember(self, rp: RankProcess) -> None:
        """For the monitor, then in Redis for this node's next agent. A rank reaped before it
        is recorded leaves its record behind; the next agent's report of it changes nothing,
        since its group has ended or been reported already."""
        with self.lock:
            self.ranks.append(rp)
        pid = rp.process.pid
        record = NodeRank(
            group=rp.group,
            rank=rp.rank,
            incarnation=self.incarnation,
            pid=pid,
            started_at=process_started_at(pid),
        )
        record_rank(self.conn, self.name, record)

    def rank_env(self, backend: str, local_ranks: int, local_rank: int) -> dict[str, str]:
        env = rank_environment(
            self.settings.blas,
            threads=max(1, (os.cpu_count() or 1) // local_ranks),
            local_rank=local_rank,
            backend=backend,
            home=self.settings.home,
        )
        if self.memory_limit_bytes:
            env["RINGQ_RANK_MEMORY_LIMIT_BYTES"] = str(self.memory_limit_bytes)
        return env

    def stale(self, group: GroupSpec) -> str | None:
        if self.conn.exists(keys.group_failed(group.group_id)):
            return "its group already failed"
        try:
            record = self.store.get(group.job_id)
        except JobNotFoundError:
            return "its job no longer exists"
        if record.placement is None:
            return f"its job is {record.state}"
        if record.state.is_final and group_batch_limit(group, self.settings) <= 1:
            # a group that batches starts anyway: jobs may have joined it (jobs/dispatcher.py
            # `offer`), and every agent must decide alike (a ring half started waits for its
            # other half until the loading timeout)
            return f"its job is {record.state}"
        if record.placement.group_id != group.group_id:
            return f"its job moved on to group {record.placement.group_id}"
        return None

    def heartbeat_forever(self) -> None:
        while not self.stopping.is_set():
            self.heartbeat()
            self.stopping.wait(self.settings.node_heartbeat_s)

    def heartbeat(self) -> None:
        """Renew the GPU claim and the node's record; a node whose GPU went to another agent
        is no longer offered (its record expires)."""
        try:
            self.claim_gpu()
            self.store.put_node(self.info(), self.settings.node_ttl_s)
        except redis.RedisError as exc:
            log.warning("node %s: heartbeat failed: %s", self.name, exc)
        except RingqError as exc:
            log.error("node %s: not registered: %s", self.name, exc)

    def monitor_forever(self) -> None:
        swept_at_s = 0.0
        while not self.stopping.is_set():
            try:
                self.reap_ranks()
                if time.monotonic() - swept_at_s > SWEEP_INTERVAL_S:
                    swept_at_s = time.monotonic()
                    sweep_checkpoints(self.store, self.settings.home)
            except redis.RedisError as exc:
                log.warning("node %s: monitor failed: %s", self.name, exc)
            self.stopping.wait(MONITOR_INTERVAL_S)

    def reap_ranks(self) -> None:
        with self.lock:
            ranks = list(self.ranks)
        self.stalls.retain(rp.group.group_id for rp in ranks)
        for rp in ranks:
            code = rp.process.poll()
            if code is None:
                self.reservations.renew(rp.group.group_id, self.name)
                if self.conn.exists(keys.group_failed(rp.group.group_id)):
                    log.info(
                        "job %s rank %d: group failed, stopping rank", rp.group.job_id, rp.rank
                    )
                    terminate_all([rp.process])
                elif (stalled := self.stalls.check(rp.group)) is not None:
                    self.stalls.lose(rp.group, rp.rank, rp.process, stalled)
                continue
            with self.lock:
                self.ranks.remove(rp)
            self.reservations.release(rp.group.group_id, self.name)
            if code != 0:
                self.fail_group(rp, code)
            forget_rank(self.conn, self.name, rp.group.group_id, rp.rank)

    def fail_group(self, rp: RankProcess, code: int) -> None:
        """A rank exited non-zero: its group is lost. The rank's own report (if it lived to
        write one) says why; otherwise its exit status and log do."""
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        reason = f"rank {rp.rank} on node {self.name} {how}"
        if tail := log_tail(rp.log_path):
            reason += f": {tail}"
        outcomes = lose_group_jobs(self.conn, self.settings, rp.group, reason)
        for job_id, outcome in outcomes.items() or [(rp.group.job_id, None)]:
            log.warning("job %s: %s (%s)", job_id, reason, outcome or "already handled")

    def run(self) -> None:
        """Register (or stop with a clear error), then serve until SIGINT/SIGTERM; then stop
        every rank this agent started."""
        self.claim_gpu()
        try:
            self.store.put_node(self.info(), self.settings.node_ttl_s)
        except RingqError:
            self.release_gpu()
            raise
        self.lose_predecessor_ranks()
        if self.standby is not None:
            self.standby.start()
        threads = [
            threading.Thread(target=f, daemon=True, name=f.__name__)
            for f in (self.heartbeat_forever, self.monitor_forever)
        ]
        for thread in threads:
            thread.start()
        global _agent
        _agent = self
        worker = service_worker(node_queue(self.conn, self.name), self.conn, f"node-{self.name}")
        try:
            worker.work(logging_level="WARNING")
        finally:
            self.stopping.set()
            with self.lock:
                terminate_all([rp.process for rp in self.ranks])
            if self.standby is not None:
                self.standby.stop()
            self.store.remove_node(self.name)
            self.release_gpu()

    def lose_predecessor_ranks(self) -> None:
        """Ranks an earlier agent of this node started died with it: their groups are lost."""
        lost = lose_predecessor_ranks(
            self.conn, self.settings, self.name, self.incarnation, self.reservations
        )
        if lost:
            log.warning(
                "node %s: %d rank(s) of the previous agent reported lost", self.name, len(lost)
            )

    def release_gpu(self) -> None:
        """Give up this agent's GPU claim, unless another agent's claim has replaced it."""
        if self.gpu is not None and not self.share_gpu:
            self._free_gpu(keys=[keys.gpu_owner(self.host, self.gpu)], args=[self.name])


_agent: NodeAgent | None = None


def start_rank(group: dict, rank: int) -> str:
    """RQ entry point, executed inside the node agent's process."""
    if _agent is None:
        raise RuntimeError("start_rank must run inside a node agent")
    spec = GroupSpec.model_validate(group)
    started = _agent.start_rank(spec, rank)
    return f"{'started' if started else 'skipped'} rank {rank} of group {spec.group_id}"


def node_memory_bytes(
    backend: str,
    gpu: str | None,
    gpu_memory: tuple[int, int] | None,
    host_memory: tuple[int, int],
) -> tuple[int, int]:
    """(free, total) bytes a node offers: its GPU's on CUDA nodes, host memory elsewhere. A
    CUDA node whose GPU cannot be read (gone, or none visible) is an error, never host memory
    passed off as the GPU's."""
    if backend != "cuda":
        return host_memory
    if gpu is None:
        raise RingqError(
            "RINGQ_BACKEND is cuda but this node sees no GPU (check CUDA_VISIBLE_DEVICES and "
            "nvidia-smi, or set RINGQ_BACKEND=cpu)"
        )
    if gpu_memory is None:
        raise RingqError(
            f"GPU {gpu}: its memory cannot be read (nvidia-smi --id={gpu}): is the GPU still "
            "there? Check nvidia-smi, or start the node on another GPU (`ringq node --gpus N`)"
        )
    return gpu_memory


def rank_backend(group: GroupSpec, rank: int, node_backend: str) -> str:
    """What the rank computes on: its plan's device where the plan names one."""
    planned = group.devices[rank] if rank < len(group.devices) else ""
    return "cpu" if planned == "cpu" else node_backend


def log_tail(path: Path) -> str:
    """The last meaningful lines of a rank's log: usually the exception."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    useful = [line for line in lines if line.strip() and not line.startswith("[ring]")]
    return " | ".join(useful[-LOG_TAIL_LINES:])[-800:]
