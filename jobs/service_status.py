"""What `ringq up`'s supervisor says about each of its services, kept in Redis for `ringq top`."""

import time
from enum import StrEnum

import redis
from pydantic import BaseModel, ConfigDict

from jobs import keys


class ServiceState(StrEnum):
    RUNNING = "running"
    RESTARTING = "restarting"  # exited; started again after its backoff
    STOPPED = "stopped"  # crash loop: left stopped until `ringq up` starts again


class ServiceStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str  # "redis", "dispatcher", a node name
    state: ServiceState
    pid: int | None
    restarts: int = 0
    last_restart_at: float | None = None  # unix s
    last_exit_code: int | None = None
    log_path: str = ""
    updated_at: float = 0.0


def write_service_status(conn: redis.Redis, status: ServiceStatus) -> None:
    stamped = status.model_copy(update={"updated_at": time.time()})
    conn.hset(keys.SERVICES, status.label, stamped.model_dump_json())


def read_service_statuses(conn: redis.Redis) -> list[ServiceStatus]:
    """Every service `ringq up` has reported, by label."""
    raw = conn.hgetall(keys.SERVICES)
    found = [ServiceStatus.model_validate_json(value) for value in raw.values()]
    return sorted(found, key=lambda s: s.label)


def clear_service_statuses(conn: redis.Redis) -> None:
    conn.delete(keys.SERVICES)
