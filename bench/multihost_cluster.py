"""The rehearsal's cluster (bench/multihost.py): Redis over TCP with a password, the dispatcher
and `ringq serve` on host a; node agents on b and c; a client in this process, over the bridge."""

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import redis

from bench.multihost_hosts import HOME, Hosts
from jobs.redis_server import connect, redis_binary, tcp_url
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job

MODEL = "random:tiny-llama"  # byte tokenizer: one token per byte
PASSWORD = "rehearsal-s3cret"
API_KEY = "rehearsal-key"
LONG_DOCUMENT = "Ring attention splits a long prompt over several machines. " * 70  # ~4,100 tok
ENV = {
    "RINGQ_HOME": str(HOME),
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_CHECKPOINT_TOKENS": "256",
    "RINGQ_CHECKPOINT_AFTER_S": "0",  # these short prefills checkpoint too
    "RINGQ_GROUP_IDLE_S": "0",
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
    "RINGQ_STALL_TIMEOUT_S": "15",
    "RINGQ_RING_MIN_TOKENS": "256",  # long documents ring over both nodes
    "RINGQ_API_KEYS": API_KEY,
}


class Cluster:
    """Redis, dispatcher and serve on a; node agents on b and c; a client here."""

    def __init__(self, hosts: Hosts, tls_server: Path | None = None):
        self.hosts = hosts
        self.tls_server = tls_server or redis_binary()
        self.a = hosts["a"]
        self.url = tcp_url(self.a.address, 6379, PASSWORD)
        self.env = {**os.environ, **ENV, "RINGQ_REDIS_URL": self.url}
        self.redis: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self._store: JobStore | None = None

    def start(self) -> None:
        self.start_redis()
        self._store = JobStore(connect(self.url, ride_out_s=60))
        self.a.start([sys.executable, "-m", "cli.main", "dispatcher"], self.env, "dispatcher.log")
        serve = ["serve", "--host", self.a.address, "--port", "8000"]
        self.a.start([sys.executable, "-m", "cli.main", *serve], self.env, "serve.log")
        for name in ("b", "c"):
            self.start_agent(name)
        self.wait_nodes({"b", "c"})

    def start_redis(self) -> None:
        """redis-server as docs/deployment.md says: bound to a's address, a password, AOF."""
        self.redis = self.a.start(
            [
                str(redis_binary()),
                "--bind",
                self.a.address,
                "--port",
                "6379",
                "--requirepass",
                PASSWORD,
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(HOME),
                "--save",
                "",
            ],
            self.env,
            "redis.log",
        )
        wait(lambda: alive(self.url), "Redis on a", 20)

    def start_agent(self, name: str) -> None:
        host = self.hosts[name]
        args = [sys.executable, "-m", "cli.main", "node", "--name", name]
        args += ["--address", host.address, "--memory-limit", "4"]
        self.agents[name] = host.start(args, self.env, "node.log")

    def kill_agent(self, name: str) -> None:
        agent = self.agents.pop(name)
        agent.kill()
        agent.wait(timeout=10)

    @property
    def store(self) -> JobStore:
        assert self._store is not None, "start() first"
        return self._store

    def live(self) -> set[str]:
        return {node.name for node in self.store.live_nodes()}

    def wait_nodes(self, names: set[str], timeout_s: float = 60) -> None:
        wait(lambda: names <= self.live(), f"nodes {sorted(names)}", timeout_s)

    def submit(self, document: str, ranks: int | Literal["auto"] = "auto", **fields) -> JobRecord:
        spec = JobSpec(
            kind=JobKind.GENERATE,
            document=document,
            prompt="Go on.",
            max_tokens=8,
            model=MODEL,
            ranks=ranks,
            **fields,
        )
        return submit_job(self.store.conn, spec)

    def final(self, job_id: str, timeout_s: float = 180) -> JobRecord:
        store = self.store
        return wait(lambda: (r := store.get(job_id)).state.is_final and r, job_id, timeout_s)

    def completions(self, job_id: str) -> int:
        """Groups that ran the job to the end, from rank 0's logs on b and c."""
        done = f"job {job_id} rank 0: done"
        return sum(self.hosts[n].read("logs/*-rank0.log").count(done) for n in ("b", "c"))

    def cli(self, *args: str, input_text: str | None = None) -> subprocess.CompletedProcess:
        """`ringq ARGS` on host a."""
        command = [sys.executable, "-m", "cli.main", *args]
        return self.a.run(command, self.env, input_text=input_text, timeout_s=120)


def wait(check: Callable[[], object], what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)
    return value


def alive(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def progress_at(cluster: Cluster, job_id: str, share: float) -> JobRecord | None:
    record = cluster.store.get(job_id)
    if record.state.is_final:
        raise AssertionError(f"job {job_id} ended before {share:.0%}: {record.state}")
    total = record.progress.total
    return record if total and record.progress.processed >= share * total else None
