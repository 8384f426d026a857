"""Stop strings and partial text, with a real (byte-level) tokenizer."""

import pytest

from jobs.model_catalog import resolve_model
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.decode_text import cut_at_stop, partial_result, stop_check


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("random:tiny-llama", allowed_dirs=None))  # a token per byte


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello. World", ["."], "Hello"),
        ("a END b STOP", ["STOP", "END"], "a "),
        ("nothing here", ["X"], "nothing here"),
        ("", ["X"], ""),
    ],
)
def test_cut_at_stop(text, stops, expected):
    assert cut_at_stop(text, stops) == expected


def test_stop_check_fires_at_the_token_that_completes_the_stop_string(tokenizer):
    tokens = tokenizer.encode("one two END three", add_special_tokens=False)
    reached = stop_check(tokenizer, ["END"])
    assert reached is not None
    fired = [n for n in range(1, len(tokens) + 1) if reached(tokens[:n])]
    assert fired[0] == len("one two END")
    assert stop_check(tokenizer, []) is None


def test_partial_result_keeps_the_text_generated_before_a_cancel(tokenizer):
    tokens = tokenizer.encode("partial answer. more", add_special_tokens=False)
    result = partial_result(tokenizer, tokens, prompt_tokens=12, stops=["."])
    assert result is not None and result.text == "partial answer"
    assert (result.prompt_tokens, result.generated_tokens) == (12, len(tokens))
    assert partial_result(tokenizer, [], prompt_tokens=12, stops=[]) is None
