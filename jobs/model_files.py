"""Reading model files, no MLX: GGUF metadata and tokenizer arrays, HF config.json,
safetensors headers. Errors are UnknownModelError with the file named."""

import json
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from jobs.errors import UnknownModelError


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path
    format: Literal["gguf", "hf", "random"]  # random: jobs/random_models.py (path unused)


def read_hf_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON or UTF-8
        raise UnknownModelError(f"cannot read {path / 'config.json'}: {error}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UnknownModelError(f"{path / 'config.json'} names no model_type")
    return config


@dataclass(frozen=True)
class GgufFile:
    metadata: dict[str, Any]  # scalars and strings; the tokenizer's big arrays are kept below
    tensor_names: tuple[str, ...]
    weight_bytes: int
    parameters: int
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]


def file_version(*paths: Path) -> tuple[tuple[int, int], ...]:
    """(mtime, size) of each existing file: cache keys that notice a rewritten model."""
    stats = [path.stat() for path in paths if path.exists()]
    return tuple((stat.st_mtime_ns, stat.st_size) for stat in stats)


def read_gguf(path: Path) -> GgufFile:
    return _read_gguf_version(path, file_version(path))


@lru_cache(maxsize=8)
def _read_gguf_version(path: Path, version: tuple) -> GgufFile:
    from gguf import GGUFReader  # memory-maps, but builds a view per token: ~2 s for SmolLM2

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    try:
        reader = GGUFReader(path)
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if key not in arrays and not key.startswith("GGUF.")
        }
        tokens, token_types, merges = (
            tuple(reader.fields[key].contents()) if key in reader.fields else () for key in arrays
        )
    except Exception as error:  # bad bytes fail inside gguf/numpy with whatever they raise
        raise UnknownModelError(f"{path} is not a readable GGUF file: {error}") from None
    metadata["tokenizer.ggml.tokens_count"] = len(tokens)
    return GgufFile(
        metadata=metadata,
        tensor_names=tuple(tensor.name for tensor in reader.tensors),
        weight_bytes=sum(int(tensor.n_bytes) for tensor in reader.tensors),
        parameters=sum(int(tensor.n_elements) for tensor in reader.tensors),
        tokens=tokens,
        token_types=token_types,
        merges=merges,
    )


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape, data_offsets} over every model*.safetensors file."""
    header: dict[str, dict[str, Any]] = {}
    for file in sorted(path.glob("model*.safetensors")):
        header.update(_safetensors_file_header(file))
    if not header:
        raise UnknownModelError(f"{path} has no model*.safetensors weights")
    return header


def _safetensors_file_header(file: Path) -> dict[str, dict[str, Any]]:
    try:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            if length > file.stat().st_size:
                raise ValueError(f"a header of {length} bytes is longer than the file")
            header = json.loads(stream.read(length))
    except (OSError, ValueError, RecursionError, struct.error) as error:
        raise UnknownModelError(f"{file} is not a readable safetensors file: {error}") from None
    if not isinstance(header, dict):
        raise UnknownModelError(f"{file}: its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()):
            raise UnknownModelError(f"{file}: tensor {name!r} lacks dtype, shape or data_offsets")
    return header
