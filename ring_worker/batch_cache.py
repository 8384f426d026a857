"""The KV cache of a decode batch: one buffer per layer, one row (slot) per sequence.

mlx-lm's BatchKVCache left-pads: every row writes at one common column, so a sequence longer than
that column cannot join without re-padding (copying) every row, and the column only ever grows
while the batch is never empty. Here each row starts at position 0 and holds its own length
(host-side ints, no device sync): a step writes each row's new K/V at that row's own length (a
slice update per row for a few rows, one scatter for more), RoPE takes per-row offsets, and
attention reads columns [0, longest + 1) with a boolean mask hiding each row's columns past its own
length (on CUDA, ring_worker/rows_attention.py reads each row's own columns instead, no mask).
Joining copies only the joining sequence's K/V into a free row; leaving moves the last row into
the freed one.

When every row has the same length (one sequence, or sequences that joined together) the step is
mlx-lm's own single-sequence path: an integer offset, one slice update, no mask (fused attention).

The model is plain mlx-lm: its attention calls `offset`, `make_mask` and `update_and_fetch` on the
per-layer `SlotCache`, exactly as on a KVCache.
"""

from typing import Any

import mlx.core as mx

LENGTH_STEP_TOKENS = 256  # capacity grows by this many positions, as mlx-lm's KVCache does
# Up to this many rows a step stores K/V with a slice update per row, above it with one scatter.
# On an H200 (8B shape, 2 rows at ~4K) a layer's scatter of K and V took 115 us of host time and
# its two slice updates 14 us (bench.step_cost_probe `ops`, h200-service/step-cost-fused.json):
# even near 8 rows, and the scatters were most of what a mixed step cost over a uniform one.
PER_ROW_STORE_MAX_ROWS = 6


class Rows:
    """The lengths of the sequences in a batch, in row order (shared by every layer's cache)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self._offset: int | mx.array | None = None
        self._mask: mx.array | None = None
        self._visible: mx.array | None = None
        self._index: mx.array | None = None
        self._uniform: bool | None = None  # cached: every layer asks, every step

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def uniform(self) -> bool:
        if self._uniform is None:
            self._uniform = len(set(self.lengths)) <= 1
        return self._uniform

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)

    @property
    def offset(self) -> int | mx.array:
        """RoPE offsets of the step's token: one int when all rows agree, else one per row."""
        if self._offset is None:
            self._offset = self.lengths[0] if self.uniform else mx.array(self.lengths)
        return self._offset

    def mask(self) -> mx.array | None:
        """(rows, 1, 1, longest + 1): row b sees columns 0..lengths[b]. None when uniform."""
        if self.uniform:
            return None
        if self._mask is None:
            columns = mx.arange(self.longest + 1)[None]
            visible = columns <= mx.array(self.lengths)[:, None]
            self._mask = visible.reshape(len(self), 1, 1, -1)
        return self._mask

    def visible(self) -> mx.array:
        """int32 (rows,): the columns row b attends to in this step, lengths[b] + 1."""
        if self._visible is None:
            self._visible = mx.array([n + 1 for n in self.lengths], dtype=mx.int32)
        return self._visible

    def index(self) -> mx.array:
        """0..rows - 1: the rows a step's scatter writes."""
        if self._index is None or self._index.shape[0] != len(self):
            self._index = mx.arange(len(self))
        return self._index

    def changed(self) -> None:
        self._offset = self._mask = self._visible = self._uniform = None

    def advance(self) -> None:
        """After a step: every row holds one more position (uniform stays as it was)."""
        uniform = self.uniform
        self.lengths = [n + 1 for n in self.lengths]
        self.changed()
        self._uniform = uniform


class SlotCache:
    """One layer's K/V for every row of a batch; mlx-lm's attention sees a KV cache."""

    def __init__(self, rows: Rows, slots: int = 1):
        self.rows = rows
        self.slots = slots  # rows to allocate at first
        self.keys: mx.array | None = None  # (slots, kv_heads, capacity, head_dim)
        self.values: mx.array | None = None

    @property
    def offset(self) -> int | mx.array:
        return self.rows.offset

    def make_mask(self, length: int, **_: Any) -> mx.array | None:
        if length != 1:
            raise ValueError(f"a decode batch steps one token per row, not {length}")
        return self.rows.mask()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the step's K/V at each row's length; return the columns every row may attend
        to (the mask hides the rest)."""
        self.store(keys, values)
        assert self.keys is not None and self.values is not None
        count, end = len(self.rows), self.rows.longest + 1
        return self.keys[:count, :, :end], self.values[:count, :, :end]

    def store(self, keys: mx.array, values: mx.array) -> None:
        """Write the step's K/V (rows, kv_heads, 1, head_dim) at each row's length."""
        rows = self.rows
        count, end = len(rows), rows.longest + 1
        self._reserve(count, end, keys)
        assert self.keys is not None and self.values is not None
        if rows.uniform:
            at = rows.lengths[0]
            self.keys[:count, :, at:end] = keys
            self.values[:count, :, at:end] = values
        elif count <= PER_ROW_STORE_MAX_ROWS:
            for row, at in enumerate(rows.lengths):
                self.keys[row : row + 1, :, at : at + 1] = keys[row : row + 1]
                self.values[row : row + 1, :, at : at + 1] = values[row : row + 1]
        else:
            index, positions = rows.index(), rows.offset
            self.keys[index, :, positions] = keys[:, :, 0]
            self.values[index, :, positions] = values[:, :, 0]

    def put(self, row: int, keys: mx.array, values: mx.array, reserve_tokens: int) -> None:
        """Copy one sequence's K/V ((1, kv_heads, length, head_dim)) into `row`, with room for
        `reserve_tokens` positions in all."""
        length = keys.shape[2]
        self._reserve(row + 1, max(reserve_tokens, length + 1), keys)
        assert self.keys is not None and self.values is not None
        self.keys[row : row + 1, :, :length] = keys
        self.values[row : row + 1, :, :length] = values

    def move(self, source: int, target: int, length: int) -> None:
        """Copy row `source`'s first `length` positions over row `target`."""
        assert self.keys is not None and self.values is not None
        self.keys[target : target + 1, :, :length] = self.keys[source : source + 1, :, :length]
        self.values[target : target + 1, :, :length] = self.values[source : source + 1, :, :length]

    def _reserve(self, slots: int, length: int, like: mx.array) -> None:
        """Grow the buffers to hold `slots` rows of `length` positions (zeros where new)."""
        if self.keys is None or self.values is None:
            capacity = _round_up(length, LENGTH_STEP_TOKENS)
            _, heads, _, dim = like.shape
            slots = max(slots, self.slots)
            self.keys = mx.zeros((slots, heads, capacity, dim), like.dtype)
            self.values = mx.zeros((slots, heads, capacity, dim), like.dtype)
            return
        have_slots, heads, capacity, dim = self.keys.shape
        if length > capacity:
            more = _round_up(length, LENGTH_STEP_TOKENS) - capacity
            self.keys = _grow(self.keys, 2, more)
            self.values = _grow(self.values, 2, more)
        if slots > have_slots:
            more_slots = max(slots, 2 * have_slots) - have_slots
            self.keys = _grow(self.keys, 0, more_slots)
            self.values = _grow(self.values, 0, more_slots)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


def _grow(buffer: mx.array, axis: int, more: int) -> mx.array:
    shape = list(buffer.shape)
    shape[axis] = more
    return mx.concatenate([buffer, mx.zeros(shape, buffer.dtype)], axis=axis)


class BatchCache:
    """Every layer's SlotCache and the rows they share: the `cache` a batched step passes to
    the model."""

    def __init__(self, layers: int, slots: int = 1):
        self.rows = Rows()
        self.layers = [SlotCache(self.rows, slots) for _ in range(layers)]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompt_cache: list[Any], max_tokens: int) -> int:
        """A prefilled sequence (mlx-lm KVCaches, one per layer) becomes the last row, with
        room for `max_tokens` more positions: its step t (1-based) writes position
        length + t - 1, and it leaves at step max_tokens at the latest."""
        row = len(self.rows)
        length = prompt_cache[0].offset
        for layer, cache in zip(self.layers, prompt_cache, strict=True):
            keys, values = cache.keys[..., :length, :], cache.values[..., :length, :]
            layer.put(row, keys, values, length + max_tokens)
        self.rows.lengths.append(length)
        self.rows.changed()
        return row

    def remove(self, row: int) -> None:
        """Drop `row`; the last row moves into its place (the caller reorders to match)."""
        last = len(self.rows) - 1
        if row != last:
            length = self.rows.lengths[last]
            for layer in self.layers:
                layer.move(last, row, length)
            self.rows.lengths[row] = length
        self.rows.lengths.pop()
        self.rows.changed()

    def state(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.state]
