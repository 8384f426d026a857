"""Prefill checkpoints on local disk, so that a retried job continues instead of starting over.

Every `every_tokens` prompt tokens, at a chunk boundary, each rank saves its own KV caches (and
the few numbers its strategy needs to continue, e.g. a ring's per-rank lengths) to
`RINGQ_HOME/checkpoints/<job>/<layout>-rank<r>.safetensors` (mlx-lm's prompt-cache format).
The compute thread only materialises the caches' current slices; a writer thread writes them
to a temporary file and renames it over the previous checkpoint, so a crash mid-write leaves
the older one whole. Checkpoints count against a disk budget and are deleted when the job ends.
"""

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"


def checkpoint_dir(home: Path, job_id: str) -> Path:
    return home / "checkpoints" / job_id


def checkpoint_path(home: Path, job_id: str, layout: str, rank: int) -> Path:
    """`layout` names the group's shape (e.g. "single-1", "ring-2"): only the same shape can
    continue from a rank's part."""
    return checkpoint_dir(home, job_id) / f"{layout}-rank{rank}{SUFFIX}"


@dataclass(frozen=True)
class Resume:
    """A rank's saved state: its caches after `tokens` prompt tokens, and its strategy's state."""

    cache: list[Any]
    tokens: int
    state: dict[str, str]


def read_checkpoint(home: Path, job_id: str, layout: str, rank: int) -> Resume | None:
    path = checkpoint_path(home, job_id, layout, rank)
    if not path.is_file():
        return None
    cache, metadata = load_prompt_cache(str(path), return_metadata=True)
    tokens = int(metadata.pop("tokens"))
    metadata.pop("job", None)
    return Resume(cache, tokens, metadata)


def saved_tokens(home: Path, job_id: str, layout: str, ranks: int) -> int:
    """Prompt tokens every rank of `layout` has saved (0 unless all of them have the same)."""
    counts = {
        read_checkpoint_tokens(checkpoint_path(home, job_id, layout, r)) for r in range(ranks)
    }
    return counts.pop() if len(counts) == 1 else 0


def read_checkpoint_tokens(path: Path) -> int:
    if not path.is_file():
        return 0
    _, metadata = cast(tuple[Any, dict[str, str]], mx.load(str(path), return_metadata=True))
    return int(metadata.get("0.tokens", 0))  # save_prompt_cache flattens [metadata, ...]


def delete_checkpoints(home: Path, job_id: str) -> int:
    """Remove a job's checkpoints (when it ends); the bytes freed."""
    folder = checkpoint_dir(home, job_id)
    freed = 0
    for path in folder.glob("*") if folder.is_dir() else []:
        freed += path.stat().st_size
        path.unlink(missing_ok=True)
    if folder.is_dir():
        folder.rmdir()
    return freed


def checkpoint_bytes(home: Path) -> int:
    """Disk the checkpoints of every job on this node take."""
    root = home / "checkpoints"
    return sum(p.stat().st_size for p in root.rglob(f"*{SUFFIX}*")) if root.is_dir() else 0


def snapshot(cache: list[Any]) -> list[KVCache]:
    """Evaluated copies of the caches' filled parts, safe to write while prefill goes on: new
    arrays, never the cache's own buffers (which the next chunk updates in place)."""
    copies = []
    for layer in cache:
        if type(layer) is not KVCache:
            raise ValueError(f"checkpoints keep plain KV caches, not {type(layer).__name__}")
        keys, values = layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]
        mx.eval(keys, values)
        copy = KVCache()
        copy.state = (keys, values, layer.offset)
        copies.append(copy)
    return copies


class Checkpointer:
    """One rank's checkpoints of one job. `due()` at each chunk boundary, then `save()`."""

    def __init__(
        self,
        home: Path,
        job_id: str,
        layout: str,
        rank: int,
        every_tokens: int,
        budget_bytes: int,
        on_change: Callable[[int], None] | None = None,
    ):
        """`on_change(tokens)`: called (from the writer thread) once a checkpoint after `tokens`
        prompt tokens is on disk, and with 0 once it is deleted; the service records there
        which node holds the part (jobs/checkpoint_marks.py)."""
        if every_tokens <= 0:
            raise ValueError(f"every_tokens must be positive, got {every_tokens}")
        self.path = checkpoint_path(home, job_id, layout, rank)
        self.home, self.job_id, self.rank = home, job_id, rank
        self.every_tokens, self.budget_bytes = every_tokens, budget_bytes
        self.on_change = on_change
        self.saved_tokens = 0
        self.skipped = 0  # checkpoints not written: over the disk budget
        self._queue: queue.Queue[tuple[list[KVCache], int, dict[str, str]] | None] = queue.Queue(1)
        self._writer = threading.Thread(target=self._write_forever, daemon=True, name="checkpoint")
        self._writer.start()

    def due(self, done_tokens: int) -> bool:
        return done_tokens // self.every_tokens > self.saved_tokens // self.every_tokens

    def save(self, cache: list[Any], done_tokens: int, state: dict[str, str]) -> None:
        """Hand the caches after `done_tokens` to the writer (waits only while the previous
        checkpoint is still being written)."""
        self.saved_tokens = done_tokens
        self._queue.put((snapshot(cache), done_tokens, state))

    def close(self) -> None:
        """Wait for the last write."""
        self._queue.put(None)
        self._writer.join()

    def _write_forever(self) -> None:
        while (item := self._queue.get()) is not None:
            caches, tokens, state = item
            try:
                self._write(caches, tokens, state)
            except Exception:  # a full disk or a bad cache must not fail (or hang) the prefill
                log.exception("job %s rank %d: checkpoint not written", self.job_id, self.rank)

    def _write(self, caches: list[KVCache], tokens: int, state: dict[str, str]) -> None:
        size = sum(c.keys.nbytes + c.values.nbytes for c in caches)
        held = self.path.stat().st_size if self.path.exists() else 0
        if checkpoint_bytes(self.home) - held + size > self.budget_bytes:
            self.skipped += 1
            log.info(
                "job %s rank %d: checkpoint at %d tokens over the disk budget, skipped",
                self.job_id,
                self.rank,
                tokens,
            )
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial" + SUFFIX)
        metadata = {**state, "job": self.job_id, "tokens": str(tokens)}
        save_prompt_cache(str(partial), caches, metadata=metadata)
        os.replace(partial, self.path)
        log.info("job %s rank %d: checkpoint at %d tokens", self.job_id, self.rank, tokens)
        self.report(tokens)

    def report(self, tokens: int) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(tokens)
        except Exception:  # e.g. Redis restarting: a retry may then start over, nothing worse
            log.exception("job %s rank %d: checkpoint not recorded", self.job_id, self.rank)


def open_checkpoints(
    home: Path,
    every_tokens: int,
    budget_bytes: int,
    job_id: str,
    layout: str,
    rank: int,
    on_change: Callable[[int], None] | None = None,
) -> tuple[Checkpointer | None, Resume | None]:
    """For one rank's prefill: a Checkpointer (None when `every_tokens` is 0) and this rank's
    checkpoint of the job in this layout, if it has one. Every rank must then agree on it
    (`agree_on_resume`): a rank whose part is missing makes all of them start from 0."""
    if every_tokens <= 0:
        return None, None
    saver = Checkpointer(home, job_id, layout, rank, every_tokens, budget_bytes, on_change)
    return saver, read_checkpoint(home, job_id, layout, rank)


def agree_on_resume(resume: Resume | None, gather: Callable[[int], list[int]]) -> Resume | None:
    """`resume` if every rank's checkpoint holds the same number of tokens, else None.
    `gather` is a collective (Engine.gather_ints): call this on every rank."""
    counts = gather(resume.tokens if resume is not None else 0)
    return resume if len(set(counts)) == 1 and counts[0] > 0 else None


def start_checkpoints(
    home: Path,
    every_tokens: int,
    budget_bytes: int,
    job_id: str,
    layout: str,
    rank: int,
    gather: Callable[[int], list[int]],
    chunk_tokens: int,
    total_tokens: int,
    on_change: Callable[[int], None] | None = None,
) -> tuple[Checkpointer | None, Resume | None]:
    """What one rank's prefill needs: a Checkpointer (None when off) and the checkpoint all
    ranks agree to continue from (None: from the start; also when it is not on a boundary of
    this run's chunks). Call on every rank of the group."""
    saver, mine = open_checkpoints(
        home, every_tokens, budget_bytes, job_id, layout, rank, on_change
    )
    if saver is None:
        return None, None
    if mine is not None and (mine.tokens % chunk_tokens or mine.tokens >= total_tokens):
        mine = None
    resume = agree_on_resume(mine, gather)
    if resume is not None:
        saver.saved_tokens = resume.tokens  # the next checkpoint is due `every_tokens` later
        log.info(
            "job %s rank %d: resuming from the checkpoint at %d tokens", job_id, rank, resume.tokens
        )
    return saver, resume


def end_checkpoints(saver: Checkpointer | None, keep: bool) -> None:
    """After the prefill: wait for the writer, and delete this rank's part unless `keep` (the
    prefill failed and a retry may continue from it)."""
    if saver is None:
        return
    saver.close()
    if not keep:
        saver.path.unlink(missing_ok=True)
        if saver.saved_tokens:
            saver.report(0)
        with contextlib.suppress(OSError):  # another rank's part may still be there
            saver.path.parent.rmdir()
