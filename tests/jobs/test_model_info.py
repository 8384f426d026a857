"""Model metadata cached by file identity, and the context check submit makes with it."""

import json
import os

import pytest

from jobs import model_info
from jobs.errors import InvalidJobError, UnknownModelError
from jobs.model_info import ModelInfo, check_context, prompt_tokens_lower_bound
from jobs.settings import get_settings


@pytest.fixture
def fresh(monkeypatch, short_tmp_path):
    """An empty RINGQ_HOME and no answers remembered by this process."""
    monkeypatch.setenv("RINGQ_HOME", str(short_tmp_path))
    monkeypatch.setattr(model_info, "_SEEN", {})
    get_settings.cache_clear()
    yield short_tmp_path / "cache" / "models.json"
    monkeypatch.undo()
    get_settings.cache_clear()


def test_info_is_cached_until_the_model_file_changes(fresh, monkeypatch, tiny_llama_dir):
    name = str(tiny_llama_dir)
    first = model_info.model_info(name, get_settings())
    assert first.context_length > 0 and first.max_token_bytes
    [(key, entry)] = json.loads(fresh.read_text()).items()
    assert key.endswith(f"|{os.stat(tiny_llama_dir / 'config.json').st_mtime_ns}")
    fresh.write_text(json.dumps({key: {**entry, "context_length": 77}}))  # marks a cache read
    monkeypatch.setattr(model_info, "_SEEN", {})
    assert model_info.model_info(name, get_settings()).context_length == 77
    config = tiny_llama_dir / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # rewritten
    monkeypatch.setattr(model_info, "_SEEN", {})
    try:
        assert model_info.model_info(name, get_settings()).context_length == first.context_length
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_damaged_cache_is_read_around(fresh, tiny_llama_dir):
    fresh.parent.mkdir(parents=True)
    fresh.write_text("{not json")
    assert model_info.model_info(str(tiny_llama_dir), get_settings()).context_length > 0
    assert json.loads(fresh.read_text())  # rewritten whole


def test_unknown_models_are_not_cached(fresh):
    with pytest.raises(UnknownModelError, match="not found"):
        model_info.model_info("gpt-4o-mini", get_settings())
    assert not fresh.exists()


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "exact", "message"),
    [
        (
            10,
            9000,
            False,
            "prompt of at least 10 tokens + 9000 to generate exceeds m's context "
            "of 8192 tokens: lower max_tokens below 8182",
        ),
        (
            8000,
            256,
            True,
            "prompt of 8000 tokens + 256 to generate exceeds m's context of 8192 "
            "tokens: shorten the document, or lower max_tokens to at most 192",
        ),
        (9000, 10, True, "shorten the document: the prompt alone fills the context"),
        (100, 8092, True, None),
    ],
)
def test_check_context_says_which_number_to_lower(prompt, max_tokens, exact, message):
    if message is None:
        check_context("m", 8192, prompt, max_tokens, exact=exact)
        return
    with pytest.raises(InvalidJobError) as raised:
        check_context("m", 8192, prompt, max_tokens, exact=exact)
    assert str(raised.value).endswith(message)


def test_prompt_lower_bound_never_exceeds_the_real_count():
    info = ModelInfo(name="m", context_length=10, max_token_bytes=4)
    assert prompt_tokens_lower_bound("abcdefghi", info) == 3
    assert prompt_tokens_lower_bound("é", info) == 1  # two bytes
    assert prompt_tokens_lower_bound("abc", info.model_copy(update={"max_token_bytes": None})) == 0
