"""The memory tier of prefix reuse counts against its group's reservation.

A warm group's rank keeps the previous job's prompt KV in memory (`InMemory`,
ring_worker/runtime/prefix_reuse.py), so the next job on the same document starts without reading
a file. Those bytes must fit in what the dispatcher reserved for the group on that node:
- between jobs the copy always fits: it is (a part of) the finished job's KV, which that job's
  reservation counted;
- when the next job starts, the room beside it is the reservation (`bytes_per_node`) less the
  job's own estimate (`job_bytes_per_node`). A job that starts from the copy takes it into its own
  cache (its estimate counts every prompt token); any other job keeps the copy only if it fits
  the room, else the copy leaves memory (its file, where one was kept, stays on disk);
- in a batch (ring_worker/runtime/batch_serve.py) the room is applied as the job joins, since its
  row is its own KV; a job that joined a busy batch has no room (the reservation grew by its rows
  only);
- `ringq run` (no service, no reservation) keeps nothing.

The bytes counted are what the copy keeps alive: a view of the finished job's cache keeps its
whole buffer, a copy (a sharded ring's zigzag blocks, concatenated) only itself."""

from collections.abc import Sequence
from typing import Any

from jobs.schemas import Placement

Ranges = list[tuple[int, int]]


def memory_room_bytes(placement: Placement | None) -> int:
    """What the group's reservation holds on each node beyond the job's own estimate."""
    if placement is None:
        return 0
    own = placement.job_bytes_per_node or placement.bytes_per_node
    return max(0, placement.bytes_per_node - own)


def merge_adjacent(ranges: Sequence[tuple[int, int]]) -> Ranges:
    """Ranges in cache order, with each one that continues the previous one joined to it (a
    cache holding [0, 700) then [700, 760) holds [0, 760): one view, not a copy)."""
    merged: Ranges = []
    for start, stop in ranges:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return merged


def pinned_bytes(cache: Sequence[Any], held: Sequence[tuple[Any, Any]], view: bool) -> int:
    """Bytes the held (keys, values) keep alive: a view keeps each source buffer whole."""
    if view:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache)
    return sum(keys.nbytes + values.nbytes for keys, values in held)


def room_text(room_bytes: int) -> str:
    if room_bytes <= 0:
        return "the group's reservation has no room for it beside this job"
    return f"the group's reservation has room for {room_bytes} bytes beside this job"
