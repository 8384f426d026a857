"""What a joining job adds to its group's reservation (jobs/warm_groups.py `join`, from
admission.estimate `batch_row_bytes` and `batch_buffer_tokens`) holds what the decode batch
really allocates (ring_worker/engine/batch_cache.py), and at most the longest answer's room per row
more: rows are aligned at their ends, so a row may need the longest row's length plus its own
answer, and rows double as jobs join a full buffer (the reservation stays as rows leave and the
buffer shrinks, until the batch empties). Table test: a real Redis counts, a real
BatchDecoder (tiny float32 model) allocates, through the same joins and leaves of mixed
lengths."""

from dataclasses import dataclass

import pytest

from admission.estimate import MARGIN, BatchRow, Layout, batch_row_bytes
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec
from jobs.warm_groups import WarmGroups
from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
from ring_worker.engine.engines import Engine
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny, save_tiny

BASE_BYTES = 10**6  # the group's reservation for its first job (weights, KV, prefill tensors)
BUDGET_BYTES = 10**9


@dataclass(frozen=True)
class Row:
    prompt_tokens: int
    max_tokens: int
    join_step: int  # the first row starts the group at step 0; the others join


CASES = {
    "equal lengths double the rows": [Row(100, 20, 0), Row(100, 20, 1), Row(100, 20, 2)],
    "a short first row is padded to a long joiner": [Row(10, 8, 0), Row(600, 8, 2)],
    "prompt and answer fill whole steps": [Row(200, 56, 0), Row(100, 5, 1)],
    "short rows join a long one and reuse freed rows": [
        Row(700, 30, 0),
        Row(5, 4, 0),
        Row(5, 4, 6),
        Row(300, 4, 6),
        Row(20, 10, 12),
    ],  # fmt: skip
    "a long answer joins a long row near its end": [Row(700, 30, 0), Row(5, 300, 25)],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("llama"), "llama", layers=2)
    shape = read_model_shape(resolve_model(str(path), allowed_dirs=None), dtype="float32")
    return Engine(load_tiny(path)), shape


def group() -> GroupSpec:
    return GroupSpec(
        group_id="acct", job_id="row0", model="tiny", addresses=["127.0.0.1:1"], nodes=["n0"]
    )


@pytest.mark.parametrize("rows", CASES.values(), ids=CASES.keys())
def test_joins_reserve_what_the_batch_allocates(redis_conn, tiny, rows):
    engine, shape = tiny
    warm, spec = WarmGroups(redis_conn), group()
    reservations = Reservations(redis_conn, lease_s=30)
    assert reservations.reserve(spec.group_id, {"n0": (BASE_BYTES, BUDGET_BYTES)}) is None
    warm.offer(spec, BASE_BYTES)
    decoder = BatchDecoder(engine)
    largest = [0, 0]  # the most slots and columns the buffers have had

    def extra_bytes() -> int:
        return reservations.held("n0").get(spec.group_id, 0) - BASE_BYTES

    def check() -> None:
        allocated = sum(a.nbytes for a in decoder.cache.state())
        if len(warm.batch(spec.group_id)) <= 1 and extra_bytes() == 0:
            first = rows[0]  # alone: its own estimate (the base) holds its row
            own = batch_row_bytes(shape, first.prompt_tokens, first.max_tokens, Layout("single"))
            assert allocated <= own
            return
        longest_answer = -(-max(r.max_tokens for r in rows) // 256) * 256
        slots, _, capacity, _ = decoder.cache.layers[0].keys.shape
        per_position = allocated / (slots * capacity)
        largest[:] = max(largest[0], slots), max(largest[1], capacity)
        assert allocated <= extra_bytes()
        # the reservation is kept until the batch empties, as the buffer shrinks when rows leave
        most_slots, most_columns = largest
        held = most_slots * (most_columns + longest_answer) * per_position * MARGIN
        assert extra_bytes() <= held + 1

    try:
        step, joined = 0, set()
        while step <= max(r.join_step for r in rows) or decoder.busy:
            for index, row in enumerate(rows):
                if row.join_step != step:
                    continue
                key, batch_row = f"row{index}", BatchRow(row.prompt_tokens, row.max_tokens)
                if index == 0:
                    warm.started(spec, key, batch_row)
                else:
                    own = batch_row_bytes(
                        shape, row.prompt_tokens, row.max_tokens, Layout("single")
                    )
                    assert warm.join(spec, key, 8, own, {"n0": BUDGET_BYTES}, batch_row) == "joined"
                prefill = engine.prefill(prompt_tokens(row.prompt_tokens), 256)
                decoder.add(DecodeRequest(key, row.max_tokens), prefill)
                joined.add(key)
                check()
            for result in decoder.step():
                warm.ended(spec, result.key)
            check()
            step += 1
        assert len(joined) == len(rows) and warm.batch(spec.group_id) == []
        assert extra_bytes() == 0 and warm.buffer(spec.group_id).slots == 0  # all given back
    finally:
        reservations.release(spec.group_id, "n0")
        redis_conn.delete(*[k for k in redis_conn.keys("ringq:*acct*")])
