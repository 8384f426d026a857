"""Reading a batch JSONL file into job specs, checking every line before anything is enqueued.

Two line forms (jobs/batch_lines.py), told apart by the presence of `url`, `method` or `body`:
- OpenAI Batch: a /v1/chat/completions body becomes a `generate` job. The conversation is
  flattened: the last message must be the user's and becomes the job's prompt; every message
  before it (system, developer, user), joined by blank lines, becomes the document. A single user
  message is all document, with an empty prompt. Assistant and tool messages are refused.
- Plain: `{"custom_id", "document" | "document_path", "prompt"?, "kind"?, "max_tokens"?,
  "temperature"?, "model"?, "stop"?, "seed"?}`; `document_path` is relative to the JSONL file's
  directory, a regular file, and inside RINGQ_ALLOWED_DIRS when that is set.

A line's own `model` is used unless the caller overrides every line's model (OpenAI files name
models ringq cannot run). Nothing is tokenised here: the dispatcher does that."""

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from jobs.batch_lines import CHAT_COMPLETIONS_URL as CHAT_COMPLETIONS_URL  # re-exported
from jobs.batch_lines import OpenAILine, PlainLine
from jobs.errors import BatchInputError, ForbiddenPathError, RingqError, UnknownModelError
from jobs.files import allowed_path, printable_name, read_at_most
from jobs.model_info import check_spec
from jobs.schemas import JobKind, JobSpec, SkippedLine
from jobs.settings import Settings, get_settings

LISTED_ERRORS = 20  # an error message names this many bad lines, then counts the rest
MODEL_LINE_END = "does not run here (see the hint)"  # how a line naming such a model ends


@dataclass(frozen=True)
class BatchItem:
    line_number: int
    custom_id: str
    spec: JobSpec


@dataclass(frozen=True)
class LineError:
    line_number: int
    message: str
    custom_id: str | None = None  # when the line names one
    bad_model: str | None = None  # the model the line names, when that is what is wrong
    param: str | None = None  # the field to change, when the check knows it

    def skipped(self) -> SkippedLine:
        """As kept on the batch (JSON): text that is not valid Unicode is escaped."""
        return SkippedLine(
            line_number=self.line_number,
            custom_id=_escaped(self.custom_id) if self.custom_id is not None else None,
            message=_escaped(self.message),
        )

    def __str__(self) -> str:
        return f"line {self.line_number}: {self.message}"


def _escaped(text: str) -> str:
    """Lone surrogates (bytes that were not UTF-8) as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Defaults:
    """What the caller sets for the whole batch: `model` overrides every line's model;
    `max_tokens` applies to lines that give none."""

    model: str | None
    default_model: str
    max_tokens: int
    max_document_bytes: int
    allowed_dirs: list[Path] | None = None  # RINGQ_ALLOWED_DIRS: where document_path may point

    @classmethod
    def of(cls, settings: Settings, model: str | None, max_tokens: int) -> "Defaults":
        """The defaults a local caller's settings give (RINGQ_DEFAULT_MODEL, _ALLOWED_DIRS, ...)."""
        return cls(
            model,
            settings.default_model,
            max_tokens,
            settings.max_document_bytes,
            settings.allowed_dirs,
        )


@dataclass(frozen=True)
class ParsedBatch:
    input_name: str
    items: list[BatchItem]
    errors: list[LineError]
    hint: str | None = None  # said once for all lines (lines naming models that do not run here)


def parse_batch_file(
    path: Path, defaults: Defaults, settings: Settings | None = None
) -> ParsedBatch:
    """Every line of `path` checked: good ones as items, bad ones as errors with line numbers."""
    try:
        with path.open(encoding="utf-8-sig") as file:  # tolerate a byte-order mark
            lines = file.read().splitlines()
    except OSError as exc:
        raise BatchInputError(f"cannot read {path}: {exc.strerror or exc}", []) from None
    except UnicodeDecodeError as exc:
        raise BatchInputError(
            f"{path}: not UTF-8 text (byte {exc.start}); a batch file is UTF-8 JSON Lines", []
        ) from None
    return parse_batch_lines(lines, path.parent, printable_name(path), defaults, settings)


def parse_batch_lines(
    lines: list[str],
    base_dir: Path,
    input_name: str,
    defaults: Defaults,
    settings: Settings | None = None,
) -> ParsedBatch:
    """Blank lines are skipped; duplicate custom ids fail the later line, naming the first.
    `settings`: the caller's, for the model checks (jobs.model_info); None: this process's."""
    items: list[BatchItem] = []
    errors: list[LineError] = []
    first_line: dict[str, int] = {}
    check = _SpecChecker(settings or get_settings())  # a library entry point, as submit_job
    for number, line in _numbered(lines):
        try:
            item = _parse_line(number, line, base_dir, defaults)
            item = replace(item, spec=check(item.spec))
        except (ValueError, RingqError) as exc:
            bad_model = exc.model if isinstance(exc, ModelNotRunError) else None
            param = getattr(exc, "param", None)
            message = _one_line(exc)
            errors.append(LineError(number, message, _custom_id_of(line), bad_model, param))
            continue
        if item.custom_id in first_line:
            first = first_line[item.custom_id]
            message = f"custom_id {item.custom_id!r} repeats line {first}"
            errors.append(LineError(number, message, item.custom_id))
            continue
        first_line[item.custom_id] = number
        items.append(item)
    return ParsedBatch(input_name, items, errors, model_hint(check.bad_models, defaults))


def model_hint(bad_models: dict[str, str], defaults: Defaults) -> str | None:
    """One hint for every line naming a model that does not run here (an OpenAI file's
    "gpt-4o-mini"): what is wrong with the first, and that --model overrides the lines'."""
    if not bad_models:
        return None
    first, reason = next(iter(bad_models.items()))
    names = ", ".join(repr(m) for m in bad_models)
    if defaults.model is not None:  # --model given: the lines' models were not used
        return reason
    return (
        f"lines name models that do not run here ({names}): {reason}; "
        f"`ringq batch submit --model {defaults.default_model}` runs every line on one model, "
        "overriding the lines' models, and RINGQ_MODEL_ALIASES maps names to served models"
    )


def require_valid(parsed: ParsedBatch, skip_invalid: bool) -> list[BatchItem]:
    """The items to enqueue. Any bad line refuses the batch unless `skip_invalid`; a batch with
    no good line is refused either way."""
    if not parsed.items and not parsed.errors:
        raise BatchInputError(f"{parsed.input_name}: no requests (the file has no lines)", [])
    if parsed.errors and (not skip_invalid or not parsed.items):
        raise BatchInputError(
            describe_errors(parsed), [(e.line_number, e.message) for e in parsed.errors]
        )
    return parsed.items


def describe_errors(parsed: ParsedBatch) -> str:
    """One line: how many lines are bad, the first LISTED_ERRORS of them, a count of the rest."""
    errors = parsed.errors
    listed = "; ".join(str(error) for error in errors[:LISTED_ERRORS])
    more = f"; and {len(errors) - LISTED_ERRORS} more" if len(errors) > LISTED_ERRORS else ""
    hint = " (--skip-invalid enqueues the good ones)" if parsed.items else ""
    model_hint = f". Hint: {parsed.hint}" if parsed.hint else ""
    return (
        f"{parsed.input_name}: {len(errors)} invalid line(s), nothing enqueued{hint}: "
        f"{listed}{more}{model_hint}"
    )


def _numbered(lines: list[str]) -> Iterator[tuple[int, str]]:
    for index, line in enumerate(lines):
        if line.strip():
            yield index + 1, line


def _parse_line(number: int, line: str, base_dir: Path, defaults: Defaults) -> BatchItem:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an integer of 5,000 digits, [[[[...]]]]
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
    try:
        if {"url", "method", "body"} & raw.keys():
            return _openai_item(number, OpenAILine.model_validate(raw), defaults)
        return _plain_item(number, PlainLine.model_validate(raw), base_dir, defaults)
    except ValidationError as exc:
        raise ValueError(_validation_text(exc)) from None


def _openai_item(number: int, line: OpenAILine, defaults: Defaults) -> BatchItem:
    body = line.body
    texts = [message.text() for message in body.messages]
    if body.messages[-1].role != "user":
        raise ValueError("the last message must be the user's (it is the question)")
    document, prompt = ("\n\n".join(texts[:-1]), texts[-1]) if len(texts) > 1 else (texts[0], "")
    spec = _spec(
        defaults,
        kind=JobKind.GENERATE,
        document=document,
        document_name=line.custom_id,
        prompt=prompt,
        model=body.model,
        max_tokens=first_given(body.max_completion_tokens, body.max_tokens),
        temperature=body.temperature,
        custom_id=line.custom_id,
        stop=body.stop_list(),
        seed=body.seed,
    )
    return BatchItem(number, line.custom_id, spec)


def _plain_item(number: int, line: PlainLine, base_dir: Path, defaults: Defaults) -> BatchItem:
    if line.document_path is not None:
        document, name = _read_document(base_dir / line.document_path, defaults)
    else:
        document, name = line.document or "", line.custom_id
    spec = _spec(
        defaults,
        kind=JobKind(line.kind),
        keep_cache=line.keep_cache,
        document=document,
        document_name=name,
        prompt=line.prompt,
        model=line.model,
        max_tokens=line.max_tokens,
        temperature=line.temperature,
        custom_id=line.custom_id,
        stop=line.stop,
        seed=line.seed,
    )
    return BatchItem(number, line.custom_id, spec)


def _spec(
    defaults: Defaults,
    *,
    document: str,
    model: str | None,
    max_tokens: int | None,
    temperature: float | None,
    **fields: Any,
) -> JobSpec:
    """A JobSpec with the batch's defaults; its own validation (empty document, ranges) applies."""
    # surrogatepass: a lone surrogate (not valid Unicode) is JobSpec's to report, by field.
    if len(document.encode("utf-8", "surrogatepass")) > defaults.max_document_bytes:
        raise ValueError(
            f"document over the limit of {defaults.max_document_bytes} bytes "
            "(RINGQ_MAX_DOCUMENT_BYTES)"
        )
    try:
        return JobSpec(
            document=document,
            model=defaults.model or model or defaults.default_model,
            max_tokens=max_tokens if max_tokens is not None else defaults.max_tokens,
            temperature=temperature if temperature is not None else 0.0,
            **fields,
        )
    except ValidationError as exc:
        raise ValueError(_validation_text(exc)) from None


def first_given(*values: int | None) -> int | None:
    return next((value for value in values if value is not None), None)


def _read_document(path: Path, defaults: Defaults) -> tuple[str, str]:
    """(text, name) of a regular UTF-8 file of at most max_document_bytes; ForbiddenPathError
    outside the allowed dirs."""
    max_bytes = defaults.max_document_bytes
    try:
        file = allowed_path(path, defaults.allowed_dirs, "document_path")
    except (ForbiddenPathError, OSError, ValueError, RuntimeError) as exc:
        if defaults.allowed_dirs is None:  # anywhere: the operator's own files (NUL, a loop)
            raise ValueError(f"document_path {path}: {exc}") from None
        raise ValueError(  # nothing on whether it exists or where it leads
            f"document_path {path}: outside RINGQ_ALLOWED_DIRS, where documents are read from"
        ) from None
    try:
        data = read_at_most(file, max_bytes)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise ValueError(f"document_path {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > max_bytes:
        raise ValueError(
            f"document_path {path}: over the limit of {max_bytes} bytes (RINGQ_MAX_DOCUMENT_BYTES)"
        )
    try:
        return data.decode("utf-8-sig"), printable_name(path)
    except UnicodeDecodeError as exc:
        raise ValueError(f"document_path {path}: not UTF-8 text (byte {exc.start})") from None


class ModelNotRunError(ValueError):
    """A line names a model that does not run here; the reason is said once, in the hint."""

    def __init__(self, model: str):
        super().__init__(f"model {model!r} {MODEL_LINE_END}")
        self.model = model


class _SpecChecker:
    """check_spec for each line; a model is looked up once, and every line naming a model that
    does not run gets a short error (the reason is said once, in the batch's hint)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bad_models: dict[str, str] = {}

    def __call__(self, spec: JobSpec) -> JobSpec:
        if spec.model in self.bad_models:
            raise ModelNotRunError(spec.model)
        try:
            return check_spec(spec, self.settings)
        except UnknownModelError as exc:
            self.bad_models[spec.model] = _one_line(exc)
            raise ModelNotRunError(spec.model) from None


def _custom_id_of(line: str) -> str | None:
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        return None
    value = raw.get("custom_id") if isinstance(raw, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 256 else None


def _validation_text(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    return "; ".join(parts)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
