"""Cancelling jobs. A job that has not started ends `cancelled` at once; a running one gets a
flag in Redis that its ranks poll, and they stop together at the next chunk or decode step."""

import json
import time
from collections.abc import Iterable, Sequence
from string import Template

import redis

from jobs import keys
from jobs.errors import IllegalTransitionError
from jobs.lifecycle import FINAL_STATES, JobState
from jobs.once import once, once_arg
from jobs.schemas import JobRecord, JobResult
from jobs.store import DOCUMENT_FIELD, FINAL_TOKENS_TTL_S, JobStore

NOT_STARTED = frozenset({JobState.QUEUED, JobState.ADMITTED})
NOT_STARTED_REASON = "cancelled before it started"
_NOT_STARTED_ORDER = tuple(sorted(NOT_STARTED))  # as _CANCEL_MANY takes their state indexes


def _lua_state(state: JobState) -> str:
    """A Lua string literal of `state` as the job hash stores it (JSON)."""
    return f"'{json.dumps(state.value)}'"


def _lua_state_table(states: Iterable[JobState], value: str = "true") -> str:
    """A Lua table whose keys are `states` as stored; `value` may name the 1-based position."""
    pairs = (f"[{_lua_state(s)}] = {value.format(i)}" for i, s in enumerate(states, 1))
    return "{" + ", ".join(pairs) + "}"


# KEYS: n job hashes, then their n cancel flags, then the state indexes of the not-started states
# (_NOT_STARTED_ORDER) and of cancelled jobs. ARGV: now, flag ttl, reason (JSON), the n job ids.
# What cancel_job does, for many jobs in one round trip: the flag, and a not-started job
# cancelled (moved between state indexes like a transition, its document dropped and its tokens
# left to expire as JobStore.transition does). The state names come from JobState.
_CANCEL_MANY = Template("""
local now, ttl, reason = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local final_states, not_started_index = $final_states, $not_started_index
local n = (#KEYS - $index_keys) / 2
local cancelled_index = KEYS[#KEYS]
local cancelled, stopping, final = 0, 0, 0
for i = 1, n do
  local job, flag = KEYS[i], KEYS[n + i]
  local state = redis.call('HGET', job, 'state')
  if not state or final_states[state] then
    final = final + 1
  else
    redis.call('SET', flag, now, 'EX', ttl)
    if not_started_index[state] then
      local progress = cjson.decode(redis.call('HGET', job, 'progress'))
      progress['phase'] = '$cancelled'
      progress['updated_at'] = tonumber(now)
      redis.call('HSET', job, 'state', $cancelled_stored, 'error', reason, 'updated_at', now,
                 'progress', cjson.encode(progress))
      if redis.call('HDEL', job, '$document') == 1 then
        redis.call('HSET', job, 'document_dropped', 'true')
      end
      redis.call('EXPIRE', job .. '$tokens_suffix', $tokens_ttl)
      local id = ARGV[3 + i]
      redis.call('ZREM', KEYS[2 * n + not_started_index[state]], id)
      redis.call('ZADD', cancelled_index, tonumber(redis.call('HGET', job, 'created_at')), id)
      cancelled = cancelled + 1
    else
      stopping = stopping + 1
    end
  end
end
return {cancelled, stopping, final}
""").substitute(
    final_states=_lua_state_table(sorted(FINAL_STATES)),
    not_started_index=_lua_state_table(_NOT_STARTED_ORDER, "{}"),
    index_keys=len(_NOT_STARTED_ORDER) + 1,
    cancelled=JobState.CANCELLED.value,
    cancelled_stored=_lua_state(JobState.CANCELLED),
    document=DOCUMENT_FIELD,
    tokens_ttl=FINAL_TOKENS_TTL_S,
    tokens_suffix=keys.job_tokens("").removeprefix(keys.job("")),  # the job key's tokens key
)


def cancel_job(store: JobStore, job_id: str) -> JobRecord:
    """Ask a live job to stop; returns its record (`cancelled`, or still running while its ranks
    wind down). The flag is set before any state change, so a rank that sees the job cancelled
    also sees the flag; it lives as long as the store's records (its job_ttl_s)."""
    record = store.get(job_id)
    if record.state.is_final:
        raise IllegalTransitionError(
            f"job {job_id} is already {record.state}; only queued or running jobs can be cancelled"
        )
    store.conn.set(keys.job_cancel(job_id), str(time.time()), ex=store.job_ttl_s)
    if record.state in NOT_STARTED:
        # The dispatcher skips jobs that are no longer queued; ranks already started for an
        # admitted job see the flag at startup and exit together.
        mark_cancelled(store, job_id, NOT_STARTED_REASON)
    return store.get(job_id)


def cancel_requested(conn: redis.Redis, job_id: str) -> bool:
    return bool(conn.exists(keys.job_cancel(job_id)))


def mark_cancelled(
    store: JobStore, job_id: str, reason: str, partial: JobResult | None = None
) -> bool:
    """Move a job to `cancelled` unless it is already final, keeping what it had generated
    (`partial`) as its result. Returns whether this call did."""
    return store.end(job_id, JobState.CANCELLED, reason, partial=partial)


def cancel_many(
    conn: redis.Redis, job_ids: Sequence[str], ttl_s: int, chunk_jobs: int = 1000
) -> tuple[int, int, int]:
    """cancel_job for many jobs, a script call per `chunk_jobs`. Returns how many were cancelled
    at once, how many are stopping (running: their ranks see the flag), how many were final."""
    script = conn.register_script(once(_CANCEL_MANY))
    totals = [0, 0, 0]
    for start in range(0, len(job_ids), chunk_jobs):
        chunk = job_ids[start : start + chunk_jobs]
        job_keys = [keys.job(j) for j in chunk] + [keys.job_cancel(j) for j in chunk]
        job_keys += [keys.jobs_in_state(s) for s in (*_NOT_STARTED_ORDER, JobState.CANCELLED)]
        args: list[str | int] = [str(time.time()), ttl_s, json.dumps(NOT_STARTED_REASON), *chunk]
        args.append(once_arg())
        counts = script(keys=job_keys, args=args)
        totals = [t + int(c) for t, c in zip(totals, counts, strict=True)]
    return totals[0], totals[1], totals[2]
