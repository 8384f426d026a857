"""Job records in Redis: one hash per job, JSON fields, state changes checked and atomic.

The document is a field of its own (DOCUMENT_FIELD), not part of the stored spec: the transition
to a final state deletes it in the same transaction (jobs/cancel.py's script does too), so Redis
holds the documents of unfinished jobs only. Nothing reads a final job's document: retries go
back to queued before any final state, and every view shows the spec without it."""

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from jobs import keys
from jobs.errors import (
    CorruptRecordError,
    IllegalTransitionError,
    InvalidJobError,
    JobNotFoundError,
    StaleGroupError,
)
from jobs.lifecycle import JobState, can_transition
from jobs.schemas import DROPPED_DOCUMENT, JobRecord, JobResult, JobSpec, NodeInfo, Progress
from jobs.settings import get_settings

SUMMARY_FIELD = "summary"  # small spec fields for listings (summary_fields), not a JobRecord field
DOCUMENT_FIELD = "document"  # the spec's document (JSON string) until the job is final
# A final job's prompt tokens live this long (ranks winding down may still read them), unless it
# kept its KV (`keep_cache`): `cache_from` jobs read the tokens of the prefill they start from.
FINAL_TOKENS_TTL_S = 60
# The transaction that last wrote the record (not a JobRecord field). A connection lost during
# EXEC reaches the caller as a WatchError (redis-py: the watch died with it), though the server
# may have applied it: the retry finds its own token here and stops, instead of taking its own
# write for another's (a Redis restarted under queued jobs failed one with "admitted -> admitted
# is not allowed").
WRITE_FIELD = "write"
ORDER_STEP_S = 1e-6  # created_at apart, in order, of the records written together
NOT_RECORD_FIELDS = frozenset({SUMMARY_FIELD, WRITE_FIELD, DOCUMENT_FIELD})
UNFINISHED_ENDS = frozenset({JobState.FAILED, JobState.CANCELLED})  # final, but not finished


class JobStore:
    def __init__(self, conn: redis.Redis, job_ttl_s: int | None = None):
        """`job_ttl_s`: how long records, tokens and flags live; default RINGQ_JOB_TTL_S (read
        here, once, so that no caller can forget it)."""
        self.conn = conn
        self.job_ttl_s = job_ttl_s if job_ttl_s is not None else get_settings().job_ttl_s

    def create(self, job_id: str, spec: JobSpec, write: str | None = None) -> JobRecord:
        """One transaction (WATCH the key, check it is free, MULTI/EXEC the writes): either the
        whole record is written or none of it (a refused write aborts them all). `write`: its
        token (WRITE_FIELD; a fresh one by default)."""
        key, write = keys.job(job_id), write or new_write()
        with self.conn.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    if pipe.exists(key):
                        if _written_by(pipe.hget(key, WRITE_FIELD), write):
                            return self.get(job_id)  # this call's own write, applied
                        raise InvalidJobError(
                            f"a job with id {job_id!r} already exists; choose another id", "id"
                        )
                    pipe.multi()
                    [record] = self.create_in(pipe, [(job_id, spec)], time.time(), write)
                    pipe.execute()
                    return record
                except redis.WatchError:
                    continue

    def create_in(
        self,
        pipe: redis.client.Pipeline,
        jobs: Sequence[tuple[str, JobSpec]],
        now: float,
        write: str | None = None,
    ) -> list[JobRecord]:
        """Queue the writes of new records on `pipe` without checking the ids are free: for
        callers that own their ids (a batch derives them from its own, claimed id). `write`:
        the transaction's token (WRITE_FIELD). Their created_at runs from `now` in steps of
        ORDER_STEP_S, in the order given: the queue order (jobs/memory_waits.py) is by
        created_at, and equal ones would fall back to the ids, which are random."""
        records = [
            _new_record(job_id, spec, now + i * ORDER_STEP_S)
            for i, (job_id, spec) in enumerate(jobs)
        ]
        for record in records:
            fields = stored_fields(record)
            if write is not None:
                fields[WRITE_FIELD] = write
            pipe.hset(keys.job(record.id), mapping=_encode(fields))
            pipe.expire(keys.job(record.id), self.job_ttl_s)
        if records:
            order = {record.id: record.created_at for record in records}
            pipe.zadd(keys.JOBS_INDEX, order)
            pipe.zadd(keys.jobs_in_state(JobState.QUEUED), order)
        return records

    def get(self, job_id: str) -> JobRecord:
        raw = self.conn.hgetall(keys.job(job_id))
        if not raw:
            raise JobNotFoundError(f"no job {job_id!r} (it never existed or its record expired)")
        try:
            fields = _decode(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CorruptRecordError(
                f"job {job_id!r}: its record in Redis is not valid JSON"
            ) from None
        spec = fields.get("spec")
        if isinstance(spec, dict):  # else the record is corrupt: validation says how
            if DOCUMENT_FIELD in fields:  # records from before keep it in the spec
                spec["document"] = fields[DOCUMENT_FIELD]
            if fields.get("document_dropped"):
                spec["document"] = DROPPED_DOCUMENT
        return JobRecord.model_validate(
            {k: v for k, v in fields.items() if k not in NOT_RECORD_FIELDS}
        )

    def transition(
        self,
        job_id: str,
        new: JobState,
        *,
        group_id: str | None = None,
        also: Callable[[redis.client.Pipeline], object] | None = None,
        write: str | None = None,
        **fields: Any,
    ) -> JobRecord:
        """Move a job to `new` if the lifecycle allows it, writing `fields` in the same step.
        With `group_id`, only while the job is still placed on that group (StaleGroupError
        otherwise): a lost group's ranks can never touch the job's retry. `also` adds writes
        to the same transaction. `write`: this transition's token (WRITE_FIELD; a fresh one by
        default): a retry that finds it has nothing left to do."""
        key, write = keys.job(job_id), write or new_write()
        with self.conn.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw_state, raw_placement, raw_created, raw_write = pipe.hmget(
                        key, ["state", "placement", "created_at", WRITE_FIELD]
                    )
                    holds_document = new.is_final and pipe.hexists(key, DOCUMENT_FIELD)
                    drops_tokens = new.is_final and not _keeps_cache(pipe.hget(key, "spec"))
                    if raw_state is None:
                        raise JobNotFoundError(f"no job {job_id!r}")
                    if _written_by(raw_write, write):
                        break  # applied before the connection went (see WRITE_FIELD)
                    old = JobState(json.loads(raw_state))
                    if group_id is not None:
                        _check_group(job_id, raw_placement, group_id)
                    if not can_transition(old, new):
                        raise IllegalTransitionError(f"job {job_id}: {old} -> {new} is not allowed")
                    pipe.multi()
                    written = {"state": new, "updated_at": time.time(), WRITE_FIELD: write}
                    pipe.hset(key, mapping=_encode(written))
                    if fields:
                        pipe.hset(key, mapping=_encode(_dump(fields)))
                    if holds_document:
                        pipe.hdel(key, DOCUMENT_FIELD)
                        pipe.hset(key, "document_dropped", json.dumps(True))
                    if drops_tokens:
                        pipe.expire(keys.job_tokens(job_id), FINAL_TOKENS_TTL_S)
                    move_in_state_index(pipe, job_id, old, new, json.loads(raw_created or "0"))
                    if also is not None:
                        also(pipe)
                    pipe.execute()
                    break
                except redis.WatchError:
                    continue
        return self.get(job_id)

    def end(
        self,
        job_id: str,
        state: JobState,
        reason: str,
        *,
        group_id: str | None = None,
        partial: JobResult | None = None,
    ) -> bool:
        """Fail or cancel a job (`state`), `reason` its error and `partial` what it had produced,
        unless it is already final (or, with `group_id`, no longer placed on that group).
        Returns whether this call ended it."""
        if state not in UNFINISHED_ENDS:
            raise ValueError(f"end() fails or cancels a job, not {state}")
        fields: dict[str, Any] = {} if partial is None else {"result": partial}
        try:
            progress = _phase(self.get(job_id), state)
            self.transition(
                job_id, state, group_id=group_id, error=reason, progress=progress, **fields
            )
            return True
        except (IllegalTransitionError, JobNotFoundError, StaleGroupError):
            return False

    def fail(self, job_id: str, reason: str) -> bool:
        """Fail a job unless it is already final. Returns whether this call failed it."""
        return self.end(job_id, JobState.FAILED, reason)

    def set_waiting(self, job_id: str, reason: str) -> None:
        self.conn.hset(keys.job(job_id), "waiting_reason", json.dumps(reason))

    def set_progress(self, job_id: str, progress: Progress, group_id: str | None = None) -> None:
        """Write progress; with `group_id`, only while the job is placed on that group."""
        if group_id is None:
            self.conn.hset(keys.job(job_id), "progress", progress.model_dump_json())
            return
        key = keys.job(job_id)
        with self.conn.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(key)
                    _check_group(job_id, pipe.hget(key, "placement"), group_id)
                    pipe.multi()
                    pipe.hset(key, "progress", progress.model_dump_json())
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def set_tokens(self, job_id: str, tokens: list[int]) -> None:
        """The prompt's tokens, kept while the job runs (FINAL_TOKENS_TTL_S after it ends)."""
        self.conn.set(keys.job_tokens(job_id), json.dumps(tokens), ex=self.job_ttl_s)

    def get_tokens(self, job_id: str) -> list[int]:
        raw = self.conn.get(keys.job_tokens(job_id))
        if raw is None:
            raise JobNotFoundError(f"job {job_id!r} has no tokens (not admitted yet?)")
        return json.loads(raw)

    def live_nodes(self) -> list[NodeInfo]:
        names = sorted(_text(n) for n in self.conn.smembers(keys.NODES_INDEX))
        raw = self.conn.mget([keys.node(n) for n in names]) if names else []
        return [NodeInfo.model_validate_json(r) for r in raw if r is not None]

    def put_node(self, node: NodeInfo, ttl_s: float) -> None:
        with self.conn.pipeline() as pipe:
            pipe.sadd(keys.NODES_INDEX, node.name)
            pipe.set(keys.node(node.name), node.model_dump_json(), px=int(ttl_s * 1000))
            pipe.execute()

    def remove_node(self, name: str) -> None:
        self.conn.delete(keys.node(name))


def move_in_state_index(
    pipe: redis.client.Pipeline, job_id: str, old: JobState, new: JobState, created_at: float
) -> None:
    """Keep the per-state indexes (jobs/listing.py) in the transaction of a state change."""
    pipe.zrem(keys.jobs_in_state(old), job_id)
    pipe.zadd(keys.jobs_in_state(new), {job_id: created_at})


def stored_fields(record: JobRecord) -> dict[str, Any]:
    """A new record's hash fields: the spec without its document, the document apart."""
    fields = record.model_dump(mode="json")
    fields[DOCUMENT_FIELD] = fields["spec"].pop("document")
    return {**fields, SUMMARY_FIELD: summary_fields(record.spec)}


def summary_fields(spec: JobSpec) -> dict[str, Any]:
    """What a job list shows of the spec, stored apart so a list never reads the document."""
    return {
        "model": spec.model,
        "document_name": spec.document_name,
        "custom_id": spec.custom_id,
        "max_tokens": spec.max_tokens,
    }


def _check_group(job_id: str, raw_placement: bytes | str | None, group_id: str) -> None:
    placement = json.loads(raw_placement) if raw_placement is not None else None
    current = placement.get("group_id") if isinstance(placement, dict) else None
    if current != group_id:
        raise StaleGroupError(
            f"job {job_id} is no longer placed on group {group_id} (now: {current or 'none'})"
        )


def _new_record(job_id: str, spec: JobSpec, now: float) -> JobRecord:
    return JobRecord(
        id=job_id,
        kind=spec.kind,
        state=JobState.QUEUED,
        spec=spec,
        progress=Progress(phase=JobState.QUEUED, updated_at=now),
        created_at=now,
        updated_at=now,
        document_chars=len(spec.document),
    )


def _phase(record: JobRecord, phase: JobState) -> Progress:
    return record.progress.model_copy(update={"phase": phase, "updated_at": time.time()})


def _dump(fields: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()
    }


def new_write() -> str:
    """A token for one write transaction of a job record (WRITE_FIELD)."""
    return uuid.uuid4().hex


def _written_by(raw: bytes | str | None, write: str) -> bool:
    return raw is not None and json.loads(raw) == write


def _encode(fields: dict[str, Any]) -> dict[Any, Any]:  # redis-py's mapping type is invariant
    return {k: json.dumps(v) for k, v in fields.items()}


def _decode(raw: dict[Any, Any]) -> dict[str, Any]:
    return {_text(k): json.loads(v) for k, v in raw.items()}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _keeps_cache(raw_spec: bytes | str | None) -> bool:
    return bool(raw_spec and json.loads(raw_spec).get("keep_cache"))
