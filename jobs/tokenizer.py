"""A model's tokenizer: its HF fast tokenizer, or one rebuilt from a GGUF's metadata (llama.cpp's
byte-level BPE). No MLX here: the dispatcher tokenises every job."""

import json
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from jobs import random_models
from jobs.errors import InvalidJobError, UnknownModelError
from jobs.model_files import GgufFile, ModelSource, file_version, read_gguf, read_hf_config

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
        return _load_tokenizer_version(source, file_version(source.path))
    if source.format == "random":
        return _load_tokenizer_version(source, ())
    files = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")
    return _load_tokenizer_version(source, file_version(*(source.path / f for f in files)))


def max_token_bytes(source: ModelSource) -> int | None:
    """An upper bound on the UTF-8 bytes one token covers: a byte-level BPE token (the GGUF
    tokenizers we run) has a character per byte; other token texts never take fewer UTF-8
    bytes than they stand for. None: unknown."""
    if source.format == "random":
        return 1  # byte-level: a token per byte
    if source.format == "gguf":
        return max(map(len, read_gguf(source.path).tokens), default=None)
    else:
        try:
            raw = json.loads((source.path / "tokenizer.json").read_text(encoding="utf-8"))
            tokens = tuple(raw["model"]["vocab"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokens), default=None)


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
        config = read_hf_config(source.path)
        eos = config.get("eos_token_id")
        return ChatTokenizer(hf, [eos] if isinstance(eos, int) else eos or ())
    gguf = read_gguf(source.path)
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


def _byte_level_bpe(gguf: GgufFile, path: Path) -> Any:
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
