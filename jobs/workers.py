"""The RQ worker every ringq service runs: no fork, JSON only, and a short heartbeat so that a
job whose service died (kill -9) is found abandoned and retried within seconds of its timeout,
not minutes. Its name says its role, host and pid, so that the reconciler can retry at once an
admission whose dispatcher on this host is gone (jobs/recovery.py)."""

import os
import socket

import psutil
import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

HEARTBEAT_MARGIN_S = 5
DISPATCHER_ROLE = "dispatcher"


class ServiceWorker(SimpleWorker):
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # A SimpleWorker runs the job in its own thread and cannot heartbeat meanwhile: the
        # registry entry must outlive the job's timeout, and no more.
        return int(job.timeout or 60) + HEARTBEAT_MARGIN_S


def service_worker(queue: Queue, conn: redis.Redis, role: str) -> ServiceWorker:
    worker = ServiceWorker(
        [queue],
        connection=conn,
        serializer=JSONSerializer,
        name=worker_name(role, socket.gethostname(), os.getpid()),
    )
    if conn.exists(worker.key) and not conn.hexists(worker.key, "death"):
        # Our own name (host, pid) still registered: a predecessor that died without saying so.
        # A restarted container gets the same host name and pid 1, and RQ refuses to start a
        # worker under a live name until its key expires (minutes of restarts under compose).
        worker.register_death()
    return worker


def worker_name(role: str, host: str, pid: int) -> str:
    return f"ringq-{role}-{host}-{pid}"


def died_here(name: str, role: str) -> bool:
    """Whether `name` is a `role` worker of this host whose process is gone (or a zombie). A
    worker of another host, or a name that is not ours, cannot be told: False."""
    pid = name.rpartition("-")[2]
    if not pid.isdigit() or name != worker_name(role, socket.gethostname(), int(pid)):
        return False
    try:
        return psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # another user's process: alive
        return False
