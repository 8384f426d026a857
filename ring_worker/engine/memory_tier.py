"""The memory tier of prefix reuse counts against its group's reservation.

A warm group's rank keeps the previous job's prompt KV in memory (`InMemory`,
ring_worker/runtime/prefix_reuse.py), so the next job on the same document starts without reading a
file. Those bytes live in the rank's process, so they must fit in what the dispatcher reserved
for the group on that node. The rule:

- Between jobs the copy always fits: it is (a part of) the finished job's KV, which that job's
  reservation counted; nothing else is alive but the weights.
- When the next job starts, the reservation is `bytes_per_node` (the larger of what the group
  held and this job's own estimate: jobs/admit_plan.py `plan_warm`) and the job needs
  `job_bytes_per_node`. The difference is the room the copy may take beside the job:
  - a job that starts from the copy takes its KV into its own cache (its estimate counts every
    prompt token, cached or not), and the tier lets the copy go;
  - any other job keeps the copy only if it fits in the room, else the copy leaves memory
    (evicted to disk: a prefix worth keeping was written there after its job, and stays
    indexed; jobs/prefix_cache.py says which are).
  The memory tier therefore never holds more than (reservation - the running job's estimate).
- In a group that decodes in batches (ring_worker/runtime/batch_serve.py) the job's KV is copied
into a
  batch row as it joins, and the copy is bounded by the same room at once, not only when the
  next job starts: the row is the job's own KV, so the copy beside it would be counted twice
  over nothing. A job that joined a busy batch has no room (jobs/warm_groups.py grew the
  reservation by its rows only). A question arriving while a batch decodes starts from a
  member's row instead (a copy of the shared part: ring_worker/runtime/batch_serve.py
  `member_row_prefix`), and one arriving after the batch emptied from the prompt the memory tier
  kept of the jobs that left last (`last_row_memory`): the group's reservation keeps the row of
  the job that began the batch, and that prompt is no longer.
- `ringq run` (no service, no reservation) keeps nothing.

The bytes counted are what the copy keeps alive: a view of the finished job's cache keeps its
whole buffer (prompt, answer and mlx-lm's 256-step padding), a copy (a sharded ring's zigzag
blocks, concatenated) only itself.
"""

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
