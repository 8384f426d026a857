"""Where a job's prefill checkpoints lie: every rank records its part in Redis when it writes or
deletes it, and the dispatcher places a retry where all parts are, so it continues instead of
starting over. Only a group of the same layout whose rank r runs on the node that holds part r can
continue one; `checkpoint_hint` says whether the marks describe such a complete set."""

from dataclasses import dataclass

import redis
from pydantic import BaseModel, ConfigDict, ValidationError

from admission.vocabulary import KVLayout, Strategy
from jobs import keys
from jobs.schemas import GroupSpec


class CheckpointMark(BaseModel):
    """One rank's checkpoint part of one job (stored as JSON under `keys.job_checkpoints`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy
    kv_layout: KVLayout
    ranks: int
    node: str
    tokens: int


@dataclass(frozen=True)
class CheckpointHint:
    """A complete checkpoint: every rank's part of one layout at the same prompt position."""

    strategy: Strategy
    kv_layout: KVLayout
    nodes: tuple[str, ...]  # per rank: the node that holds its part
    tokens: int

    @property
    def label(self) -> str:
        shape = "single" if self.strategy == "single" else f"{self.strategy}-{len(self.nodes)}"
        return f"{shape} on {', '.join(self.nodes)}"


def mark_for(group: GroupSpec, rank: int, tokens: int) -> CheckpointMark:
    """What rank `rank` of `group` records once its part holds `tokens` prompt tokens."""
    return CheckpointMark(
        strategy=group.strategy,
        kv_layout=group.kv_layout,
        ranks=group.ranks,
        node=group.nodes[rank],
        tokens=tokens,
    )


def mark_checkpoint(
    conn: redis.Redis, job_id: str, rank: int, mark: CheckpointMark, ttl_s: int
) -> None:
    key = keys.job_checkpoints(job_id)
    pipe = conn.pipeline()
    pipe.hset(key, str(rank), mark.model_dump_json())
    pipe.expire(key, ttl_s)
    pipe.execute()


def clear_checkpoint(conn: redis.Redis, job_id: str, rank: int) -> None:
    conn.hdel(keys.job_checkpoints(job_id), str(rank))


def read_marks(conn: redis.Redis, job_id: str) -> dict[int, CheckpointMark]:
    """The job's marks by rank; a mark that does not parse is ignored (it only loses a resume)."""
    marks = {}
    for rank, raw in conn.hgetall(keys.job_checkpoints(job_id)).items():
        try:
            marks[int(rank)] = CheckpointMark.model_validate_json(raw)
        except (ValueError, ValidationError):
            continue
    return marks


def checkpoint_hint(marks: dict[int, CheckpointMark]) -> CheckpointHint | None:
    """The complete checkpoint the marks describe, or None (a part missing, or parts of
    different layouts: the ranks would start from 0 anyway). Its tokens: the fewest any rank
    holds, where the ranks continue from (a rank's writer may lag a segment behind)."""
    if not marks:
        return None
    first = marks[min(marks)]
    layout = (first.strategy, first.kv_layout, first.ranks)
    if set(marks) != set(range(first.ranks)):
        return None
    if any((m.strategy, m.kv_layout, m.ranks) != layout for m in marks.values()):
        return None
    tokens = min(m.tokens for m in marks.values())
    if tokens <= 0:
        return None
    nodes = tuple(marks[rank].node for rank in range(first.ranks))
    return CheckpointHint(first.strategy, first.kv_layout, nodes, tokens)
