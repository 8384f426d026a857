"""Warm groups: a group whose job finished stays loaded for RINGQ_GROUP_IDLE_S, and the next job
for the same model and layout runs on it: no processes to start, no weights to load.

In Redis, keys.WARM_GROUPS maps a group id to a WarmGroup while it may take jobs. Its rank 0
keeps keys.group_idle alive (a short TTL) exactly while it waits. Every rank blocks on its own
list keys.group_next (in Redis, not in a collective: MLX's ring backend spins a core
while it waits). The dispatcher claims an idle group by deleting the idle key and pushing the job
id to every rank's list in one script; rank 0 retires the group the same way, so a group never
gets a job after it retired, nor two at once, and every rank sees the same words in the same
order. An empty word asks the group to retire (idle too long, or its memory is wanted by a job
of another shape).

Batching (RINGQ_MAX_BATCH > 1): a busy group that was offered takes more jobs of its model and
layout: `join` pushes the job id the same way while keys.group_batch (the jobs it runs now, each
with the bytes its joining added to the group's reservation) holds fewer than the limit, and
never to an idle or retired group. The same script grows the group's reservation on each of its
nodes by the job's KV, or refuses when a node's budget cannot hold it; `ended` shrinks it back
as the job leaves. Its ranks take such words between decode steps (`joined`), so a job joins
the batch at the next step. The batch is also the list of jobs the reconciler retries when the
group is lost (jobs/recovery.py).
"""

import logging
import time
from collections.abc import Callable, Iterable
from typing import Literal

import redis

from jobs import keys
from jobs.schemas import GroupSpec, WarmGroup

log = logging.getLogger(__name__)
IDLE_KEY_TTL_S = 5
RANK_GRACE_S = 30.0  # ranks other than 0 wait this much longer than the idle time
RETIRE = ""  # pushed instead of a job id: retire now
JOIN_TAKE_MAX = 64  # jobs a busy group takes between two decode steps, at most
JoinOutcome = Literal["joined", "no-memory", "no"]

# KEYS: idle, then each rank's list. ARGV: word. Claims the group if it is idle.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[1]) end
return 1
"""
# KEYS: idle, warm index, batch hash, each node's reserved hash (ARGV[5] of them), then each
# rank's list. ARGV: group id, job id, max batch, bytes, node count, then each node's capacity.
# A busy group (offered, not idle, not retired) takes one more job while its batch has room and
# every node's reservations (all of them, expired leases too: conservative) can grow by `bytes`.
_JOIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
if redis.call('HLEN', KEYS[3]) >= tonumber(ARGV[3]) then return 0 end
local grow, nodes = tonumber(ARGV[4]), tonumber(ARGV[5])
for i = 1, nodes do
  local reserved = KEYS[3 + i]
  if redis.call('HEXISTS', reserved, ARGV[1]) == 0 then return 0 end
  local used = 0
  for _, bytes in ipairs(redis.call('HVALS', reserved)) do used = used + tonumber(bytes) end
  if used + grow > tonumber(ARGV[5 + i]) then return -1 end
end
for i = 1, nodes do redis.call('HINCRBY', KEYS[3 + i], ARGV[1], grow) end
redis.call('HSET', KEYS[3], ARGV[2], grow)
for i = 4 + nodes, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[2]) end
return 1
"""
# KEYS: batch hash, then each node's reserved hash. ARGV: group id, job id. A job leaves the
# batch: the bytes its joining added come off the group's reservation (if it still holds one).
_LEAVE = """
local grow = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or 0)
redis.call('HDEL', KEYS[1], ARGV[2])
if grow > 0 then
  for i = 2, #KEYS do
    if redis.call('HEXISTS', KEYS[i], ARGV[1]) == 1 then
      redis.call('HINCRBY', KEYS[i], ARGV[1], -grow)
    end
  end
end
return grow
"""
# KEYS: idle, rank 0's list. ARGV: ttl. Rank 0 waiting: stay claimable, unless a word is pending.
_REFRESH = """
if redis.call('LLEN', KEYS[2]) == 0 then redis.call('SET', KEYS[1], '1', 'EX', ARGV[1]) end
return 1
"""
# KEYS: idle, warm index, then each rank's list. ARGV: group id. Rank 0 idle too long: retire
# (telling the other ranks) unless a word was pushed meanwhile (returned).
_RETIRE = """
local pending = redis.call('LPOP', KEYS[3])
if pending then return pending end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
for i = 4, #KEYS do redis.call('RPUSH', KEYS[i], '') end
return false
"""


# The keys live in jobs/keys.py; these names stay for callers of main's warm_groups.
idle_key, next_key, batch_key = keys.group_idle, keys.group_next, keys.group_batch


def next_keys(group: GroupSpec) -> list[str]:
    return [keys.group_next(group.group_id, rank) for rank in range(len(group.nodes))]


class WarmGroups:
    def __init__(self, conn: redis.Redis):
        self.conn = conn
        self._claim = conn.register_script(_CLAIM)
        self._refresh = conn.register_script(_REFRESH)
        self._retire = conn.register_script(_RETIRE)
        self._join = conn.register_script(_JOIN)
        self._leave = conn.register_script(_LEAVE)

    # -- the dispatcher's side

    def idle(self) -> list[tuple[GroupSpec, int]]:
        """Groups waiting for a job now, with the bytes each holds per node."""
        return [(warm.group, warm.bytes_per_node) for warm in self.idle_groups()]

    def idle_groups(self) -> list[WarmGroup]:
        """The warm groups waiting for a job now."""
        entries = [
            WarmGroup.model_validate_json(raw)
            for raw in self.conn.hgetall(keys.WARM_GROUPS).values()
        ]
        return [w for w in entries if self.conn.exists(keys.group_idle(w.group.group_id))]

    def claim(self, group: GroupSpec, job_id: str) -> bool:
        keys_ = [keys.group_idle(group.group_id), *next_keys(group)]
        return bool(self._claim(keys=keys_, args=[job_id]))

    def join(
        self,
        group: GroupSpec,
        job_id: str,
        max_batch: int,
        grow_bytes: int = 0,
        capacity_bytes: dict[str, int] | None = None,
    ) -> JoinOutcome:
        """Hand a job to a busy group whose batch holds fewer than `max_batch` jobs; it joins
        at the group's next decode step. With `capacity_bytes` (node -> budget), the group's
        reservation on each of its nodes grows by `grow_bytes` in the same step, and the job is
        refused ("full-memory") when a node's budget cannot hold that. Else "no": idle (claim
        it instead), full, retired, or holding no reservation."""
        nodes = sorted(set(group.nodes)) if capacity_bytes is not None else []
        keys_ = [idle_key(group.group_id), keys.WARM_GROUPS, batch_key(group.group_id)]
        keys_ += [keys.node_reserved(n) for n in nodes]
        args: list[str | int] = [group.group_id, job_id, max_batch, grow_bytes, len(nodes)]
        args += [(capacity_bytes or {})[n] for n in nodes]
        outcome = int(self._join(keys=[*keys_, *next_keys(group)], args=args))
        return "joined" if outcome == 1 else "no-memory" if outcome == -1 else "no"

    def batch(self, group_id: str) -> list[str]:
        return sorted(_text(m) for m in self.conn.hkeys(batch_key(group_id)))

    def busy_groups(self) -> list[WarmGroup]:
        """Offered groups running jobs now (not waiting for one): those a job may join."""
        entries = [
            WarmGroup.model_validate_json(raw)
            for raw in self.conn.hgetall(keys.WARM_GROUPS).values()
        ]
        return [w for w in entries if not self.conn.exists(keys.group_idle(w.group.group_id))]

    def evict(self, groups: Iterable[GroupSpec]) -> list[str]:
        """Ask idle groups to retire now (their memory is wanted); returns those asked."""
        return [g.group_id for g in groups if self.claim(g, RETIRE)]

    # -- rank 0's side

    def offer(self, group: GroupSpec, bytes_per_node: int, chunk_tokens: int | None = None) -> None:
        entry = WarmGroup(group=group, bytes_per_node=bytes_per_node, chunk_tokens=chunk_tokens)
        self.conn.hset(keys.WARM_GROUPS, group.group_id, entry.model_dump_json())

    def started(self, group: GroupSpec, job_id: str) -> None:
        """Rank 0, as a job starts: it is in the group's batch (a joined job is already)."""
        self.conn.hsetnx(batch_key(group.group_id), job_id, 0)

    def ended(self, group: GroupSpec, job_id: str) -> None:
        """Rank 0, as a job leaves the batch (finished, cancelled, failed or skipped): the
        bytes its joining added to the group's reservation are given back."""
        nodes = sorted(set(group.nodes))
        keys_ = [batch_key(group.group_id), *(keys.node_reserved(n) for n in nodes)]
        self._leave(keys=keys_, args=[group.group_id, job_id])

    def joined(self, group: GroupSpec, rank: int, agree: Callable[[int], int]) -> list[str]:
        """Between decode steps, every rank: the jobs handed to the group since, the same on
        every rank. Rank 0 takes what its list holds; `agree` (a collective: rank 0's count to
        every rank) tells the others how many words to take from theirs (already pushed there,
        in the same order, by the same script)."""
        own = next_key(group.group_id, rank)
        words: list[bytes | str] = []
        if rank == 0:
            popped_now = self.conn.lpop(own, JOIN_TAKE_MAX) or []
            words = list(popped_now) if isinstance(popped_now, list) else [popped_now]
        count = agree(len(words))
        while len(words) < count:
            popped = self.conn.blpop([own], timeout=RANK_GRACE_S)
            if popped is None:
                raise RuntimeError(f"group {group.group_id} rank {rank}: a joining job is missing")
            words.append(popped[1])
        return [_text(w) for w in words]

    def wait_for_job(
        self, group: GroupSpec, rank: int, idle_s: float, kick: Callable[[], None] = lambda: None
    ) -> str | None:
        """A rank after a job: the next job id the dispatcher gives its group, or None once the
        group retires (rank 0 retires it after `idle_s` without a job; the other ranks wait
        for rank 0's word, a little longer in case rank 0 died)."""
        own, idle = keys.group_next(group.group_id, rank), keys.group_idle(group.group_id)
        give_up = time.monotonic() + idle_s + (0 if rank == 0 else RANK_GRACE_S)
        while True:
            if rank == 0:
                self._refresh(keys=[idle, own], args=[IDLE_KEY_TTL_S])
            popped = self.conn.blpop([own], timeout=1)
            kick()
            word: bytes | str | None = popped[1] if popped is not None else None
            if word is None and time.monotonic() >= give_up:
                if rank != 0:
                    return None
                keys_ = [idle, keys.WARM_GROUPS, *next_keys(group)]
                word = self._retire(keys=keys_, args=[group.group_id])
                if word is None:
                    return None
            if word is not None:
                job_id = word.decode() if isinstance(word, bytes) else str(word)
                if job_id == RETIRE:
                    if rank == 0:
                        self.conn.hdel(keys.WARM_GROUPS, group.group_id)
                    return None
                return job_id


def _text(word: bytes | str) -> str:
    return word.decode() if isinstance(word, bytes) else word
