"""Tiny random-weight Llama / Qwen2 / Qwen3 models for multi-process tests (saved, so every rank
loads the same weights)."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama, qwen2, qwen3

ARCHITECTURES = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3}


def save_tiny(path: Path, architecture: str, seed: int = 0, layers: int = 2) -> Path:
    config = {
        "model_type": architecture,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": 1000,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": architecture == "qwen3",  # Qwen2 here: an untied head
    }
    mx.random.seed(seed)
    model = build(config)
    # Larger weights than the default init so logits spread out and greedy tokens vary.
    model.update(tree_map(lambda p: p * 4 if p.ndim == 2 else p, model.parameters()))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return path


def build(config: dict) -> nn.Module:
    module = ARCHITECTURES[config["model_type"]]
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def load_tiny(path: Path) -> nn.Module:
    model = build(json.loads((path / "config.json").read_text()))
    model.load_weights(str(path / "model.safetensors"))
    mx.eval(model.parameters())
    return model
