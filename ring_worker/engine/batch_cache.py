"""The KV cache of a decode batch: one buffer per layer, one row (slot) per sequence.

Rows are aligned at their ends: every row writes its next K/V at one common column (`Rows.end`),
and row b holds its positions in [end - length_b, end). So a step stores every row's K/V with one
slice update, as for rows of one length, while RoPE takes per-row offsets. Attention reads columns
[end - longest, end + 1), with a boolean mask hiding the columns before each row's own (on CUDA,
ring_worker/engine/rows_attention.py reads each row's own columns, no mask). Rows written each at
its own length would need a scatter: on an H200 a step of 8 rows of different lengths took
12.9 ms that way and 9.3 ms aligned.

A sequence joins by copying its K/V into a free row, ending at `end`. A joiner longer than `end`,
or a join the buffer cannot hold, first moves every row (one copy of the columns they hold,
dropping those no row holds). A row's room ends at its join column + max_tokens (`Rows.limits`),
so the buffer never needs more than admission.estimate `batch_buffer_tokens`. Leaving moves the
last row into the freed one; the last row itself leaves its columns in place (`vacated`, until
the next join), so when the batch empties the rows that left last still hold their K/V for the
next job on their document. The decoder may `shrink` the buffers to fewer slots.

When every row has the same length the step is mlx-lm's own single-sequence path: an integer
offset, one slice update, no mask. The model is plain mlx-lm: its attention calls `offset`,
`make_mask` and `update_and_fetch` on the per-layer `SlotCache`, exactly as on a KVCache."""

from typing import Any

import mlx.core as mx

from admission.estimate import CACHE_STEP_TOKENS


class Rows:
    """The lengths of the sequences in a batch, in row order, and the column every row writes
    at next (shared by every layer's cache): row b holds columns [end - lengths[b], end)."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.limits: list[int] = []  # per row: the column after the last one it may write
        self.end = 0
        self._offset: int | mx.array | None = None
        self._mask: mx.array | None = None
        self._visible: mx.array | None = None
        self._starts: mx.array | None = None
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
    def first(self) -> int:
        """The first column any row holds."""
        return self.end - self.longest

    @property
    def offset(self) -> int | mx.array:
        """RoPE offsets of the step's token: one int when all rows agree, else one per row."""
        if self._offset is None:
            self._offset = self.lengths[0] if self.uniform else mx.array(self.lengths)
        return self._offset

    def mask(self) -> mx.array | None:
        """(rows, 1, 1, longest + 1) over columns [first, end]: row b sees its own last
        lengths[b] + 1. None when uniform."""
        if self.uniform:
            return None
        if self._mask is None:
            columns = mx.arange(self.longest + 1)[None]
            hidden = mx.array([self.longest - n for n in self.lengths])[:, None]
            self._mask = (columns >= hidden).reshape(len(self), 1, 1, -1)
        return self._mask

    def visible(self) -> mx.array:
        """int32 (rows,): the columns row b attends to in this step, lengths[b] + 1."""
        if self._visible is None:
            self._visible = mx.array([n + 1 for n in self.lengths], dtype=mx.int32)
        return self._visible

    def starts(self) -> mx.array:
        """int32 (rows,): row b's first column, end - lengths[b]."""
        if self._starts is None:
            self._starts = mx.array([self.end - n for n in self.lengths], dtype=mx.int32)
        return self._starts

    def changed(self) -> None:
        self._offset = self._mask = self._visible = self._starts = self._uniform = None

    def advance(self) -> None:
        """After a step: every row holds one more position (uniform stays as it was)."""
        uniform = self.uniform
        self.lengths = [n + 1 for n in self.lengths]
        self.end += 1
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

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def make_mask(self, length: int, **_: Any) -> mx.array | None:
        if length != 1:
            raise ValueError(f"a decode batch steps one token per row, not {length}")
        return self.rows.mask()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the step's K/V at the rows' common column; return the columns any row may
        attend to (the mask hides the rest)."""
        self.store(keys, values)
        assert self.keys is not None and self.values is not None
        rows = self.rows
        count, first, end = len(rows), rows.first, rows.end + 1
        return self.keys[:count, :, first:end], self.values[:count, :, first:end]

    def store(self, keys: mx.array, values: mx.array) -> None:
        """Write the step's K/V (rows, kv_heads, 1, head_dim) at the rows' common column: the
        batch's rows, or every slot (a compiled step, ring_worker/engine/compiled_step.py)."""
        count, at = keys.shape[0], self.rows.end
        self._reserve(count, at + 1, keys)
        assert self.keys is not None and self.values is not None
        self.keys[:count, :, at : at + 1] = keys
        self.values[:count, :, at : at + 1] = values

    def put(self, row: int, keys: mx.array, values: mx.array, end: int) -> None:
        """Copy one sequence's K/V ((1, kv_heads, length, head_dim)) into `row`, ending at
        column `end`."""
        length = keys.shape[2]
        self._reserve(row + 1, end, keys)
        assert self.keys is not None and self.values is not None
        self.keys[row : row + 1, :, end - length : end] = keys
        self.values[row : row + 1, :, end - length : end] = values

    def move(self, source: int, target: int, start: int, end: int) -> None:
        """Copy row `source`'s columns [start, end) over row `target`'s."""
        assert self.keys is not None and self.values is not None
        for buffer in (self.keys, self.values):
            buffer[target : target + 1, :, start:end] = buffer[source : source + 1, :, start:end]

    def relayout(
        self, capacity: int, start: int, end: int, shift: int, like: mx.array, slots: int = 0
    ) -> None:
        """New buffers of `capacity` columns holding the old columns [start, end) at
        [start + shift, end + shift), in `slots` slots (fewer than now keep the first ones; 0: as
        many as now, or, before any buffer, the slots to allocate at first)."""
        _, heads, _, dim = like.shape
        slots = slots or (self.slots if self.keys is None else self.keys.shape[0])
        moved = []
        for old in (self.keys, self.values):
            new = mx.zeros((slots, heads, capacity, dim), like.dtype)
            if old is not None and end > start:
                new[:, :, start + shift : end + shift] = old[:slots, :, start:end]
            moved.append(new)
        self.keys, self.values = moved

    def _reserve(self, slots: int, length: int, like: mx.array) -> None:
        """Grow the buffers (allocated by `relayout`) to hold `slots` rows of `length`
        positions (zeros where new)."""
        assert self.keys is not None and self.values is not None
        have_slots, heads, capacity, dim = self.keys.shape
        if length > capacity:
            more = _round_up(length, CACHE_STEP_TOKENS) - capacity
            self.keys = _grow(self.keys, 2, more)
            self.values = _grow(self.values, 2, more)
        if slots > have_slots:
            more_slots = grown_slots(have_slots, slots) - have_slots
            self.keys = _grow(self.keys, 0, more_slots)
            self.values = _grow(self.values, 0, more_slots)

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


def grown_slots(have: int, rows: int) -> int:
    """The slots buffers of `have` slots grow to for `rows` rows: doubled until they hold them
    (a join adds one row at a time, so a full buffer doubles)."""
    slots = max(have, 1)
    while slots < rows:
        slots *= 2
    return slots


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
        # slots of rows that left as the last row: (first column, length), intact until a join
        # (steps write at columns past them; a join may write or relayout over them)
        self.vacated: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def slots(self) -> int:
        keys = self.layers[0].keys
        return 0 if keys is None else keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    def add(self, prompt_cache: list[Any], max_tokens: int, move: bool = False) -> int:
        """A prefilled sequence (mlx-lm KVCaches, one per layer) becomes the last row, ending at
        the rows' common column, with room for `max_tokens` more positions: its step t
        (1-based) writes column end + t - 1, and it leaves at step max_tokens at the latest.
        `move`: each layer is copied and evaluated, then its KVCache emptied, so where nothing
        else holds the prompt's buffers a join holds its KV once and a layer, not twice (a
        524K-token prompt of the Qwen2.5-1M shape holds 30 GB); else `prompt_cache` stays whole."""
        rows, row = self.rows, len(self.rows)
        self.vacated.clear()
        length = prompt_cache[0].offset
        end = rows.end if row else 0
        if length > end or end + max_tokens > self.layers[0].capacity:
            self._relayout(max(rows.longest, length), max_tokens, prompt_cache[0].keys)
        for layer, cache in zip(self.layers, prompt_cache, strict=True):
            keys, values = cache.keys[..., :length, :], cache.values[..., :length, :]
            layer.put(row, keys, values, rows.end)
            if move:
                mx.eval(layer.state)
                # emptied in place: the prefix a prefill continued shares these KVCache objects
                cache.keys = cache.values = None
                cache.offset = 0
            del keys, values
        rows.lengths.append(length)
        rows.limits.append(rows.end + max_tokens)
        rows.changed()
        return row

    def shrink(self, slots: int) -> None:
        """Keep the first `slots` slots (every row is in them), in new buffers holding only the
        columns rows hold (moved left, as for a join the buffers cannot hold). Slots vacated
        before are dropped: `vacated` matters when the batch empties, which this is not."""
        if len(self.rows) > slots or not 0 < slots < self.slots:
            held = f"{self.slots} slots of {len(self.rows)} rows"
            raise ValueError(f"cannot shrink {held} to {slots}")
        like = self.layers[0].keys
        assert like is not None
        self.vacated.clear()
        self._relayout(self.rows.longest, 0, like, slots)

    def _relayout(self, end: int, max_tokens: int, like: mx.array, slots: int = 0) -> None:
        """Move every row to end at column `end` (right, for a longer joiner; left, dropping
        the columns no row holds), in buffers just long enough for every row's room and a
        joiner's `max_tokens` (in `slots` slots: 0, as many as now)."""
        rows = self.rows
        shift = end - rows.end
        rows.limits = [limit + shift for limit in rows.limits]
        capacity = _round_up(max([end + max_tokens, *rows.limits]), CACHE_STEP_TOKENS)
        start = rows.first  # no row held: start + longest == start, nothing to copy
        for layer in self.layers:
            layer.relayout(capacity, start, start + rows.longest, shift, like, slots)
        rows.end = end
        rows.changed()

    def remove(self, row: int) -> None:
        """Drop `row`; the last row moves into its place (the caller reorders to match)."""
        rows, last = self.rows, len(self.rows) - 1
        if row == last:
            self.vacated[row] = (rows.end - rows.lengths[row], rows.lengths[row])
        else:
            length = rows.lengths[last]
            for layer in self.layers:
                layer.move(last, row, rows.end - length, rows.end)
            rows.lengths[row], rows.limits[row] = length, rows.limits[last]
        rows.lengths.pop()
        rows.limits.pop()
        rows.changed()

    def row_prefix(
        self, row: int, tokens: int, view: bool = False
    ) -> list[tuple[mx.array, mx.array]]:
        """`row`'s first `tokens` positions' K/V, per layer, as (1, kv_heads, tokens, head_dim):
        copies (evaluated), or with `view` slices of the batch's buffers (they keep the buffers
        alive). `row`: a live row, or a `vacated` slot."""
        rows = self.rows
        start, length = (
            (rows.end - rows.lengths[row], rows.lengths[row])
            if row < len(rows)
            else self.vacated.get(row, (0, 0))
        )
        if not 0 < tokens <= length:
            raise ValueError(f"row {row} holds {length} positions, not {tokens}")
        found: list[tuple[mx.array, mx.array]] = []
        for layer in self.layers:
            assert layer.keys is not None and layer.values is not None
            keys = layer.keys[row : row + 1, :, start : start + tokens]
            values = layer.values[row : row + 1, :, start : start + tokens]
            found.append((keys, values) if view else (mx.contiguous(keys), mx.contiguous(values)))
        mx.eval(found)
        return found

    def state(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.state]
