"""Jobs waiting for memory, in Redis, and which of them is the head: retries first, then the oldest
(created_at, then id), whose need is held on the nodes it waits for (the rule: jobs/admit_plan.py;
what a hold takes: jobs/head_hold.py). keys.MEMORY_WAITS orders them; keys.memory_hold(job) holds
each one's node -> bytes and expires unless the job waits again within HOLD_LEASE_S.

The dispatcher writes a job's hold each time it waits for memory and drops it when the job is
placed, fails or waits for something else. Reading the head also drops an entry whose job is no
longer queued or whose hold expired, so no hold outlives its job's wait; only the front of the
order is read.

What frees room says so (`wake_admissions`): the dispatcher then puts a try of the head at the
front of the admit queue, so a GPU that frees goes to the oldest job at once rather than after up
to a round of RINGQ_ADMIT_RETRY_S."""

import json
from typing import Any, cast

import redis

from jobs import keys
from jobs.head_hold import HeadHold
from jobs.lifecycle import JobState
from jobs.schemas import JobRecord

# A waiting job writes its hold again once per round of the admit queue (every waiting job
# tries again once a round: jobs/dispatcher.py `wait`), seconds even with a thousand queued.
# Longer than that; short enough that the hold of a job nobody admits any more (a lost
# admission) frees its nodes soon.
HOLD_LEASE_S = 120.0
# A retry goes ahead of every first attempt (as vLLM puts a preempted request back at the front
# of its queue): it had its turn and lost its group to a fault. Ordered by created_at alone, a
# retry of a job submitted with a thousand others waited 12-33 min behind the older ones (the
# second 1,000-job chaos soak). Its score is its created_at this far back.
RETRY_AHEAD_S = 2.0**40


def queue_score(record: JobRecord) -> float:
    """Its place among the jobs waiting for memory: lower goes first."""
    return record.created_at - (RETRY_AHEAD_S if record.attempt else 0.0)


class MemoryWaits:
    def __init__(self, conn: redis.Redis, lease_s: float = HOLD_LEASE_S):
        self.conn = conn
        self.lease_s = lease_s

    def record(self, record: JobRecord, bytes_per_node: dict[str, int]) -> None:
        """`record` waits for memory: `bytes_per_node` on the nodes it waits for."""
        hold = keys.memory_hold(record.id)
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.zadd(keys.MEMORY_WAITS, {record.id: queue_score(record)})
            pipe.delete(hold)
            pipe.hset(hold, mapping=cast(dict[Any, Any], bytes_per_node))  # an invariant type
            pipe.pexpire(hold, int(self.lease_s * 1000))
            pipe.execute()

    def drop(self, job_id: str) -> None:
        with self.conn.pipeline(transaction=True) as pipe:
            pipe.zrem(keys.MEMORY_WAITS, job_id)
            pipe.delete(keys.memory_hold(job_id))
            pipe.execute()

    def head(self, record: JobRecord) -> HeadHold | None:
        """The hold `record`'s admission plans around: the oldest waiting job's if that is older
        than `record`; `record`'s own if it is the oldest (it keeps to the nodes it holds);
        None if neither waits."""
        own = (queue_score(record), record.id)
        while front := cast(list, self.conn.zrange(keys.MEMORY_WAITS, 0, 0, withscores=True)):
            [(raw_id, score)] = front
            job_id = text(raw_id)
            if (score, job_id) > own:
                return None
            held = self.held(job_id)
            if job_id == record.id:
                return HeadHold(job_id, held) if held else None
            if held and self.queued(job_id):
                return HeadHold(job_id, held)
            self.drop(job_id)  # its job stopped waiting without a word
        return None

    def held(self, job_id: str) -> dict[str, int]:
        raw = cast(dict, self.conn.hgetall(keys.memory_hold(job_id)))
        return {text(name): int(value) for name, value in raw.items()}

    def first(self) -> str | None:
        """The job id at the front of the order (it may have stopped waiting: admitting it then
        skips it)."""
        front = cast(list, self.conn.zrange(keys.MEMORY_WAITS, 0, 0))
        return text(front[0]) if front else None

    def queued(self, job_id: str) -> bool:
        state = self.conn.hget(keys.job(job_id), "state")
        return state is not None and json.loads(state) == JobState.QUEUED.value


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def wake_admissions(conn: redis.Redis) -> None:
    """Memory or a group slot may have freed (a group's reservation ended, a warm group went
    idle, a job left a batch): the dispatcher's pause between two tries ends now, and the head
    is tried first (jobs/dispatcher.py `wait`). One word is kept however many are said."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.lpush(keys.ADMIT_WAKE, "1")
        pipe.ltrim(keys.ADMIT_WAKE, 0, 0)
        pipe.execute()
