"""A job's prompt tokens, and the check that they fit its model's context."""

from collections.abc import Sequence
from pathlib import Path

from admission.model_shape import ModelShape
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.model_files import ModelSource
from jobs.model_info import check_context
from jobs.schemas import JobKind, JobSpec
from jobs.tokenizer import load_tokenizer

CPU_COMPUTE_DTYPE = "float32"  # admission plans in float32; GPU nodes scale it to their dtype


def tokenize_and_check(
    spec: JobSpec, tokens: list[int] | None = None, *, allowed_dirs: Sequence[Path] | None
) -> tuple[list[int], ModelShape]:
    """The job's prompt tokens (given ones are reused) and its model's shape (float32);
    InvalidJobError past the model's context. The model must lie in `allowed_dirs`."""
    source = resolve_model(spec.model, allowed_dirs=allowed_dirs)
    tokens = prompt_tokens(spec, source) if tokens is None else tokens
    shape = read_model_shape(source, dtype=CPU_COMPUTE_DTYPE)
    # says which number to lower: max_tokens or the document
    check_context(spec.model, shape.context_length, len(tokens), new_tokens(spec), exact=True)
    return tokens, shape


def new_tokens(spec: JobSpec) -> int:
    return spec.max_tokens if spec.kind == JobKind.GENERATE else 0


def prompt_tokens(spec: JobSpec, source: ModelSource) -> list[int]:
    tokenizer = load_tokenizer(source)
    if spec.kind == JobKind.PREFILL and spec.keep_cache:
        # as a generate job's prompt begins: its cache then serves questions on this document
        return tokenizer.chat_tokens([{"role": "user", "content": spec.document.rstrip()}])
    if spec.kind == JobKind.PREFILL:
        return tokenizer.encode(spec.document)
    message = "\n\n".join(part for part in (spec.document.rstrip(), spec.prompt_text()) if part)
    return tokenizer.chat_tokens([{"role": "user", "content": message}])
