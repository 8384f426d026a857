"""Prefill checkpoints on local disk, so that a retried job continues instead of starting over.

Every `every_tokens` prompt tokens, at a chunk boundary, each rank saves the part of its KV caches
added since its previous checkpoint (with the few numbers its strategy needs to continue) as one
segment, `RINGQ_HOME/checkpoints/<job>/<node>/<layout>-rank<r>-<start>-<end>.safetensors` (one
array of every layer's keys and values, their shapes in its metadata); a checkpoint is the chain of
segments from token 0. Writing only the new part keeps the cost per token constant. The compute
thread only copies the new slices into that array; a writer thread writes it to a temporary file
and renames it, so a crash mid-write leaves the chain before it whole. A node's segments count
against RINGQ_CHECKPOINT_BUDGET_BYTES, by default the disk down to a tenth of the space within
reach free (past it the rank's chain stops growing: a 1M-token prompt of the Qwen2.5-1M shape holds
57 GB of KV), and are deleted when the job ends. It is not the kept caches' budget
(RINGQ_CACHE_BYTES): that store is full in its steady state, and evicting from it here would leave
its index entries in Redis, which the engine does not reach, stale."""

import contextlib
import json
import logging
import math
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from admission.estimate import HELD_SEGMENTS, max_segment_tokens
from jobs.files import file_bytes, folder_bytes

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
KV, SHAPES = "kv", "shapes"  # a segment file's one array, and the layers' shapes in it
DISK_RESERVE = 0.1  # of the space this user can fill, kept free when no budget is set


def checkpoint_dir(home: Path, job_id: str) -> Path:
    return home / "checkpoints" / job_id


def parts_dir(home: Path, job_id: str, node: str | None = None) -> Path:
    """Where the ranks on `node` keep their parts of a job's checkpoint: a folder per node, as
    the local nodes of `ringq up` share one RINGQ_HOME and each counts only its own parts."""
    folder = checkpoint_dir(home, job_id)
    return folder / node if node else folder


def segment_path(
    home: Path,
    job_id: str,
    layout: str,
    rank: int,
    start_tokens: int,
    end_tokens: int,
    node: str | None = None,
) -> Path:
    """One checkpoint segment: rank `rank`'s KV of prompt tokens [start, end). `layout` names the
    group's shape (e.g. "single-1", "ring-2"): only the same shape can continue from it."""
    name = f"{layout}-rank{rank}-{start_tokens}-{end_tokens}{SUFFIX}"
    return parts_dir(home, job_id, node) / name


def segment_chain(
    home: Path, job_id: str, layout: str, rank: int, node: str | None = None
) -> list[tuple[int, Path]]:
    """(end tokens, path) of the rank's segments that follow each other from token 0."""
    folder = parts_dir(home, job_id, node)
    pattern = re.compile(rf"{re.escape(layout)}-rank{rank}-(\d+)-(\d+){re.escape(SUFFIX)}")
    found = []
    for path in folder.iterdir() if folder.is_dir() else []:
        if match := pattern.fullmatch(path.name):
            found.append((int(match[1]), int(match[2]), path))
    chain, reached = [], 0
    for start, end, path in sorted(found):
        if start == reached and end > start:
            chain.append((end, path))
            reached = end
    return chain


@dataclass(frozen=True)
class Resume:
    """A rank's saved state: its caches after `tokens` prompt tokens, and its strategy's state."""

    cache: list[Any]
    tokens: int
    state: dict[str, str]


def read_checkpoint(
    home: Path,
    job_id: str,
    layout: str,
    rank: int,
    upto_tokens: int | None = None,
    node: str | None = None,
) -> Resume | None:
    """The rank's checkpoint: its segments from token 0 (up to `upto_tokens`) joined."""
    chain = [(end, path) for end, path in segment_chain(home, job_id, layout, rank, node)
             if upto_tokens is None or end <= upto_tokens]  # fmt: skip
    if not chain:
        return None
    parts: list[list[KVCache]] = []
    metadata: dict[str, str] = {}
    for _, path in chain:
        caches, metadata = read_segment(path)
        parts.append(caches)
    joined = []
    for layers in zip(*parts, strict=True):
        keys = mx.concatenate([layer.keys for layer in layers], axis=2)
        values = mx.concatenate([layer.values for layer in layers], axis=2)
        layer = KVCache()
        layer.state = (keys, values, keys.shape[2])
        joined.append(layer)
    metadata = {k: v for k, v in metadata.items() if k not in ("job", "tokens", "start")}
    return Resume(joined, chain[-1][0], metadata)


def resumable_tokens(
    home: Path,
    job_id: str,
    layout: str,
    rank: int,
    chunk_tokens: int,
    total_tokens: int,
    node: str | None = None,
) -> int:
    """The furthest point this rank's segments reach that a run of `chunk_tokens` chunks over a
    `total_tokens` prompt can continue from (0: none)."""
    ends = [end for end, _ in segment_chain(home, job_id, layout, rank, node)]
    return max((e for e in ends if e % chunk_tokens == 0 and e < total_tokens), default=0)


def saved_tokens(home: Path, job_id: str, layout: str, ranks: int) -> int:
    """Prompt tokens every rank of `layout` has saved (0 when one has none)."""
    reached = [segment_chain(home, job_id, layout, r) for r in range(ranks)]
    return min((chain[-1][0] if chain else 0) for chain in reached)


def delete_checkpoints(home: Path, job_id: str) -> int:
    """Remove a job's checkpoints, every node's parts (when it ends); the bytes freed."""
    folder = checkpoint_dir(home, job_id)
    freed = folder_bytes(folder)
    shutil.rmtree(folder, ignore_errors=True)
    return freed


def checkpoint_bytes(home: Path, node: str | None = None) -> int:
    """Disk the checkpoints of every job take: the parts of `node`'s ranks, or all of them."""
    root = home / "checkpoints"
    if not root.is_dir():
        return 0
    pattern = f"*/{node}/*{SUFFIX}*" if node else f"**/*{SUFFIX}*"
    return sum(file_bytes(p) for p in root.glob(pattern))


def disk_room(disk: Any, size: int) -> bool:
    """Whether `size` more bytes leave DISK_RESERVE of the space this user can fill free: what
    is used and what is free to it (`shutil.disk_usage`), not the device's size, which a quota
    or a shared volume may put far beyond reach (a GPU host's 252 GB disk had 64 GB free)."""
    return disk.free - size >= DISK_RESERVE * (disk.used + disk.free)


@dataclass(frozen=True)
class Snapshot:
    """A segment's KV as one evaluated array: each layer's keys, then its values, in order. One
    buffer, so the writer reads one array back from the device, not one per layer: on an H100 a
    writer of per-layer arrays fell from ~1 GB/s to 0.14-0.3 GB/s as a 524K prefill's kernels
    grew, as if each array's read waited for the kernel in flight."""

    flat: mx.array
    shapes: list[tuple[int, ...]]  # of each layer's keys and values, in `flat`'s order

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        """One safetensors file: the array, and the shapes beside `metadata` (`read_segment`)."""
        mx.save_safetensors(
            str(path), {KV: self.flat}, {**metadata, SHAPES: json.dumps(self.shapes)}
        )


def read_segment(path: Path) -> tuple[list[KVCache], dict[str, str]]:
    """A segment file's layers' caches and its metadata (the shapes left out)."""
    loaded = mx.load(str(path), return_metadata=True)  # MLX types it as any of its forms
    arrays, metadata = loaded if isinstance(loaded, tuple) else (None, None)
    if not (isinstance(arrays, dict) and isinstance(metadata, dict) and SHAPES in metadata):
        raise ValueError(f"{path} is not a checkpoint segment")
    shapes = [tuple(shape) for shape in json.loads(metadata.pop(SHAPES))]
    return unflatten(arrays[KV], shapes), metadata


def snapshot(cache: list[Any], from_offset: int = 0) -> Snapshot:
    """An evaluated copy of the caches' part from `from_offset` to their end, safe to write while
    prefill goes on: a new array, never views, since a held slice keeps each layer's whole
    buffer alive (a 128K-token prefill on one H200 peaked 14 GiB higher with views)."""
    for layer in cache:
        if type(layer) is not KVCache:
            raise ValueError(f"checkpoints keep plain KV caches, not {type(layer).__name__}")
    parts = [a[..., from_offset : layer.offset, :] for layer in cache
             for a in (layer.keys, layer.values)]  # fmt: skip
    shapes = [tuple(a.shape) for a in parts]
    if len(set(shapes)) == 1:  # every layer alike: stacked, copied straight from the buffers
        flat = mx.stack(parts)
    else:
        flat = mx.concatenate([a.flatten() for a in parts])
    mx.eval(flat)
    return Snapshot(flat, shapes)


def unflatten(flat: mx.array, shapes: list[tuple[int, ...]]) -> list[KVCache]:
    flat = flat.reshape(-1)
    arrays, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        arrays.append(flat[at : at + size].reshape(shape))
        at += size
    caches = []
    for keys, values in zip(arrays[::2], arrays[1::2], strict=True):
        cache = KVCache()
        cache.state = (keys, values, keys.shape[2])
        caches.append(cache)
    return caches


@dataclass(frozen=True)
class _Segment:
    kv: Snapshot  # the part of each layer's cache since the previous segment
    start_tokens: int
    end_tokens: int
    state: dict[str, str]


class Checkpointer:
    """One rank's checkpoints of one job. `due()` at each chunk boundary, then `save()`."""

    def __init__(
        self,
        home: Path,
        job_id: str,
        layout: str,
        rank: int,
        every_tokens: int,
        budget_bytes: int | None,
        on_change: Callable[[int], None] | None = None,
        skip_while_busy: bool = False,
        node: str | None = None,
        max_segment_tokens: int | None = None,
        after_s: float = 0.0,
    ):
        """`after_s`: checkpoints are taken only in a prefill the ranks project (after its first
        step, `decide`) to take at least this many seconds more; 0: in every prefill.
        `node`: its parts go to the node's folder, and `budget_bytes` bounds that node's parts
        (None: the disk keeps DISK_RESERVE of its space free: `disk_room`).
        `on_change(tokens)`: called from the writer thread once the checkpoint reaches `tokens` on
        disk, and with 0 once it is deleted. `skip_while_busy`: no checkpoint is due while the
        writer still writes the last one, until the unsaved part reaches `max_segment_tokens`; so
        at most 2 x max_segment_tokens of this rank's KV is held for checkpoints (admission counts
        it: admission/estimate.checkpoint_held_tokens)."""
        if every_tokens <= 0:
            raise ValueError(f"every_tokens must be positive, got {every_tokens}")
        self.home, self.job_id, self.layout, self.rank = home, job_id, layout, rank
        self.node, self.folder = node, parts_dir(home, job_id, node)
        self.every_tokens, self.budget_bytes = every_tokens, budget_bytes
        self.on_change, self.skip_while_busy = on_change, skip_while_busy
        self.saved_tokens = 0  # prompt tokens handed to the writer so far
        self.saved_offset = 0  # this rank's cache length then (a ring rank holds a share)
        self.skipped = 0  # segments not written: over the disk budget (or after one that was)
        self.max_segment_tokens = max_segment_tokens
        self._queue: queue.Queue[_Segment | None] = queue.Queue(1)
        self._held = threading.Semaphore(HELD_SEGMENTS)  # segment copies alive at once
        self._writing = False
        self.after_s = after_s
        self.taking: bool | None = True if after_s <= 0 else None  # None: not decided yet
        self._discard = False  # the writer deletes the segments once it is done
        self._writer = threading.Thread(target=self._write_forever, daemon=True, name="checkpoint")
        self._writer.start()

    def decide(self, projected_s: float) -> None:
        """Whether this prefill takes checkpoints, from the seconds the ranks agree it still
        needs: a prefill that ends sooner is cheaper to redo after a crash than to insure."""
        self.taking = projected_s >= self.after_s
        taking = "checkpoints on" if self.taking else "no checkpoints"
        log.info("job %s rank %d: prefill projected to need %.1fs more: %s", self.job_id,
                 self.rank, projected_s, taking)  # fmt: skip

    def due(self, done_tokens: int) -> bool:
        if not self.taking:
            return False
        busy = self._writing or not self._queue.empty()
        if self.skip_while_busy and busy and not self._segment_full(done_tokens):
            return False
        return done_tokens // self.every_tokens > self.saved_tokens // self.every_tokens

    def _segment_full(self, done_tokens: int) -> bool:
        cap = self.max_segment_tokens
        return cap is not None and done_tokens - self.saved_tokens >= cap

    def continue_from(self, resume: Resume) -> None:
        """The prefill continues from `resume`: the next segment starts where it ends."""
        self.saved_tokens = resume.tokens
        self.saved_offset = resume.cache[0].offset if resume.cache else 0

    def save(self, cache: list[Any], done_tokens: int, state: dict[str, str]) -> None:
        """Hand the caches' part since the last save to the writer (waits while two segments'
        copies are held)."""
        self._held.acquire()
        segment = _Segment(
            snapshot(cache, self.saved_offset), self.saved_tokens, done_tokens, state
        )
        self.saved_tokens = done_tokens
        self.saved_offset = cache[0].offset if cache else 0
        self._queue.put(segment)

    def close(self) -> None:
        """Wait for the writer: every segment handed to it written."""
        self._queue.put(None)
        self._writer.join()

    def discard(self) -> None:
        """Drop the chain without waiting: the queued segment is dropped, and the writer deletes
        every segment once the one it is writing is done, so the job's end waits for no disk."""
        with contextlib.suppress(queue.Empty):
            self._queue.get_nowait()
            self._held.release()
        self._discard = True
        self._queue.put(None)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the writer to end (after `close` or `discard`); whether it has."""
        self._writer.join(timeout_s)
        return not self._writer.is_alive()

    def delete(self) -> None:
        """Remove this rank's segments (and a partial one)."""
        folder = self.folder
        for path in folder.glob(f"{self.layout}-rank{self.rank}-*") if folder.is_dir() else []:
            path.unlink(missing_ok=True)
        if self.saved_tokens:
            self.report(0)

    def _write_forever(self) -> None:
        self._write_all()
        if self._discard:
            self.delete()
            for folder in (self.folder, checkpoint_dir(self.home, self.job_id)):
                with contextlib.suppress(OSError):  # another rank's part may still be there
                    folder.rmdir()

    def _write_all(self) -> None:
        while (segment := self._queue.get()) is not None:
            if self._discard:
                self._held.release()
                continue
            self._writing = True
            try:
                self._write(segment)
            except Exception:  # a full disk or a bad cache must not fail (or hang) the prefill
                self.skipped += 1
                log.exception("job %s rank %d: checkpoint not written", self.job_id, self.rank)
            finally:
                del segment  # its copies, before the next save may take another
                self._writing = False
                self._held.release()

    def _write(self, segment: _Segment) -> None:
        size = segment.kv.nbytes
        # a segment missing breaks the chain: later ones could not be continued from
        if self.skipped or not self._room_for(size):
            self.skipped += 1
            log.info(
                "job %s rank %d: checkpoint at %d tokens skipped (disk budget)",
                self.job_id,
                self.rank,
                segment.end_tokens,
            )
            return
        start, end = segment.start_tokens, segment.end_tokens
        path = segment_path(self.home, self.job_id, self.layout, self.rank, start, end, self.node)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial" + SUFFIX)
        metadata = {**segment.state, "job": self.job_id, "tokens": str(segment.end_tokens)}
        began = time.perf_counter()
        segment.kv.save(partial, metadata)
        os.replace(partial, path)
        took = time.perf_counter() - began
        log.info("job %s rank %d: checkpoint at %d tokens (%.2f GB in %.2fs, %.2f GB/s)",
                 self.job_id, self.rank, segment.end_tokens, size / 1e9, took,
                 size / 1e9 / max(took, 1e-9))  # fmt: skip
        self.report(segment.end_tokens)

    def _room_for(self, size: int) -> bool:
        if self.budget_bytes is not None:
            return checkpoint_bytes(self.home, self.node) + size <= self.budget_bytes
        self.home.mkdir(parents=True, exist_ok=True)
        return disk_room(shutil.disk_usage(self.home), size)

    def report(self, tokens: int) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(tokens)
        except Exception:  # e.g. Redis restarting: a retry may then start over, nothing worse
            log.exception("job %s rank %d: checkpoint not recorded", self.job_id, self.rank)


def start_checkpoints(
    home: Path,
    every_tokens: int,
    budget_bytes: int | None,
    job_id: str,
    layout: str,
    rank: int,
    gather: Callable[[int], list[int]],
    chunk_tokens: int,
    total_tokens: int,
    on_change: Callable[[int], None] | None = None,
    node: str | None = None,
    after_s: float = 0.0,
) -> tuple[Checkpointer | None, Resume | None]:
    """What one rank's prefill needs: a Checkpointer (None when `every_tokens` is 0) and the
    checkpoint all ranks continue from: the furthest point every rank's segments reach on a
    boundary of this run's chunks (None: from the start). Call on every rank of the group.
    `node`, `budget_bytes` and `after_s` as for Checkpointer."""
    if every_tokens <= 0:
        return None, None
    saver = Checkpointer(
        home, job_id, layout, rank, every_tokens, budget_bytes, on_change, True, node,
        max_segment_tokens=max_segment_tokens(every_tokens, chunk_tokens), after_s=after_s,
    )  # fmt: skip
    reach = resumable_tokens(home, job_id, layout, rank, chunk_tokens, total_tokens, node)
    common = min(gather(reach))  # a rank's writer may have lagged one segment behind
    began = time.perf_counter()
    mine = read_checkpoint(home, job_id, layout, rank, common, node) if common > 0 else None
    resume = agree_on_resume(mine, gather)
    if resume is not None:
        saver.continue_from(resume)
        # read now: the first chunk's time, which the checkpoint rule and the ETA project
        # from, then holds its compute alone (a lazy read put 7.5 GB of disk into it)
        mx.eval([layer.state for layer in resume.cache])
        size = sum(layer.keys.nbytes + layer.values.nbytes for layer in resume.cache)
        log.info("job %s rank %d: resuming from the checkpoint at %d tokens (%.2f GB read in "
                 "%.2fs)", job_id, rank, resume.tokens, size / 1e9,
                 time.perf_counter() - began)  # fmt: skip
    return saver, resume


def agree_on_resume(resume: Resume | None, gather: Callable[[int], list[int]]) -> Resume | None:
    """`resume` if every rank's checkpoint holds the same number of tokens, else None.
    `gather` is a collective (Engine.gather_ints): call this on every rank."""
    counts = gather(resume.tokens if resume is not None else 0)
    return resume if len(set(counts)) == 1 and counts[0] > 0 else None


def end_checkpoints(saver: Checkpointer | None, keep: bool) -> None:
    """After the prefill: keep this rank's segments for a retry (`keep`: the prefill failed),
    waiting for the writer; or drop them without waiting (finished, cancelled), since the writer
    may still hold a queued 2-4 GB segment (a 9 s wait for a file then deleted, on an H100)."""
    if saver is None:
        return
    if keep:
        saver.close()
    else:
        saver.discard()
