"""The RQ worker every ringq service runs: no fork, JSON only, and a short heartbeat so that a
job whose service died (kill -9) is found abandoned and retried within seconds of its timeout,
not minutes."""

import os
import socket

import redis
from rq import Queue, SimpleWorker
from rq.job import Job
from rq.serializers import JSONSerializer

HEARTBEAT_MARGIN_S = 5


class ServiceWorker(SimpleWorker):
    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        # A SimpleWorker runs the job in its own thread and cannot heartbeat meanwhile: the
        # registry entry must outlive the job's timeout, and no more.
        return int(job.timeout or 60) + HEARTBEAT_MARGIN_S


def service_worker(queue: Queue, conn: redis.Redis, role: str) -> ServiceWorker:
    return ServiceWorker(
        [queue],
        connection=conn,
        serializer=JSONSerializer,
        name=f"ringq-{role}-{socket.gethostname()}-{os.getpid()}",
    )
