"""TEMPORARY until h-client's jobs/listing.py is merged: the same two functions by scanning."""

import json
from typing import Any

import redis

from cli.http.job_views import read_views
from jobs import keys
from jobs.batch import get_batch

MAX_LIMIT = 10_000


class _Row:
    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def model_dump(self, mode: str = "json") -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "view"} | json.loads(
            self.view.model_dump_json(exclude={"eta_s", "result"})
        )


def list_jobs(conn: redis.Redis, state=None, batch_id=None, limit: int = 50) -> list[Any]:
    if batch_id:
        ids = [e.job_id for e in get_batch(conn, batch_id).entries]
    else:
        ids = [i.decode() for i in conn.zrevrange(keys.JOBS_INDEX, 0, -1)]
    found = []
    for view in read_views(conn, ids):
        if view is not None and (state is None or view.state == state):
            found.append(_Row(view=view, progress=view.progress, model=None))
    return found[:limit]


def list_batches(conn: redis.Redis, limit: int = 50) -> list[Any]:
    ids = [i.decode() for i in conn.zrevrange(keys.BATCHES_INDEX, 0, limit - 1)]
    return [_Row(id=i) for i in ids]
