"""Warm groups: a group whose job finished stays loaded for RINGQ_GROUP_IDLE_S, and the next job
for the same model and layout runs on it: no processes to start, no weights to load.

In Redis, keys.WARM_GROUPS maps a group id to a WarmGroup while it may take jobs; its rank 0
keeps keys.group_idle alive (a short TTL) exactly while it waits. Every rank blocks on its own
list keys.group_next (in Redis, not in a collective: MLX's ring backend spins a core while it
waits). The dispatcher claims an idle group by deleting the idle key and pushing the job id to
every rank's list in one script; rank 0 retires the group the same way, so a group never gets a
job after it retired, nor two at once, and every rank sees the same words in the same order. An
empty word asks the group to retire.

Batching (RINGQ_MAX_BATCH > 1): `join` pushes a job to a busy group the same way while
keys.group_batch holds fewer than the limit; its ranks take such words between decode steps
(`joined`). The batch is also the list of jobs the reconciler retries when the group is lost.

Memory: keys.group_batch_buffer models the batch's KV buffer (ring_worker/engine/batch_cache.py)
at its largest, since a shrunk buffer may grow back: the first job records its row (`started`),
and each `join` grows the group's reservation on every node, in the same script, to the whole
buffer after the join (every row at the longest row's length, admission.estimate
`batch_buffer_tokens`), or refuses the job when a node's budget cannot hold that. The bytes come
back when the last job of the batch leaves (`ended`)."""

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import redis

from admission.estimate import CACHE_STEP_TOKENS, BatchRow, batch_buffer_tokens
from jobs import keys
from jobs.errors import JobNotFoundError
from jobs.memory_waits import wake_admissions
from jobs.once import once, once_arg
from jobs.schemas import GroupSpec, JobKind, WarmGroup
from jobs.store import JobStore

log = logging.getLogger(__name__)
IDLE_KEY_TTL_S = 5
RANK_GRACE_S = 30.0  # ranks other than 0 wait this much longer than the idle time
RETIRE = ""  # pushed instead of a job id: retire now
JOIN_TAKE_MAX = 64  # jobs a busy group takes between two decode steps, at most
JoinOutcome = Literal["joined", "no-memory", "no"]


@dataclass(frozen=True)
class BatchBuffer:
    """keys.group_batch_buffer: the rows and positions per row the batch's KV buffer may grow
    to, and the bytes the joins added to the group's reservation for it."""

    slots: int
    tokens: int
    bytes: int


# KEYS: idle, then each rank's list. ARGV: word. Claims the group if it is idle.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[1]) end
return 1
"""
# KEYS: batch hash, buffer hash. ARGV: job id, its row's positions, its answer's. A job starts
# on the group (the first of its batch, or one that joined: already there): its row is in the
# buffer ('tokens': the longest row, 'answer': the longest answer).
_START = """
if redis.call('HSETNX', KEYS[1], ARGV[1], 0) == 0 then return 0 end
local slots = tonumber(redis.call('HGET', KEYS[2], 'slots') or 0)
local tokens = tonumber(redis.call('HGET', KEYS[2], 'tokens') or 0)
local answer = tonumber(redis.call('HGET', KEYS[2], 'answer') or 0)
local rows = redis.call('HLEN', KEYS[1])
if rows > slots then slots = math.max(rows, 2 * slots) end
tokens = math.max(tokens, tonumber(ARGV[2]))
answer = math.max(answer, tonumber(ARGV[3]))
redis.call('HSET', KEYS[2], 'slots', slots, 'tokens', tokens, 'answer', answer)
return 1
"""
# KEYS: idle, warm index, batch hash, buffer hash, each node's reserved hash (ARGV[7] of them),
# then each rank's list. ARGV: group id, job id, max batch, the job's own row's bytes, its row's
# positions and its answer's, node count, the buffer's growth step (positions), then each node's
# capacity. A busy group (offered, not idle, not retired) takes one more job while its batch has
# room and every node's reservations (expired leases too: conservative) can grow to hold the
# buffer after the join: as many rows as batch_cache.py then allocates (doubling), each of the
# longest row's positions plus the longest answer's, at the job's bytes per position.
_JOIN = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
local rows = redis.call('HLEN', KEYS[3]) + 1
if rows > tonumber(ARGV[3]) then return 0 end
local slots = tonumber(redis.call('HGET', KEYS[4], 'slots') or 0)
local tokens = tonumber(redis.call('HGET', KEYS[4], 'tokens') or 0)
local held = tonumber(redis.call('HGET', KEYS[4], 'bytes') or 0)
local answer = tonumber(redis.call('HGET', KEYS[4], 'answer') or 0)
local row_bytes, row_tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
if rows > slots then slots = math.max(rows, 2 * slots) end
tokens = math.max(tokens, row_tokens)
answer = math.max(answer, tonumber(ARGV[6]))
local per_token = 0
local step = tonumber(ARGV[8])
if row_tokens > 0 then per_token = row_bytes / (math.ceil(row_tokens / step) * step) end
local positions = math.ceil((tokens + answer) / step) * step
local grow = math.max(0, math.ceil(slots * positions * per_token) - held)
local nodes = tonumber(ARGV[7])
for i = 1, nodes do
  local reserved = KEYS[4 + i]
  if redis.call('HEXISTS', reserved, ARGV[1]) == 0 then return 0 end
  local used = 0
  for _, bytes in ipairs(redis.call('HVALS', reserved)) do used = used + tonumber(bytes) end
  if used + grow > tonumber(ARGV[8 + i]) then return -1 end
end
for i = 1, nodes do redis.call('HINCRBY', KEYS[4 + i], ARGV[1], grow) end
redis.call('HSET', KEYS[3], ARGV[2], grow)
redis.call('HSET', KEYS[4], 'slots', slots, 'tokens', tokens, 'answer', answer, 'bytes',
  held + grow)
for i = 5 + nodes, #KEYS do redis.call('RPUSH', KEYS[i], ARGV[2]) end
return 1
"""
# KEYS: batch hash, buffer hash, then each node's reserved hash. ARGV: group id, job id. A job
# leaves the batch; when it was the last, the buffer is dropped (ring_worker/engine/batch_decode.py)
# and the bytes the joins added come off the group's reservation (if it still holds one).
_LEAVE = """
redis.call('HDEL', KEYS[1], ARGV[2])
if redis.call('HLEN', KEYS[1]) > 0 then return 0 end
local held = tonumber(redis.call('HGET', KEYS[2], 'bytes') or 0)
redis.call('DEL', KEYS[2])
if held > 0 then
  for i = 3, #KEYS do
    if redis.call('HEXISTS', KEYS[i], ARGV[1]) == 1 then
      redis.call('HINCRBY', KEYS[i], ARGV[1], -held)
    end
  end
end
return held
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
        self._claim = conn.register_script(once(_CLAIM))
        self._refresh = conn.register_script(_REFRESH)
        self._retire = conn.register_script(once(_RETIRE))
        self._start = conn.register_script(_START)
        self._join = conn.register_script(once(_JOIN))
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
        return bool(self._claim(keys=keys_, args=[job_id, once_arg()]))

    def join(
        self,
        group: GroupSpec,
        job_id: str,
        max_batch: int,
        grow_bytes: int = 0,
        capacity_bytes: dict[str, int] | None = None,
        row: BatchRow | None = None,
    ) -> JoinOutcome:
        """Hand a job to a busy group whose batch holds fewer than `max_batch` jobs; it joins at
        the group's next decode step. `grow_bytes` is the job's own row, `row` its positions (read
        from its record if not given). With `capacity_bytes` (node -> budget), the group's
        reservation grows in the same step to hold the batch's buffer after the join, or the job is
        refused ("no-memory"). Else "no": idle, full, retired, or holding no reservation."""
        if row is None:
            row = self.batch_row(job_id)
        nodes = sorted(set(group.nodes)) if capacity_bytes is not None else []
        keys_ = [idle_key(group.group_id), keys.WARM_GROUPS, batch_key(group.group_id)]
        keys_ += [keys.group_batch_buffer(group.group_id)]
        keys_ += [keys.node_reserved(n) for n in nodes]
        args: list[str | int] = [group.group_id, job_id, max_batch, grow_bytes, row.tokens]
        args += [row.answer_tokens, len(nodes), CACHE_STEP_TOKENS]
        args += [(capacity_bytes or {})[n] for n in nodes] + [once_arg()]
        outcome = int(self._join(keys=[*keys_, *next_keys(group)], args=args))
        return "joined" if outcome == 1 else "no-memory" if outcome == -1 else "no"

    def batch_row(self, job_id: str) -> BatchRow:
        """The job's row of a decode batch (no positions when its record or tokens are gone:
        it then adds no length to the buffer)."""
        store = JobStore(self.conn)
        try:
            spec, prompt = store.get(job_id).spec, len(store.get_tokens(job_id))
        except JobNotFoundError:
            return BatchRow(0, 0)
        return BatchRow(prompt, spec.max_tokens if spec.kind == JobKind.GENERATE else 0)

    def buffer(self, group_id: str) -> BatchBuffer:
        """The batch's KV buffer as the reservation counts it (empty when no job runs)."""
        raw = {
            _text(k): int(v)
            for k, v in self.conn.hgetall(keys.group_batch_buffer(group_id)).items()
        }
        tokens = batch_buffer_tokens(raw.get("tokens", 0), raw.get("answer", 0))
        return BatchBuffer(raw.get("slots", 0), tokens, raw.get("bytes", 0))

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

    def started(self, group: GroupSpec, job_id: str, row: BatchRow | None = None) -> None:
        """As a job starts (the dispatcher, then its rank 0): it is in the group's batch, and
        its row (read from its record if not given) in the batch's buffer. A job that joined
        is there already."""
        batch, buffer = batch_key(group.group_id), keys.group_batch_buffer(group.group_id)
        if self.conn.hexists(batch, job_id):
            return
        if row is None:
            row = self.batch_row(job_id)
        self._start(keys=[batch, buffer], args=[job_id, row.tokens, row.answer_tokens])

    def ended(self, group: GroupSpec, job_id: str) -> None:
        """Rank 0, as a job leaves the batch (finished, cancelled, failed or skipped); the last
        to leave gives back the bytes the joins added to the group's reservation."""
        nodes = sorted(set(group.nodes))
        keys_ = [batch_key(group.group_id), keys.group_batch_buffer(group.group_id)]
        keys_ += [keys.node_reserved(n) for n in nodes]
        self._leave(keys=keys_, args=[group.group_id, job_id])
        wake_admissions(self.conn)  # a row is free: the head may join

    def joined(
        self,
        group: GroupSpec,
        rank: int,
        agree: Callable[[int], int],
    ) -> list[str]:
        """Between decode steps, every rank: the jobs handed to the group since, the same on every
        rank. Rank 0 takes what its list holds; `agree` (a collective) tells the others how many
        words to take from theirs (pushed there in the same order by the same script)."""
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
        claimable = False
        while True:
            if rank == 0:
                self._refresh(keys=[idle, own], args=[IDLE_KEY_TTL_S])
                if not claimable:  # the head may take it now, not at its next try
                    wake_admissions(self.conn)
                    claimable = True
            popped = self.conn.blpop([own], timeout=1)
            kick()
            word: bytes | str | None = popped[1] if popped is not None else None
            if word is None and time.monotonic() >= give_up:
                if rank != 0:
                    return None
                keys_ = [idle, keys.WARM_GROUPS, *next_keys(group)]
                word = self._retire(keys=keys_, args=[group.group_id, once_arg()])
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
