"""load_model on the real SmolLM2 GGUF and on tiny random models of both architectures, written as
HF dirs (make_tiny_model_dir) and as GGUF files the way llama.cpp's converter writes them."""

import json
from pathlib import Path
from typing import cast

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate, stream_generate
from mlx_lm.tokenizer_utils import TokenizerWrapper

from jobs.model_catalog import ModelSource, read_model_shape, resolve_model
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.models import load_model, make_tiny_model_dir

TINY = {"layers": 2, "hidden": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 16}
# Limits measured on PROMPT_IDS (see the tests), with a stated margin.
# Measured 2026-12-01, MLX CPU, max |logit difference| over PROMPT_IDS (logits up to 41.8):
QUANTIZED_ATOL = 5e-4  # 1.3e-4 with OpenBLAS preloaded (as ranks run), 0.0 without; ~4x margin
FLOAT16_ATOL = 0.25  # 0.124 (mean 0.020), the same with and without OpenBLAS; 2x margin
PROMPT_IDS = [1, 4093, 198, 19556, 905, 17, 216, 34, 32, 34, 36, 2, 198, 1, 520, 198]


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model("smollm2", allowed_dirs=None)


@pytest.fixture(scope="module")
def smollm2_model(smollm2: ModelSource) -> nn.Module:
    return load_model(smollm2)


def logits(model: nn.Module, ids: list[int]) -> mx.array:
    out = model(mx.array([ids]))
    mx.eval(out)
    return out


def test_smollm2_dequantized_matches_quantized(smollm2, smollm2_model):
    quantized = load_model(smollm2, dequantize=False)
    assert isinstance(quantized.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert (quantized.model.layers[0].mlp.up_proj.bits, quantized.model.embed_tokens.bits) == (4, 8)
    dense = smollm2_model
    assert isinstance(dense.model.layers[0].mlp.up_proj, nn.Linear)
    assert dense.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    expected, actual = logits(dense, PROMPT_IDS), logits(quantized, PROMPT_IDS)
    # Same weights, two kernels (measured 2026-12-01 on MLX CPU; QUANTIZED_ATOL says what).
    assert mx.abs(actual - expected).max().item() < QUANTIZED_ATOL
    assert mx.array_equal(actual.argmax(-1), expected.argmax(-1))


def test_smollm2_answers_the_capital_of_france(smollm2, smollm2_model):
    tokenizer = load_tokenizer(smollm2)
    prompt = tokenizer.chat_tokens([{"role": "user", "content": "What is the capital of France?"}])
    wrapper = TokenizerWrapper(tokenizer.hf, eos_token_ids=tokenizer.eos_token_ids)
    answer = generate(smollm2_model, wrapper, prompt=prompt, max_tokens=20)
    assert "Paris" in answer


def test_smollm2_float16_stays_close_to_float32(smollm2, smollm2_model):
    half = load_model(smollm2, dtype=mx.float16)
    assert half.model.norm.weight.dtype == mx.float16
    expected, actual = logits(smollm2_model, PROMPT_IDS), logits(half, PROMPT_IDS)
    assert mx.abs(actual.astype(mx.float32) - expected).max().item() < FLOAT16_ATOL


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_tiny_model_dir_loads_and_runs(tmp_path, architecture):
    source = resolve_model(
        str(make_tiny_model_dir(tmp_path / architecture, architecture)), allowed_dirs=None
    )
    model = load_model(source)
    out = logits(model, PROMPT_IDS)
    assert out.shape == (1, len(PROMPT_IDS), 49152)
    assert out.dtype == mx.float32
    assert mx.isfinite(out).all().item()
    if architecture == "qwen3":
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    shape = read_model_shape(source)
    assert (shape.architecture, shape.layers, shape.hidden_size) == (architecture, 2, 64)
    assert (shape.q_heads, shape.kv_heads, shape.head_dim, shape.vocab_size) == (4, 2, 16, 49152)
    parameters = sum(value.size for _, value in tree_flatten(model.parameters()))
    assert shape.dense_weight_bytes == shape.weight_bytes == parameters * 4


def test_tiny_model_dir_is_reproducible_and_keeps_its_dtype(tmp_path):
    first = make_tiny_model_dir(tmp_path / "a", "llama", seed=3, dtype="bfloat16")
    second = make_tiny_model_dir(tmp_path / "b", "llama", seed=3, dtype="bfloat16")
    model = load_model(resolve_model(str(first), allowed_dirs=None))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    again = load_model(resolve_model(str(second), allowed_dirs=None))
    assert mx.array_equal(logits(model, PROMPT_IDS), logits(again, PROMPT_IDS))
    widened = load_model(resolve_model(str(first), allowed_dirs=None), dtype=mx.float32)
    assert widened.model.embed_tokens.weight.dtype == mx.float32


def test_mlx_lm_generate_runs_on_a_tiny_model(tmp_path):
    source = resolve_model(str(make_tiny_model_dir(tmp_path / "tiny", "qwen3")), allowed_dirs=None)
    tokenizer = load_tokenizer(source)
    wrapper = TokenizerWrapper(tokenizer.hf, eos_token_ids=tokenizer.eos_token_ids)
    prompt = tokenizer.chat_tokens([{"role": "user", "content": "Hello"}])
    responses = list(stream_generate(load_model(source), wrapper, prompt=prompt, max_tokens=5))
    assert 1 <= responses[-1].generation_tokens <= 5
    assert responses[-1].prompt_tokens == len(prompt)


def test_quantized_hf_dir_loads_both_ways(tmp_path):
    path = make_tiny_model_dir(tmp_path / "tiny", "llama")
    model = load_model(resolve_model(str(path), allowed_dirs=None))
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    source = resolve_model(str(path), allowed_dirs=None)
    packed = load_model(source, dequantize=False)
    dense = load_model(source)
    assert isinstance(packed.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(dense.model.layers[0].self_attn.q_proj, nn.Linear)
    expected, actual = logits(packed, PROMPT_IDS), logits(dense, PROMPT_IDS)
    assert mx.abs(actual - expected).max().item() < 1e-4
    shape = read_model_shape(source)
    parameters = sum(value.size for _, value in tree_flatten(dense.parameters()))
    assert shape.dense_weight_bytes == parameters * 4
    assert shape.weight_bytes < shape.dense_weight_bytes / 4


# llama.cpp tensor names for the mlx-lm ones, and its converter's Q/K row permutation (Llama only).
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute_for_interleaved_rope(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        return f"blk.{index}.{GGUF_NAMES[module]}.{leaf}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }[name]


def write_gguf(hf_dir: Path, path: Path, rope_factors: np.ndarray | None = None) -> Path:
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = config["model_type"]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    weights = cast(dict[str, mx.array], mx.load(str(hf_dir / "model.safetensors")))
    for name, value in weights.items():
        weight = np.array(value.astype(mx.float32))
        if architecture == "llama" and name.endswith("q_proj.weight"):
            weight = permute_for_interleaved_rope(weight, config["num_attention_heads"])
        if architecture == "llama" and name.endswith("k_proj.weight"):
            weight = permute_for_interleaved_rope(weight, config["num_key_value_heads"])
        writer.add_tensor(gguf_name(name), weight)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_gguf_matches_the_hf_dir_it_was_converted_from(tmp_path, architecture):
    hf_dir = make_tiny_model_dir(tmp_path / "hf", architecture, **TINY)
    gguf_source = resolve_model(str(write_gguf(hf_dir, tmp_path / "tiny.gguf")), allowed_dirs=None)
    assert gguf_source.format == "gguf"
    expected = logits(load_model(resolve_model(str(hf_dir), allowed_dirs=None)), PROMPT_IDS)
    actual = logits(load_model(gguf_source), PROMPT_IDS)
    assert mx.allclose(actual, expected, atol=1e-4).item()


def test_gguf_rope_factors_scale_the_rope_frequencies(tmp_path):
    hf_dir = make_tiny_model_dir(tmp_path / "hf", "llama", **TINY)
    factors = np.full(TINY["head_dim"] // 2, 2.0)
    gguf_source = resolve_model(
        str(write_gguf(hf_dir, tmp_path / "t.gguf", rope_factors=factors)), allowed_dirs=None
    )
    # Dividing every frequency by 2 is linear RoPE scaling with factor 2.
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (hf_dir / "config.json").write_text(json.dumps(config))
    expected = logits(load_model(resolve_model(str(hf_dir), allowed_dirs=None)), PROMPT_IDS)
    actual = logits(load_model(gguf_source), PROMPT_IDS)
    assert mx.allclose(actual, expected, atol=1e-4).item()
