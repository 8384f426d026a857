"""Prefill FLOPs by the formula: per token of a causal prompt of N tokens, 2 P + 2 L d N."""

import pytest

from admission.model_shape import layer_parameters, prefill_flops

# Llama-3.1-8B: 32 layers, d 4096, MLP 14336, 32 query and 8 KV heads of 128.
LLAMA_8B_P = 32 * layer_parameters(4096, 14336, 32, 8, 128)


@pytest.mark.parametrize(
    ("tokens", "gflop_per_token"),
    [(32 * 1024, 22.6), (128 * 1024, 48.3)],  # the design notes' anchors
)
def test_llama_8b_per_token_flops_match_the_anchors(tokens, gflop_per_token):
    per_token = prefill_flops(LLAMA_8B_P, 32, 4096, 0, tokens) / tokens
    assert per_token / 1e9 == pytest.approx(gflop_per_token, abs=0.06)  # anchors: 3 digits


def test_a_range_costs_the_difference_of_its_ends():
    whole = prefill_flops(LLAMA_8B_P, 32, 4096, 0, 100_000)
    parts = prefill_flops(LLAMA_8B_P, 32, 4096, 0, 60_000) + prefill_flops(
        LLAMA_8B_P, 32, 4096, 60_000, 100_000
    )
    assert parts == pytest.approx(whole)
    with pytest.raises(ValueError):
        prefill_flops(LLAMA_8B_P, 32, 4096, 10, 5)
