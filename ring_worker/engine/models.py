"""Load a resolved model into mlx-lm's Llama / Qwen modules; write tiny random ones for tests.

GGUF weights are dequantized to float32 by default: on a 2-core CPU node with OpenBLAS preloaded,
SmolLM2-135M prefilled 209 tok/s in float32 against 21 in bfloat16 and 11 with the 4-bit weights
kept quantized, and float32's logits match the quantized model's to 2e-4."""

import importlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from jobs.errors import UnknownModelError
from jobs.model_catalog import (
    ModelSource,
    config_from_gguf_metadata,
    default_dtype,
    model_config,
    resolve_model,
)
from jobs.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# llama.cpp tensor names -> mlx-lm module paths ("blk.N." becomes "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def load_model(
    source: ModelSource,
    *,
    dtype: mx.Dtype | None = None,
    dequantize: bool = True,
    prune: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """mlx-lm's Model for `source`, computing in `dtype` (default: catalog.default_dtype).

    dequantize=True turns quantized weights dense (CPU nodes: 4-bit matmul on CPU is slow);
    False keeps them as QuantizedLinear / QuantizedEmbedding with their own bits and group size.
    `prune` runs before the weights are evaluated (a pipeline stage drops the layers it does not
    run, so they are never materialised).
    """
    started_s = time.perf_counter()
    dtype = dtype or getattr(mx, default_dtype(source))
    if source.format == "gguf":
        model = _load_gguf(source.path, dtype, dequantize)
    elif source.format == "random":
        model = _random_model(model_config(source), dtype)
    else:
        model = _load_hf_dir(source.path, dtype, dequantize)
    if prune is not None:
        prune(model)
    mx.eval(model.parameters())
    logger.info(
        "loaded model %s (%s, %s, dequantize=%s) in %.2f s",
        source.name,
        source.format,
        dtype,
        dequantize,
        time.perf_counter() - started_s,
    )
    return model


def load_for_this_device(
    source: ModelSource,
    prune: Callable[[nn.Module], object] | None = None,
    dtype: str | None = None,
    cpu: bool | None = None,
) -> nn.Module:
    """What a rank computes with: `dtype` where its group's plan names one; else on CPU dense
    float32 (4-bit / bf16 matmul is 10-20x slower there), elsewhere the model's own dtype and
    quantisation. `cpu`: the plan's word (default: no GPU here)."""
    if cpu is None:
        cpu = not (mx.metal.is_available() or mx.cuda.is_available())
    chosen = getattr(mx, dtype) if dtype else (mx.float32 if cpu else None)
    return load_model(source, dtype=chosen, dequantize=cpu, prune=prune)


def _random_model(config: dict[str, Any], dtype: mx.Dtype, seed: int = 0) -> nn.Module:
    """mlx-lm's own initialisation from a fixed seed: every rank builds the same weights. Nothing
    is materialised until load_model evaluates (after any pruning)."""
    model_class, args_class = _model_classes(config["model_type"])
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.eval()
    _cast_floats(model, dtype)
    return model


def _model_classes(architecture: str) -> tuple[Any, Any]:
    module = importlib.import_module(f"mlx_lm.models.{architecture}")
    return module.Model, module.ModelArgs


def _load_hf_dir(path: Path, dtype: mx.Dtype, dequantize: bool) -> nn.Module:
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load_model as mlx_lm_load_model

    model, _ = mlx_lm_load_model(path, lazy=True)
    if dequantize:
        model = dequantize_model(model)
    _cast_floats(model, dtype)
    return model


def _cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Every float parameter to dtype; the packed uint32 weights of quantized layers stay."""
    model.set_dtype(dtype, predicate=lambda current: mx.issubdtype(current, mx.floating))


def _load_gguf(path: Path, dtype: mx.Dtype, dequantize: bool) -> nn.Module:
    loaded = mx.load(str(path), return_metadata=True)
    arrays, raw_metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    metadata = {key: _to_python(value) for key, value in raw_metadata.items()}
    config = config_from_gguf_metadata(metadata, arrays)
    model_class, args_class = _model_classes(config["model_type"])
    model = model_class(args_class.from_dict(config))
    model.eval()
    rope_factors = arrays.pop("rope_freqs.weight", None)
    weights = {_mlx_lm_name(name, path): array for name, array in arrays.items()}
    quantized = _quantization_params(model, weights)
    if dequantize:
        for module_path, params in quantized.items():
            packed, scales, biases = (
                weights.pop(f"{module_path}.{leaf}") for leaf in ("weight", "scales", "biases")
            )
            # float32 scales: dequantizing with float16 ones is 3x slower on CPU (2.0 s vs 0.7 s).
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
            weights[f"{module_path}.weight"] = mx.dequantize(packed, scales, biases, **params)
    else:
        nn.quantize(model, class_predicate=lambda module_path, _: quantized.get(module_path, False))
    model.load_weights(list(weights.items()), strict=True)
    _cast_floats(model, dtype)
    if rope_factors is not None:
        _use_rope_factors(model, rope_factors, config)
    return model


def _to_python(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _mlx_lm_name(gguf_name: str, path: Path) -> str:
    parts = gguf_name.split(".")
    try:
        if parts[0] == "blk":
            return ".".join(["model.layers", parts[1], _GGUF_LAYER_NAMES[parts[2]], *parts[3:]])
        return ".".join([_GGUF_TOP_NAMES[parts[0]], *parts[1:]])
    except (KeyError, IndexError):
        raise UnknownModelError(
            f"{path}: GGUF tensor {gguf_name!r} has no place in mlx-lm's Llama / Qwen model"
        ) from None


def _quantization_params(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, dict]:
    """Module path -> {bits, group_size} for every weight the GGUF stored quantized."""
    params = {}
    for module_path, module in model.named_modules():
        scales = weights.get(f"{module_path}.scales")
        if scales is None:
            continue
        in_features = module.weight.shape[-1]  # Linear: (out, in); Embedding: (vocab, dims)
        packed_columns = weights[f"{module_path}.weight"].shape[-1]
        params[module_path] = {
            "group_size": in_features // scales.shape[-1],
            "bits": packed_columns * 32 // in_features,
        }
    return params


class _FactorRoPE(nn.Module):
    """RoPE with per-frequency divisors, as Llama 3.x GGUFs store them (rope_freqs.weight)."""

    def __init__(self, dims: int, base: float, traditional: bool, factors: mx.array) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        exponents = mx.arange(0, dims, 2, dtype=mx.float32) / dims
        self._freqs = (base**exponents) * factors.astype(mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


def _use_rope_factors(model: nn.Module, factors: mx.array, config: dict[str, Any]) -> None:
    for layer in model.layers:
        layer.self_attn.rope = _FactorRoPE(
            config["head_dim"],
            config["rope_theta"],
            config.get("rope_traditional", False),
            factors,
        )


ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def make_tiny_model_dir(
    path: Path,
    architecture: Literal["llama", "qwen2", "qwen3"],
    *,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    dtype: str = "float32",
) -> Path:
    """An HF / mlx-lm model dir with random weights and SmolLM2's tokenizer (vocab 49152)."""
    tokenizer = load_tokenizer(resolve_model("smollm2", allowed_dirs=None))  # built in
    config = {
        "model_type": architecture,
        "architectures": [ARCHITECTURE_CLASSES[architecture]],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": q_heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "vocab_size": len(tokenizer.hf),
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "bos_token_id": tokenizer.hf.bos_token_id,
        "eos_token_id": tokenizer.hf.eos_token_id,
    }
    model_class, args_class = _model_classes(architecture)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    _cast_floats(model, getattr(mx, dtype))
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.hf.save_pretrained(path)
    return path
