"""A decode batch's rows are aligned at their ends (ring_worker/engine/batch_cache.py): every row
holds
exactly its own positions, in order, ending at the common column, through joins that move the
rows right (a longer joiner) or left (a join the buffer cannot hold: compaction), steps, and
leaves. Each position's K/V is a number naming its sequence and position, so any misplaced
column shows."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from ring_worker.engine.batch_cache import BatchCache

LAYERS, HEADS, DIM = 2, 2, 4


def prefill(sequence: int, length: int) -> list[KVCache]:
    """mlx-lm caches of `length` positions whose K (and V, negated) are 1000 * sequence + p."""
    caches = []
    for _ in range(LAYERS):
        cache = KVCache()
        marks = mx.broadcast_to(
            (1000 * sequence + mx.arange(length, dtype=mx.float32))[None, None, :, None],
            (1, HEADS, length, DIM),
        )
        cache.update_and_fetch(marks, -marks)
        caches.append(cache)
    return caches


class Batch:
    """A BatchCache and, beside it, what each of its rows must hold."""

    def __init__(self) -> None:
        self.cache = BatchCache(LAYERS)
        self.members: list[int] = []  # sequence per row
        self.positions: dict[int, int] = {}

    def join(self, sequence: int, length: int, max_tokens: int) -> None:
        self.cache.add(prefill(sequence, length), max_tokens)
        self.members.append(sequence)
        self.positions[sequence] = length

    def step(self) -> None:
        """One decode step: each row's next position, at the common column."""
        marks = mx.array([1000.0 * s + self.positions[s] for s in self.members])
        keys = mx.broadcast_to(marks[:, None, None, None], (len(self.members), HEADS, 1, DIM))
        for layer in self.cache.layers:
            layer.update_and_fetch(keys, -keys)
        self.cache.rows.advance()
        for sequence in self.members:
            self.positions[sequence] += 1

    def leave(self, sequence: int) -> None:
        row = self.members.index(sequence)
        self.cache.remove(row)
        self.members[row] = self.members[-1]
        self.members.pop()

    def check(self) -> None:
        rows = self.cache.rows
        assert rows.lengths == [self.positions[s] for s in self.members]
        assert all(limit <= self.cache.layers[0].capacity for limit in rows.limits)
        for layer in self.cache.layers:
            assert layer.keys is not None and layer.values is not None
            for row, sequence in enumerate(self.members):
                length = self.positions[sequence]
                held = layer.keys[row, 0, rows.end - length : rows.end, 0]
                want = 1000 * sequence + mx.arange(length, dtype=mx.float32)
                assert mx.array_equal(held, want), (sequence, held)
                assert mx.array_equal(layer.values[row, 0, rows.end - length : rows.end, 0], -want)


def test_rows_hold_their_positions_through_joins_steps_and_leaves():
    batch = Batch()
    batch.join(1, 10, 300)  # 10 + 300: 512 columns
    batch.check()
    batch.join(2, 4, 20)  # shorter: ends at the same column, no move
    capacity = batch.cache.layers[0].capacity
    batch.check()
    for _ in range(3):
        batch.step()
    batch.join(3, 40, 8)  # longer than every row: all move right
    assert batch.cache.rows.end == 40
    batch.check()
    for _ in range(5):
        batch.step()
    batch.leave(3)  # the longest leaves: the last row moves into its place
    batch.leave(1)
    batch.check()
    assert batch.cache.layers[0].capacity == capacity
    for _ in range(2):
        batch.step()
    end, first = batch.cache.rows.end, batch.cache.rows.first
    assert first > 0  # columns left of every row are dead now
    batch.join(4, 6, capacity)  # cannot fit at `end`: the rows move left first
    assert batch.cache.rows.end == batch.positions[2] < end
    batch.check()
    for _ in range(4):
        batch.step()
    batch.check()


@pytest.mark.parametrize("joiner", [3, 9])
def test_a_step_attends_each_row_only_to_its_own_columns(joiner):
    """update_and_fetch returns [first, end] and the mask hides the columns before each row."""
    batch = Batch()
    batch.join(1, 9, 16)
    batch.join(2, joiner, 16)
    keys = mx.zeros((2, HEADS, 1, DIM))
    fetched, _ = batch.cache.layers[0].update_and_fetch(keys, keys)
    rows = batch.cache.rows
    mask = rows.mask()
    assert fetched.shape[2] == rows.longest + 1
    if joiner == 9:
        assert mask is None  # one length: fused attention, no mask
        return
    assert mask is not None
    visible = mask[:, 0, 0].tolist()
    assert visible[0] == [True] * 10
    assert visible[1] == [False] * (9 - joiner) + [True] * (joiner + 1)


def test_rows_keep_their_positions_when_the_buffers_shrink():
    """Rows left: the buffers keep fewer slots and only the columns rows hold, and the rows
    step and take a joiner as before."""
    batch = Batch()
    for sequence, length in enumerate((30, 12, 50, 7, 21), start=1):
        batch.join(sequence, length, 40)
    for _ in range(3):
        batch.step()
    assert batch.cache.slots == 8
    for sequence in (3, 1, 5):
        batch.leave(sequence)
    batch.cache.shrink(2)
    assert batch.cache.slots == 2
    assert batch.cache.rows.first == 0  # the longest row that left held the first columns
    batch.check()
    for _ in range(2):
        batch.step()
    batch.join(6, 90, 10)  # longer than every row: grows the slots again, the rows move right
    batch.check()
    assert batch.cache.slots == 4
    with pytest.raises(ValueError, match="cannot shrink"):
        batch.cache.shrink(2)  # 3 rows


def test_a_join_moves_the_prompts_kv_holding_it_once_and_one_layer():
    layers = 8
    caches = [random_cache(length=4096) for _ in range(layers)]  # 4 MiB a layer
    mx.eval([c.state for c in caches])
    layer_bytes = caches[0].keys.nbytes + caches[0].values.nbytes
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    BatchCache(layers).add(caches, max_tokens=1, move=True)
    assert all(c.keys is None for c in caches)  # the prompt's entries are emptied
    # a layer at a time: its new buffer (4352 columns, room for the answer), the update's copy
    # of it, and the prompt's layer until it is dropped; not the other layers' prompt KV
    assert mx.get_peak_memory() - before <= 3 * layer_bytes
    assert mx.get_active_memory() - before <= 0.5 * layer_bytes  # the KV moved, not doubled


def random_cache(length: int, heads: int = 2, dim: int = 64) -> KVCache:
    cache = KVCache()
    cache.update_and_fetch(*mx.random.normal((2, 1, heads, length, dim)))
    return cache
