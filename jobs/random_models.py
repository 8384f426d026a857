"""Random-weight models shaped like real ones, for benchmarks: `random:llama-3.1-8b` and friends.

Nothing is downloaded or stored: every rank builds the same weights from a fixed seed, so a
Llama-3-8B-shaped bf16 model costs no disk and loads in seconds. Their tokenizer is byte-level
(256 tokens, no merges, no EOS), which is all a benchmark prompt needs. No MLX here.
"""

from typing import Any

from admission.model_shape import layer_parameters

PREFIX = "random:"
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
PRESETS: dict[str, dict[str, Any]] = {
    # Llama-3-8B's shape with Llama 3.1's 128K context.
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
    },
    # Qwen2.5-7B-Instruct-1M's shape: 28 layers, 4 KV heads of 128 (56 KiB of bf16 KV a token),
    # biased q/k/v, a million-token context.
    "qwen2.5-7b-1m": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000000.0,
        "max_position_embeddings": 1010000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Small enough for the test suite on a CPU.
    "tiny-qwen2": {
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    },
    "tiny-llama": {
        **_LLAMA3,
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 16384,
        "torch_dtype": "float32",
    },
}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def is_random(name: str) -> bool:
    return name.startswith(PREFIX)


def preset_config(name: str) -> dict[str, Any] | None:
    """mlx-lm's config for `random:<preset>`; None when the preset does not exist."""
    preset = PRESETS.get(name.removeprefix(PREFIX))
    return None if preset is None else dict(preset)


def parameter_count(config: dict[str, Any]) -> int:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    block = layer_parameters(
        hidden,
        config["intermediate_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    layer = block + 2 * hidden  # and its two norms
    head = 0 if config["tie_word_embeddings"] else vocab * hidden
    return vocab * hidden + config["num_hidden_layers"] * layer + hidden + head


def byte_tokenizer(name: str) -> Any:
    """A transformers fast tokenizer over the 256 byte symbols (GPT-2's byte-level alphabet),
    which is how text is encoded, and a word for every other id of the model's vocabulary (id
    300 decodes to " w300"), so that what a random model generates decodes to comparable text.
    No merges: encoding never yields the words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    words = range(len(vocab), (preset_config(name) or {}).get("vocab_size", 0))
    vocab.update({f"\u0120w{index}": index for index in words})  # U+0120: byte-level " "
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, chat_template=CHAT_TEMPLATE, name_or_path=name
    )
