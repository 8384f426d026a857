"""API keys as tenants. Each key of RINGQ_API_KEYS owns the files, batches and jobs it creates
and sees only those (another's answer 404, as if they did not exist); each key of
RINGQ_ADMIN_KEYS sees everything. Without keys (loopback only) the one user sees everything.
What the CLI and the Python client create (straight to Redis) belongs to no tenant: only admin
keys see it over HTTP.

A tenant is named by a digest of its key, so Redis never holds a key."""

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import redis
from fastapi import Depends, Request

from jobs import keys
from jobs.errors import JobNotFoundError
from jobs.lifecycle import JobState
from jobs.listing import JobSummary, summaries


@dataclass(frozen=True)
class Tenant:
    id: str | None  # None: no keys are set, one user
    admin: bool

    def sees(self, owner: str | None) -> bool:
        return self.admin or self.id is None or owner == self.id


EVERYONE = Tenant(None, admin=True)


def tenant_of(key: str, admin: bool) -> Tenant:
    return Tenant("t" + hashlib.sha256(key.encode()).hexdigest()[:24], admin)


def caller(request: Request) -> Tenant:
    return getattr(request.state, "tenant", EVERYONE)


Caller = Annotated[Tenant, Depends(caller)]


def own_jobs(conn: redis.Redis, tenant: Tenant, job_ids: Sequence[str], ttl_s: int) -> None:
    """Record `job_ids` as the tenant's (nothing to record without keys); the index expires
    with the newest of them."""
    if tenant.id is not None and job_ids:
        _own(conn, keys.tenant_jobs(tenant.id), job_ids, ttl_s)


def own_batch(conn: redis.Redis, tenant: Tenant, batch_id: str, ttl_s: int) -> None:
    if tenant.id is not None:
        _own(conn, keys.tenant_batches(tenant.id), [batch_id], ttl_s)


def _own(conn: redis.Redis, index: str, ids: Sequence[str], ttl_s: int) -> None:
    now = time.time()
    with conn.pipeline() as pipe:
        pipe.zadd(index, dict.fromkeys(ids, now))
        pipe.zremrangebyscore(index, 0, now - ttl_s)  # expired with their records
        pipe.expire(index, ttl_s)
        pipe.execute()


def check_job(conn: redis.Redis, tenant: Tenant, job_id: str) -> None:
    """JobNotFoundError for a job the tenant may not see, worded as for a job that is not."""
    if tenant.admin or tenant.id is None:
        return
    if conn.zscore(keys.tenant_jobs(tenant.id), job_id) is None:
        raise JobNotFoundError(f"no job {job_id!r} (it never existed or it expired)")


def check_batch(conn: redis.Redis, tenant: Tenant, batch_id: str) -> None:
    if tenant.admin or tenant.id is None:
        return
    if conn.zscore(keys.tenant_batches(tenant.id), batch_id) is None:
        raise JobNotFoundError(f"no batch {batch_id!r} (it never existed or it expired)")


def visible_batch_ids(conn: redis.Redis, tenant: Tenant, batch_ids: Sequence[str]) -> list[str]:
    if tenant.admin or tenant.id is None:
        return list(batch_ids)
    index = keys.tenant_batches(tenant.id)
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.zscore(index, batch_id)
        scores = pipe.execute()
    return [b for b, score in zip(batch_ids, scores, strict=True) if score is not None]


def tenant_jobs(
    conn: redis.Redis, tenant_id: str, wanted: JobState | None, limit: int
) -> list[JobSummary]:
    """The tenant's newest `limit` jobs (of one state when given)."""
    index = keys.tenant_jobs(tenant_id)
    found: list[JobSummary] = []
    start = 0
    while len(found) < limit:
        ids = [_text(i) for i in conn.zrevrange(index, start, start + max(limit, 100) - 1)]
        if not ids:
            break
        found += summaries(conn, ids, wanted, None)
        start += len(ids)
    return found[:limit]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
