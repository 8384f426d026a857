"""Files a user names: inside RINGQ_ALLOWED_DIRS, regular, read up to a limit, named as text."""

from collections.abc import Sequence
from pathlib import Path

from jobs.errors import ForbiddenPathError


def allowed_path(path: Path, allowed_dirs: Sequence[Path] | None, what: str) -> Path:
    """`path` with symlinks and '..' resolved; ForbiddenPathError unless it lies under one of
    `allowed_dirs` (None: anywhere). OSError, ValueError or RuntimeError for unusable paths."""
    resolved = path.resolve()
    if allowed_dirs is None:
        return resolved
    dirs = [directory.expanduser().resolve() for directory in allowed_dirs]
    if any(resolved.is_relative_to(directory) for directory in dirs):
        return resolved
    shown = str(path) if resolved == path else f"{path} (resolves to {resolved})"
    raise ForbiddenPathError(
        f"{what} {shown} is outside RINGQ_ALLOWED_DIRS "
        f"({', '.join(map(str, dirs)) or 'none'}): ringq reads files only from those directories"
    )


def file_bytes(path: Path) -> int:
    """A file's size, 0 when it is gone between a listing and the stat (another rank's writer
    renamed its partial file, or a sweep deleted it): sizes summed over a folder others write to."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def folder_bytes(folder: Path) -> int:
    """What the files under `folder` take (file_bytes: a file gone meanwhile counts 0)."""
    return sum(file_bytes(f) for f in folder.rglob("*") if f.is_file())


def read_at_most(file: Path, max_bytes: int) -> bytes:
    """Up to max_bytes + 1 bytes of a regular file: a longer result means over the limit.
    Directories, devices and FIFOs are refused before opening (a FIFO would block)."""
    if file.exists() and not file.is_file():
        raise OSError("not a regular file")
    with file.open("rb") as stream:
        return stream.read(max_bytes + 1)


def printable_name(path: Path) -> str:
    """A file name as text: bytes that are not UTF-8 (kept by Python as lone surrogates, which
    JSON cannot hold) become backslash escapes."""
    return path.name.encode("utf-8", "backslashreplace").decode("utf-8")
