"""The web dashboard: one HTML page, a small script and a style sheet, all served from the
package (cli/http/static/, no CDN), and the JSON it polls:

    GET /api/overview           nodes (device, budget, reserved), groups running and warm, queues
    GET /api/batches?limit=     batches, newest first, with their counts and OpenAI status
    GET /api/batches/{id}

The page itself is `/` (lists) and `/jobs/{id}` (one job: timeline, progress, result)."""

from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from cli.http.batch_objects import batch_object
from cli.http.batch_objects import load as load_openai_batch
from cli.http.deps import Config, Conn
from cli.http.tenants import Caller, Tenant, check_batch, check_job, visible_batch_ids
from jobs import keys
from jobs.batch import batch_counts, get_batch
from jobs.errors import JobNotFoundError
from jobs.listing import list_batches
from jobs.overview import queue_rows, reserved_per_node
from jobs.schemas import GroupSpec, TrackedGroup
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.warm_groups import WarmGroups

STATIC_DIR = Path(__file__).parent / "static"
router = APIRouter()


@router.get("/", include_in_schema=False)
@router.get("/jobs/{job_id}", include_in_schema=False)
def page(job_id: str | None = None) -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/api/overview")
def overview(conn: Conn, tenant: Caller) -> dict[str, Any]:
    """Nodes and queues are everyone's; a tenant sees the groups running its own jobs."""
    nodes = JobStore(conn).live_nodes()
    reserved = reserved_per_node(conn, [n.name for n in nodes])
    idle = WarmGroups(conn).idle_groups()
    idle_ids = {warm.group.group_id for warm in idle}
    running = [g for g in running_groups(conn) if g["group_id"] not in idle_ids]
    warm = [
        {**_group_json(w.group), "bytes_per_node": w.bytes_per_node, "state": "warm"} for w in idle
    ]
    return {
        "nodes": [{**n.model_dump(mode="json"), "reserved_bytes": reserved[n.name]} for n in nodes],
        "running_groups": _own_groups(conn, tenant, running),
        "warm_groups": _own_groups(conn, tenant, warm),
        "queues": [q.model_dump(mode="json") for q in queue_rows(conn)],
    }


@router.get("/api/batches")
def batches(
    conn: Conn, settings: Config, tenant: Caller, limit: Annotated[int, Query(ge=1, le=1000)] = 20
) -> dict[str, Any]:
    if tenant.admin:
        ids = [row.id for row in list_batches(conn, limit)]
    else:
        ids = visible_batch_ids(conn, tenant, [_text(i) for i in conn.zrevrange(
            keys.tenant_batches(tenant.id or ""), 0, limit - 1)])  # fmt: skip
    rows = [batch_json(conn, batch_id, settings) for batch_id in ids]
    return {"object": "list", "data": [row for row in rows if row is not None]}


@router.get("/api/batches/{batch_id}")
def batch(batch_id: str, conn: Conn, settings: Config, tenant: Caller) -> dict[str, Any]:
    check_batch(conn, tenant, batch_id)
    found = batch_json(conn, batch_id, settings)
    if found is None:
        raise JobNotFoundError(f"no batch {batch_id!r} (it never existed or its record expired)")
    return found


def batch_json(conn: redis.Redis, batch_id: str, settings: Settings) -> dict[str, Any] | None:
    """A ringq batch with its counts, and its OpenAI status when it came through /v1/batches."""
    try:
        record = get_batch(conn, batch_id)
    except JobNotFoundError:
        return None
    counts = batch_counts(conn, record)
    try:
        openai_status = batch_object(conn, load_openai_batch(conn, batch_id), settings)["status"]
    except JobNotFoundError:
        openai_status = None
    return {
        "id": record.id,
        "input_name": record.input_name,
        "created_at": record.created_at,
        "counts": {**vars(counts), "done": counts.done},
        "openai_status": openai_status,
    }


def _own_groups(
    conn: redis.Redis, tenant: Tenant, groups: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    if tenant.admin:
        return groups
    owned = []
    for group in groups:
        try:
            check_job(conn, tenant, group["job_id"])
        except JobNotFoundError:
            continue
        owned.append(group)
    return owned


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def running_groups(conn: redis.Redis) -> list[dict[str, Any]]:
    rows = []
    for raw in conn.hgetall(keys.GROUPS_INDEX).values():
        entry = TrackedGroup.model_validate_json(raw)
        rows.append(
            {**_group_json(entry.group), "admitted_at": entry.admitted_at, "state": "running"}
        )
    return sorted(rows, key=lambda row: row["admitted_at"])


def _group_json(group: GroupSpec) -> dict[str, Any]:
    return {
        "group_id": group.group_id,
        "job_id": group.job_id,
        "model": group.model,
        "strategy": group.strategy,
        "nodes": group.nodes,
        "devices": group.devices,
        "kv_layout": group.kv_layout,
    }
