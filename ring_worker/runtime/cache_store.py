"""A node agent's bounded on-disk store of kept KV caches (design: jobs/prefix_cache.py).

Files are mlx-lm prompt caches (safetensors; `save_prompt_cache` / `load_prompt_cache`) under
RINGQ_HOME/caches/<node>/, pinned ones (--keep-cache) under its pinned/ folder. The store never
holds more than its byte budget: before a file is written, least-recently-used files (mtime;
`touch` on use) are deleted until the new one fits, unpinned before pinned; a file larger than the
whole budget is not written. A file that does not load is deleted with a warning and reads as
absent. One lock file serialises writers sharing a folder.
"""

import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from jobs.files import folder_bytes

log = logging.getLogger(__name__)
SUFFIX = ".safetensors"
# Of the disk space the store may use (free space plus its own files) where it lives. One 128K
# prompt of an 8B model is 16 GiB of KV (bf16); at 10 % the 64 GiB disk of the H200 machine
# kept none of it, and every question recomputed the document.
DEFAULT_BUDGET_FRACTION = 0.5
HEADER_SLACK_BYTES = 4096  # safetensors header beyond the metadata and per-tensor entries
TENSOR_HEADER_BYTES = 256
LOAD_ERRORS = (ValueError, RuntimeError, OSError, KeyError, IndexError, TypeError, AttributeError)


@dataclass(frozen=True)
class StoredFile:
    path: Path
    bytes: int
    used_at: float
    pinned: bool

    @property
    def name(self) -> str:
        return self.path.name.removesuffix(SUFFIX)


@dataclass(frozen=True)
class Saved:
    path: Path | None  # None: larger than the whole budget, not kept
    evicted: list[StoredFile]


def default_budget_bytes(root: Path) -> int:
    """Half of what the store could use: the disk's free space and its own files (the budget
    does not shrink as the store fills)."""
    root.mkdir(parents=True, exist_ok=True)
    return int((shutil.disk_usage(root).free + folder_bytes(root)) * DEFAULT_BUDGET_FRACTION)


def node_store(home: Path, node: str, budget_bytes: int | None = None) -> "CacheStore":
    root = home / "caches" / node
    return CacheStore(
        root, budget_bytes if budget_bytes is not None else default_budget_bytes(root)
    )


class CacheStore:
    def __init__(self, root: Path, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"cache budget must be >= 0 bytes, not {budget_bytes}")
        self.root = root
        self.budget_bytes = budget_bytes
        (root / "pinned").mkdir(parents=True, exist_ok=True)

    def path_for(self, name: str, pinned: bool = False) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid cache file name {name!r}")
        return (self.root / "pinned" if pinned else self.root) / f"{name}{SUFFIX}"

    # -- writing ---------------------------------------------------------------------------

    def save(
        self,
        name: str,
        layers: Sequence[tuple[mx.array, mx.array]],
        metadata: dict[str, str],
        pinned: bool = False,
    ) -> Saved:
        """Write the K/V of each layer as one prompt-cache file, evicting LRU files first."""
        needed = estimate_bytes(layers, metadata)
        final = self.path_for(name, pinned)
        with self._locked():
            self._remove(final)
            if needed > self.budget_bytes:  # evicting the others would not make it fit
                log.warning("KV cache %s: %d bytes exceed the budget of %d, not kept (raise "
                            "RINGQ_CACHE_BYTES)", name, needed, self.budget_bytes)  # fmt: skip
                return Saved(None, [])
            evicted = self._make_room(needed)
            temporary = self.root / f".tmp-{uuid.uuid4().hex}{SUFFIX}"
            try:
                save_prompt_cache(str(temporary), as_caches(layers), metadata)
                if self.used_bytes() > self.budget_bytes:  # the estimate was short: never exceed
                    raise OSError(f"the file is larger than its estimate of {needed} bytes")
                os.replace(temporary, final)
            except OSError as exc:  # disk full, or the above: the job's answer stands
                log.warning("KV cache %s not kept: %s", name, exc)
                return Saved(None, evicted)
            finally:
                temporary.unlink(missing_ok=True)
        return Saved(final, evicted)

    def _make_room(self, needed: int) -> list[StoredFile]:
        evicted = []
        files = sorted(self.files(), key=lambda f: (f.pinned, f.used_at))
        used = sum(f.bytes for f in files)
        for stored in files:
            if used + needed <= self.budget_bytes:
                break
            self._remove(stored.path)
            used -= stored.bytes
            evicted.append(stored)
            log.info("KV cache %s evicted (%d bytes, LRU)", stored.name, stored.bytes)
        return evicted

    # -- reading ---------------------------------------------------------------------------

    def load(self, path: Path) -> tuple[list[Any], dict[str, str]] | None:
        """The caches and metadata of a file of this store; None (with a warning, the file
        deleted) if it is missing, corrupt or truncated."""
        found = read_cache_file(path)
        if found is not None:
            self.touch(path)
        return found

    def touch(self, path: Path) -> None:
        with suppress(OSError):
            os.utime(path)

    def files(self) -> list[StoredFile]:
        return list(self._scan(self.root, False)) + list(self._scan(self.root / "pinned", True))

    def used_bytes(self) -> int:
        """Everything in the folder, temporary files included."""
        return folder_bytes(self.root)

    def drop(self, name: str) -> bool:
        """Delete a cache file by name (pinned or not); whether there was one."""
        with self._locked():
            found = [p for p in (self.path_for(name), self.path_for(name, True)) if p.is_file()]
            for path in found:
                self._remove(path)
        return bool(found)

    def _scan(self, folder: Path, pinned: bool) -> Iterator[StoredFile]:
        for path in folder.glob(f"*{SUFFIX}"):
            if path.name.startswith("."):
                continue
            try:
                stat = path.stat()
            except OSError:  # deleted meanwhile
                continue
            yield StoredFile(path, stat.st_size, stat.st_mtime, pinned)

    def _remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with (self.root / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._clear_temporaries()
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _clear_temporaries(self) -> None:
        """Left by a writer that died mid-write (the lock is held: none is writing now)."""
        for path in self.root.glob(f".tmp-*{SUFFIX}"):
            path.unlink(missing_ok=True)


def read_cache_file(path: Path) -> tuple[list[Any], dict[str, str]] | None:
    """A prompt-cache file's caches and metadata; None if it is missing, or (with a warning,
    the file deleted so that it never fails again) corrupt or truncated."""
    if not path.is_file():
        return None
    try:
        cache, metadata = load_prompt_cache(str(path), return_metadata=True)
        check_caches(cache)
        mx.eval([c.state for c in cache])
    except LOAD_ERRORS as exc:
        if out_of_memory(exc):
            raise  # not the file's fault: it stays, and the job fails over to its retry path
        log.warning("KV cache %s is unreadable (%s): ignored, the job recomputes", path, exc)
        path.unlink(missing_ok=True)
        return None
    return cache, metadata


def out_of_memory(exc: BaseException) -> bool:
    """MLX's allocators raise RuntimeError when memory runs out (CUDA: "cudaMallocAsync(...)
    failed: out of memory"; Metal: "[metal::malloc] ... limit"). On a batched H200 group such a
    load was taken for a corrupt file: the 16 GiB file was deleted and its entry forgotten."""
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        "out of memory" in text or "malloc" in text
    )


def as_caches(layers: Sequence[tuple[mx.array, mx.array]]) -> list[KVCache]:
    caches = []
    for keys, values in layers:
        cache = KVCache()
        cache.state = (keys, values, keys.shape[2])
        caches.append(cache)
    return caches


def estimate_bytes(layers: Sequence[tuple[mx.array, mx.array]], metadata: dict[str, str]) -> int:
    """An upper bound of the file's size: data, metadata and safetensors' header."""
    data = sum(k.nbytes + v.nbytes for k, v in layers)
    tensors = 3 * len(layers)  # keys, values, offset
    header = len(json.dumps(metadata)) + TENSOR_HEADER_BYTES * tensors + HEADER_SLACK_BYTES
    return data + header


def check_caches(cache: list[Any]) -> None:
    """A loaded file must be plain KV caches whose arrays cover their offsets."""
    if not cache:
        raise ValueError("no layers")
    for layer in cache:
        if not isinstance(layer, KVCache) or layer.keys is None or layer.values is None:
            raise ValueError(f"not a KV cache layer: {type(layer).__name__}")
        if layer.keys.shape[2] < layer.offset or layer.values.shape[2] < layer.offset:
            raise ValueError(f"arrays hold fewer positions than the offset {layer.offset}")
