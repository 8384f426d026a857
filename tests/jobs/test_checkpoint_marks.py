"""Where a job's checkpoint parts lie, as ranks record them in Redis and the dispatcher reads
them back for a retry (jobs/checkpoint_marks.py)."""

import pytest

from jobs import keys
from jobs.checkpoint_marks import (
    CheckpointHint,
    CheckpointMark,
    checkpoint_hint,
    clear_checkpoint,
    mark_checkpoint,
    mark_for,
    read_marks,
)
from jobs.schemas import GroupSpec

GROUP = GroupSpec(
    group_id="g",
    job_id="j",
    model="random:tiny-llama",
    addresses=["127.0.0.1:1", "127.0.0.1:2"],
    nodes=["node-1", "node-0"],
    strategy="ring",
)


def part(rank: int, tokens: int = 512) -> CheckpointMark:
    return mark_for(GROUP, rank, tokens)


def test_marks_of_every_rank_make_a_hint_in_rank_order(redis_conn):
    for rank in (1, 0):
        mark_checkpoint(redis_conn, "j", rank, part(rank), ttl_s=60)
    hint = checkpoint_hint(read_marks(redis_conn, "j"))
    assert hint == CheckpointHint("ring", "replicated", ("node-1", "node-0"), 512)
    assert 0 < redis_conn.ttl(keys.job_checkpoints("j")) <= 60
    clear_checkpoint(redis_conn, "j", 1)
    assert checkpoint_hint(read_marks(redis_conn, "j")) is None  # a part is gone


@pytest.mark.parametrize(
    "marks",
    [
        {},
        {0: part(0)},  # rank 1 has written nothing yet
        {0: part(0), 1: part(1).model_copy(update={"strategy": "pipeline"})},
        {0: part(0, 0), 1: part(1, 0)},
    ],
)
def test_an_incomplete_or_mixed_set_of_marks_gives_no_hint(marks):
    assert checkpoint_hint(marks) is None


def test_a_mark_that_does_not_parse_is_ignored(redis_conn):
    mark_checkpoint(redis_conn, "j", 0, part(0), ttl_s=60)
    redis_conn.hset(keys.job_checkpoints("j"), "1", "{not json")
    redis_conn.hset(keys.job_checkpoints("j"), "x", part(1).model_dump_json())
    assert list(read_marks(redis_conn, "j")) == [0]


def test_ranks_at_different_positions_continue_from_the_lesser():
    """A rank's writer may lag a segment behind: the ranks then resume where both parts reach."""
    hint = checkpoint_hint({0: part(0, 512), 1: part(1, 448)})
    assert hint is not None and hint.tokens == 448
