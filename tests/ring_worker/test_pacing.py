"""Paced prefill (ring_worker/engine/pacing.py) computes exactly what the unpaced graph does. It
runs on
GPUs only; here it is forced on the CPU, where the arithmetic is the same float32."""

import mlx.core as mx
import pytest

from ring_worker.engine.engines import Engine
from ring_worker.engine.pacing import PacedLayer, paced_layers
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny, save_tiny


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    return load_tiny(save_tiny(tmp_path_factory.mktemp(request.param), request.param, layers=4))


@pytest.mark.parametrize("depth", [1, 2, 8])
def test_a_paced_prefill_equals_the_unpaced_one(model, depth):
    tokens, chunk = prompt_tokens(300), 64  # five chunks, the last one partial
    plain = Engine(model).prefill(tokens, chunk)
    with paced_layers(model, depth, force=True):
        assert all(isinstance(layer, PacedLayer) for layer in model.model.layers)
        paced = Engine(model).prefill(tokens, chunk)
    assert not any(isinstance(layer, PacedLayer) for layer in model.model.layers)
    assert mx.array_equal(plain.logits, paced.logits)
    for ours, theirs in zip(paced.cache, plain.cache, strict=True):
        assert ours.offset == theirs.offset == len(tokens)
        assert mx.array_equal(ours.state[0], theirs.state[0])
        assert mx.array_equal(ours.state[1], theirs.state[1])


def test_pacing_is_off_on_the_cpu_unless_forced(model):
    with paced_layers(model):
        assert not any(isinstance(layer, PacedLayer) for layer in model.model.layers)
