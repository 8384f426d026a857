"""What submit needs to know about a model, cached under RINGQ_HOME by file identity.

Checking a model fully reads the whole GGUF metadata (about 3 s for SmolLM2 on 2 cores); submit
needs only the context length and the longest token in bytes, kept in
`RINGQ_HOME/cache/models.json` by the file's path, size and mtime. The dispatcher tokenises every
job anyway and checks it exactly."""

import contextlib
import json
import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from jobs.errors import InvalidJobError, ModelNotServedError, RingqError, UnknownModelError
from jobs.files import allowed_path
from jobs.model_rule import is_built_in, served_model
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings

CACHE_VERSION = 1
_SEEN: dict[str, "ModelInfo"] = {}  # this process's answers, by file identity


class ModelInfo(BaseModel):
    """The numbers submit checks a job against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    context_length: int
    max_token_bytes: int | None = None  # longest token's bytes; None: not known (no bound)


def model_info(name: str, settings: Settings) -> ModelInfo:
    """The model's ModelInfo: from the cache when its file is unchanged, else read and checked
    (resolve_model: UnknownModelError for a model ringq cannot run) and cached."""
    key = _identity(name, settings.allowed_dirs)
    if key is not None and key in _SEEN:
        return _SEEN[key]
    cache_file = settings.home / "cache" / "models.json"
    cached = _read_cache(cache_file)
    info = None
    if key is not None and key in cached:
        with contextlib.suppress(ValidationError):  # a damaged entry: read the model again
            info = ModelInfo.model_validate(cached[key])
    if info is None:
        info = _read_model(name, settings.allowed_dirs)
        if key is not None:
            cached[key] = info.model_dump(mode="json")
            _write_cache(cache_file, cached)
    if key is not None:
        _SEEN[key] = info
    return info


def served_model_info(name: str, settings: Settings) -> ModelInfo:
    """ModelInfo of the model `name` runs as (jobs.model_rule.served_model). Where
    RINGQ_ALLOWED_DIRS is set, a path that is no model ringq runs is refused as one outside it
    (ModelNotServedError): the message does not tell a missing file from an unreadable one."""
    target = served_model(name, settings)
    try:
        return model_info(target, settings)
    except UnknownModelError as exc:
        if is_built_in(target) or settings.allowed_dirs is None:
            raise
        raise ModelNotServedError(name, reason=str(exc)) from None


def check_spec(spec: JobSpec, settings: Settings) -> JobSpec:
    """What submit checks without a tokenizer: the model runs here, and max_tokens leaves room
    for the document in its context (the dispatcher checks the exact count again). Returns
    the spec with its model as it runs (an alias replaced by its target)."""
    info = served_model_info(spec.model, settings)
    if info.name != spec.model:
        spec = spec.model_copy(update={"model": info.name})
    generated = spec.max_tokens if spec.kind == JobKind.GENERATE else 0
    lower_bound = prompt_tokens_lower_bound(spec.document, info)
    check_context(spec.model, info.context_length, lower_bound, generated, exact=False)
    return spec


def check_context(
    model: str,
    context_length: int,
    prompt_tokens: int,
    max_tokens: int,
    *,
    exact: bool,
) -> None:
    """InvalidJobError when prompt + max_tokens exceed the context, saying which number to
    lower. `exact`: prompt_tokens is the real count; else a lower bound (at submit, before the
    dispatcher tokenises)."""
    if prompt_tokens + max_tokens <= context_length:
        return
    room = context_length - prompt_tokens
    if exact:
        prompt = f"prompt of {prompt_tokens} tokens"
        lower = f"lower max_tokens to at most {room}"
    else:  # the dispatcher knows the real count (chat template included): a limit, not a number
        prompt = f"prompt of at least {prompt_tokens} tokens"
        lower = f"lower max_tokens below {room}"
    param = "max_tokens"
    if room < 1:
        fix, param = "shorten the document: the prompt alone fills the context", "document"
    elif max_tokens <= context_length // 2:  # mostly document: the document is what to cut
        fix = f"shorten the document, or {lower}"
    else:
        fix = lower
    raise InvalidJobError(
        f"{prompt} + {max_tokens} to generate exceeds {model}'s context of "
        f"{context_length} tokens: {fix}",
        param,
    )


def prompt_tokens_lower_bound(text: str, info: ModelInfo) -> int:
    """No tokenizer: a token covers at most `max_token_bytes` bytes of UTF-8 text."""
    if not info.max_token_bytes:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / info.max_token_bytes)


def _identity(name: str, allowed_dirs: Sequence[Path] | None) -> str | None:
    """`path|size|mtime_ns` of the model's file (GGUF) or config.json (directory); None for
    random models (nothing to read) and paths that do not exist (resolve_model says why)."""
    from jobs import model_catalog, random_models

    if random_models.is_random(name):
        return None
    try:
        if name in model_catalog.PACKAGED_MODELS:
            path = _packaged_file(name)
        else:
            path = allowed_path(Path(name).expanduser(), allowed_dirs, "model")
            if path.is_dir():
                path = path / "config.json"
        stat = path.stat()
    except (OSError, ValueError, RuntimeError, RingqError):
        return None
    return f"v{CACHE_VERSION}|{name}|{path}|{stat.st_size}|{stat.st_mtime_ns}"


@lru_cache(maxsize=8)
def _packaged_file(name: str) -> Path:
    from jobs.model_catalog import packaged_file  # finding it lists the package's files

    return packaged_file(name)


def _read_model(name: str, allowed_dirs: Sequence[Path] | None) -> ModelInfo:
    from jobs.model_catalog import read_model_shape, resolve_model
    from jobs.tokenizer import max_token_bytes

    source = resolve_model(name, allowed_dirs=allowed_dirs)
    try:
        shape = read_model_shape(source)
    except ValueError as exc:
        raise UnknownModelError(f"model {name!r}: {exc}") from None
    return ModelInfo(
        name=name,
        context_length=shape.context_length,
        max_token_bytes=max_token_bytes(source),
    )


def _read_cache(file: Path) -> dict[str, object]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(file: Path, entries: dict[str, object]) -> None:
    """Atomic (a temporary file renamed over it), so concurrent submits never read half a file;
    a cache that cannot be written only costs speed."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        temporary = file.with_name(f".{file.name}.{os.getpid()}")
        temporary.write_text(json.dumps(entries), encoding="utf-8")
        temporary.replace(file)
    except OSError:
        pass
