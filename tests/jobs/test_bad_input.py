"""A corpus of bad submissions through the real entry points: `ringq submit` and `ringq batch
submit` (click, and a few as real processes), `jobs.submit.submit_job` and JobSpec. Each gets a
one-line error that names the problem, no traceback, and nothing is enqueued. Then the kinds of
bad job only the dispatcher can spot go through a running cluster: each ends failed with its
reason, the services stay up, and a good job still finishes after them."""

import gzip
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest
from click.testing import CliRunner, Result
from pydantic import ValidationError

from cli.main import cli
from jobs.errors import InvalidJobError, RingqError
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobSpec
from jobs.settings import get_settings
from jobs.store import JobStore
from jobs.submit import admit_data, admit_queue, submit_job
from tests.helpers import wait_for

LIMIT_BYTES = 1_000_000  # RINGQ_MAX_DOCUMENT_BYTES for these tests
GOOD_MODEL = "random:tiny-llama"
GOOD_LINE = {"custom_id": "good", "document": "A fine document.", "model": GOOD_MODEL}
JOB_TIMEOUT_S = 60

# name -> (bytes, what the error says)
BAD_DOCUMENTS: dict[str, tuple[bytes, str]] = {
    "empty.txt": (b"", "at least 1 character"),
    "blank.txt": (b" \n\t\r\n ", "the document is empty"),
    "bom-only.txt": (b"\xef\xbb\xbf", "at least 1 character"),
    "bom-blank.txt": (b"\xef\xbb\xbf \n", "the document is empty"),
    "nul.txt": (b"abc\x00def", "NUL bytes"),
    "zeros.bin": (bytes(4096), "NUL bytes"),
    "elf.bin": (b"\x7fELF\x02\x01\x01\x00" + bytes(56), "NUL bytes"),
    "random.bin": (b"\xff" + random.Random(6).randbytes(4095), "not UTF-8"),
    "latin1.txt": ("café au lait".encode("latin-1"), "not UTF-8"),
    "utf16.txt": ("hello".encode("utf-16"), "not UTF-8"),
    "utf32.txt": ("hello".encode("utf-32"), "not UTF-8"),
    "continuation.txt": (b"abc\x80def", "not UTF-8"),
    "truncated.txt": (b"abc\xe2\x82", "not UTF-8"),
    "overlong.txt": (b"\xc0\xaf", "not UTF-8"),
    "surrogate.txt": (b"a\xed\xa0\x80b", "not UTF-8"),
    "png.bin": (b"\x89PNG\r\n\x1a\n" + bytes(16), "not UTF-8"),
    "gzip.bin": (gzip.compress(b"hello"), "not UTF-8"),
}
BIG_DOCUMENTS = {"huge-100mb.txt": 100 * 1024 * 1024, "just-over.txt": LIMIT_BYTES + 1}

LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
GOOD_HEADER = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}


def safetensors_bytes(header: Any) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(4)


# A directory model: name -> (config.json text or None, model.safetensors bytes or None)
BAD_MODEL_DIRS: dict[str, tuple[str | None, bytes | None, str]] = {
    "no-config": (None, safetensors_bytes(GOOD_HEADER), "not found"),
    "config-bad-json": ("{model_type: llama", safetensors_bytes(GOOD_HEADER), "cannot read"),
    "config-binary": ("\udcff", safetensors_bytes(GOOD_HEADER), "cannot read"),
    "config-list": ('["model_type"]', safetensors_bytes(GOOD_HEADER), "names no model_type"),
    "config-deep": ("[" * 100_000, safetensors_bytes(GOOD_HEADER), "cannot read"),
    "config-no-type": ('{"hidden_size": 64}', safetensors_bytes(GOOD_HEADER), "no model_type"),
    "config-gpt2": ('{"model_type": "gpt2"}', safetensors_bytes(GOOD_HEADER), "'gpt2' model"),
    "config-type-int": ('{"model_type": 5}', safetensors_bytes(GOOD_HEADER), "is a 5 model"),
    "config-no-sizes": ('{"model_type": "llama"}', safetensors_bytes(GOOD_HEADER), "lacks"),
    "config-negative": (
        json.dumps({**LLAMA_CONFIG, "hidden_size": -64}),
        safetensors_bytes(GOOD_HEADER),
        "positive integers for hidden_size",
    ),
    "config-string-size": (
        json.dumps({**LLAMA_CONFIG, "num_hidden_layers": "2"}),
        safetensors_bytes(GOOD_HEADER),
        "num_hidden_layers",
    ),
    "no-weights": (json.dumps(LLAMA_CONFIG), None, "no model*.safetensors"),
    "st-short": (json.dumps(LLAMA_CONFIG), b"\x01\x02\x03", "not a readable safetensors"),
    "st-huge-length": (
        json.dumps(LLAMA_CONFIG),
        (2**63).to_bytes(8, "little") + b"{}",
        "longer than the file",
    ),
    "st-garbage": (json.dumps(LLAMA_CONFIG), (8).to_bytes(8, "little") + b"\xff" * 8, "readable"),
    "st-list": (json.dumps(LLAMA_CONFIG), safetensors_bytes([1, 2]), "not a JSON object"),
    "st-bad-entry": (json.dumps(LLAMA_CONFIG), safetensors_bytes({"w": {"dtype": "F32"}}), "lacks"),
}
BAD_GGUF_FILES = {
    "empty.gguf": b"",
    "text.gguf": b"hello, not a model",
    "random.gguf": random.Random(7).randbytes(4096),
    "huge-counts.gguf": b"GGUF" + (3).to_bytes(4, "little") + (10**15).to_bytes(8, "little") * 2,
    # one metadata entry announced, its key cut short
    "truncated.gguf": b"GGUF"
    + (3).to_bytes(4, "little")
    + (0).to_bytes(8, "little")
    + (1).to_bytes(8, "little")
    + (20).to_bytes(8, "little")
    + b"general.",
}


def bad_models() -> list[tuple[str, str]]:
    """(--model value with {d} for the corpus dir, what the error says)."""
    models = [
        ("gpt-4o-mini", "not found"),
        ("random:gpt-5", "no random model"),
        ("random:", "no random model"),
        ("{d}/missing.gguf", "not found"),
        ("{d}/missing-dir", "not found"),
        ("{d}/good.txt", "not found"),
        ("{d}/empty-dir", "not found"),
        ("{d}/loop.gguf", "Symlink loop"),
        ("~no-such-user-ringq/m.gguf", "home directory"),
        ("a" * 5000, "File name too long"),
    ]
    models += [(f"{{d}}/{name}", "not a readable GGUF") for name in BAD_GGUF_FILES]
    models += [(f"{{d}}/{name}", expect) for name, (_, _, expect) in BAD_MODEL_DIRS.items()]
    return models


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Every bad file the cases name, made once."""
    d = tmp_path_factory.mktemp("bad-input")
    (d / "good.txt").write_text("A good document.")
    for name, (data, _) in BAD_DOCUMENTS.items():
        (d / name).write_bytes(data)
    for name, size_bytes in BIG_DOCUMENTS.items():
        with (d / name).open("wb") as file:
            file.truncate(size_bytes)  # sparse: a 100 MB file costs no disk
    (d / "empty-dir").mkdir()
    (d / "hidden-only").mkdir()
    (d / "hidden-only" / ".secret").write_text("hidden")
    (d / "mixed").mkdir()
    (d / "mixed" / "a.txt").write_text("fine")
    (d / "mixed" / "b.bin").write_bytes(b"\xff\xfe")
    os.mkfifo(d / "fifo")
    (d / "loop.txt").symlink_to(d / "loop.txt")
    (d / "loop.gguf").symlink_to(d / "loop.gguf")
    for name, data in BAD_GGUF_FILES.items():
        (d / name).write_bytes(data)
    for name, (config, weights, _) in BAD_MODEL_DIRS.items():
        (d / name).mkdir()
        if config is not None:
            (d / name / "config.json").write_bytes(config.encode("utf-8", "surrogateescape"))
        if weights is not None:
            (d / name / "model.safetensors").write_bytes(weights)
    return d


@pytest.fixture
def ringq(corpus, redis_url, redis_conn) -> Iterator:
    """Run `ringq ARGS` in-process against the (emptied) test Redis; '{d}' in an argument is
    the corpus dir. Settings are cached per process: cleared around each run."""
    env = {
        "RINGQ_REDIS_URL": redis_url,
        "RINGQ_MAX_DOCUMENT_BYTES": str(LIMIT_BYTES),
        "RINGQ_DEFAULT_MODEL": GOOD_MODEL,
    }

    def invoke(*args: str, stdin: bytes | None = None) -> Result:
        get_settings.cache_clear()
        try:
            filled = [arg.replace("{d}", str(corpus)) for arg in args]
            return CliRunner().invoke(cli, filled, input=stdin, env=env)
        finally:
            get_settings.cache_clear()

    yield invoke


def assert_refused(result: Result, expect: str, redis_conn) -> None:
    """Exit 1, one 'Error: ...' line naming the problem, no traceback, nothing in Redis."""
    problem = f"exit {result.exit_code}, stdout {result.stdout!r}, stderr {result.stderr!r}"
    assert result.exit_code in (1, 2), problem
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {result.exception!r}: {problem}"
    )
    assert "Traceback" not in result.output and result.stdout == "", problem
    assert "Error: " in result.stderr, problem  # click's usage errors add the usage above
    assert any(part in result.stderr for part in expect.split("|")), (
        f"expected {expect!r}: {problem}"
    )
    assert redis_conn.dbsize() == 0, f"something was written: {redis_conn.keys()}"


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    expect: str
    stdin: bytes | None = None


def submit_cases() -> list[Case]:
    """`ringq submit` with bad files, options, models and stdin."""
    good = "{d}/good.txt"
    cases = []
    for name, (_, expect) in BAD_DOCUMENTS.items():
        for kind in ("prefill", "generate"):
            cases.append(Case(f"doc-{name}-{kind}", ("submit", kind, f"{{d}}/{name}"), expect))
    for name in BIG_DOCUMENTS:
        for kind in ("prefill", "generate"):
            args = ("submit", kind, f"{{d}}/{name}")
            cases.append(Case(f"doc-{name}-{kind}", args, f"over the limit of {LIMIT_BYTES}"))
    paths = {
        "missing": ("{d}/missing.txt", "no such file"),
        "empty-dir": ("{d}/empty-dir", "a directory with no files"),
        "hidden-only": ("{d}/hidden-only", "a directory with no files"),
        "no-glob-match": ("{d}/*.nomatch", "no files match"),
        "dev-null": ("/dev/null", "not a regular file"),
        "fifo": ("{d}/fifo", "not a regular file"),
        "symlink-loop": ("{d}/loop.txt", "no such file"),
        "name-too-long": ("{d}/" + "a" * 300, "File name too long"),
        "dir-with-a-binary": ("{d}/mixed", "b.bin: not UTF-8"),
    }
    for key, (path, expect) in paths.items():
        cases.append(Case(f"path-{key}", ("submit", "prefill", path), expect))
    cases.append(Case("path-stdin-twice", ("submit", "prefill", "-", "-"), "can be given once"))
    options = {
        "--max-tokens": ["0", "-1", "32769", "1000000000000", "abc", "1.5", ""],
        "--temperature": ["-0.1", "5.1", "nan", "inf", "-inf", "1e400", "hot", ""],
        "--ranks": ["0", "-2", "65", "1000", "x", "1.5", "", "auto2"],
        "--strategy": ["bogus", "RING", ""],
        "--id": ["-x", "a b", "x" * 65, "../etc", "a/b", "é", "a:b", ".hidden"],
    }
    for option, values in options.items():
        # click's own errors name the option, JobSpec's the field
        expect = (
            "invalid job id" if option == "--id" else f"{option}|{option[2:].replace('-', '_')}"
        )
        for value in values:
            with_option = ("submit", "generate", good, f"{option}={value}")
            cases.append(Case(f"opt{option}={value[:12]!r}", with_option, expect))
    cases += [
        Case(
            "single-with-ring-2",
            ("submit", "prefill", good, "--strategy=single", "--ranks=2"),
            "ranks=2",
        ),
        Case(
            "id-for-two-files",
            ("submit", "prefill", good, "{d}/mixed/a.txt", "--id=x"),
            "--id names one job",
        ),
        Case("kind-decode", ("submit", "decode", good), "'decode' is not one of"),
        Case("kind-upper", ("submit", "PREFILL", good), "'PREFILL' is not one of"),
        Case("no-file", ("submit", "prefill"), "Missing argument"),
        Case(
            "prompt-surrogate",
            ("submit", "generate", good, "--prompt", "why\udcff"),
            "not valid Unicode",
        ),
    ]
    for index, (model, expect) in enumerate(bad_models()):
        cases.append(
            Case(
                f"model-{index}-{model[-20:]}",
                ("submit", "prefill", good, "--model", model),
                expect,
            )
        )
    stdin = {
        "empty": (b"", "at least 1 character"),
        "binary": (b"\x00\x01\x02", "NUL bytes"),
        "not-utf8": (b"\xff\xfe\xfd", "not UTF-8"),
        "blank": (b"  \n\n", "the document is empty"),
        "over-limit": (b"a" * (LIMIT_BYTES + 1), f"over the limit of {LIMIT_BYTES}"),
    }
    for key, (data, expect) in stdin.items():
        cases.append(Case(f"stdin-{key}", ("submit", "prefill", "-"), expect, data))
    return cases


def plain(**fields: Any) -> dict[str, Any]:
    return {"custom_id": "bad", "document": "A document.", **fields}


def openai(body: Any = None, **fields: Any) -> dict[str, Any]:
    if body is None:
        body = {"messages": [{"role": "user", "content": "What is ringq?"}]}
    line = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return {**line, **fields}


def messages(*items: Any, **body: Any) -> dict[str, Any]:
    return {"messages": list(items), **body}


USER = {"role": "user", "content": "What is ringq?"}
BAD_LINES: list[tuple[str, str | dict[str, Any], str]] = [
    ("not-json", "not json", "invalid JSON"),
    ("open-brace", "{", "invalid JSON"),
    ("truncated", '{"custom_id": "bad", "document": "x"', "invalid JSON"),
    ("trailing-comma", '{"custom_id": "bad", "document": "x",}', "invalid JSON"),
    ("single-quotes", "{'custom_id': 'bad'}", "invalid JSON"),
    ("array", "[1, 2]", "expected a JSON object, got list"),
    ("number", "42", "expected a JSON object, got int"),
    ("string", '"text"', "expected a JSON object, got str"),
    ("null", "null", "expected a JSON object, got NoneType"),
    ("deep-array", "[" * 100_000 + "]" * 100_000, "invalid JSON"),
    ("deep-object", '{"a":' * 100_000 + "1" + "}" * 100_000, "invalid JSON"),
    (
        "huge-int",
        '{"custom_id": "bad", "document": "x", "max_tokens": ' + "9" * 5000 + "}",
        "invalid JSON",
    ),
    ("nul-byte-raw", '{"custom_id": "bad", "document": "a\x00b"}', "invalid JSON"),
    ("empty-object", {}, "custom_id"),
    ("no-custom-id", {"document": "x"}, "custom_id: Field required"),
    ("custom-id-int", plain(custom_id=5), "custom_id: Input should be a valid string"),
    ("custom-id-empty", plain(custom_id=""), "custom_id: String should have at least 1"),
    ("custom-id-long", plain(custom_id="c" * 300), "custom_id: String should have at most 256"),
    ("custom-id-null", plain(custom_id=None), "custom_id"),
    ("custom-id-repeat", plain(custom_id="good"), "repeats line 1"),
    ("custom-id-surrogate", plain(custom_id="\ud800"), "custom_id"),
    ("both-documents", plain(document_path="good.txt"), "exactly one of"),
    ("no-document", {"custom_id": "bad"}, "exactly one of"),
    ("document-int", plain(document=5), "document: Input should be a valid string"),
    ("document-list", plain(document=["a"]), "document: Input should be a valid string"),
    ("document-empty", plain(document=""), "document: String should have at least 1"),
    ("document-blank", plain(document=" \n\t"), "the document is empty"),
    ("document-nul", plain(document="a\x00b"), "NUL bytes"),
    ("document-surrogate", plain(document="a\ud800b"), "document: Input should be a valid string"),
    ("document-over-limit", plain(document="a" * (LIMIT_BYTES + 1)), "over the limit"),
    ("kind-decode", plain(kind="decode"), "kind: Input should be 'prefill' or 'generate'"),
    ("kind-int", plain(kind=1), "kind: Input should be 'prefill' or 'generate'"),
    ("max-tokens-string", plain(max_tokens="5"), "max_tokens: Input should be a valid integer"),
    ("max-tokens-negative", plain(max_tokens=-1), "max_tokens: Input should be greater than"),
    ("max-tokens-zero", plain(max_tokens=0), "max_tokens: Input should be greater than"),
    ("max-tokens-absurd", plain(max_tokens=10**12), "max_tokens: Input should be less than"),
    ("max-tokens-float", plain(max_tokens=1.5), "max_tokens: Input should be a valid integer"),
    ("max-tokens-bool", plain(max_tokens=True), "max_tokens: Input should be a valid integer"),
    ("max-tokens-huge", plain(max_tokens=10**400), "max_tokens: Input should be less than"),
    ("temperature-negative", plain(temperature=-1), "temperature: Input should be greater"),
    ("temperature-high", plain(temperature=6), "temperature: Input should be less than"),
    ("temperature-string", plain(temperature="hot"), "temperature: Input should be a valid"),
    (
        "temperature-1e400",
        '{"custom_id": "bad", "document": "x", "temperature": 1e400}',
        "temperature: Input should be less than",
    ),
    (
        "temperature-nan",
        '{"custom_id": "bad", "document": "x", "temperature": NaN}',
        "temperature: Input should be less than",
    ),
    (
        "temperature-inf",
        '{"custom_id": "bad", "document": "x", "temperature": -Infinity}',
        "temperature: Input should be greater",
    ),
    ("model-unknown", plain(model="gpt-4o-mini"), "not found"),
    ("model-int", plain(model=5), "model: Input should be a valid string"),
    ("model-random", plain(model="random:nope"), "no random model"),
    ("model-nul", plain(model="a\x00b"), "embedded null byte"),
    ("model-long", plain(model="m" * 5000), "File name too long"),
    ("model-path", plain(model="/no/such/model.gguf"), "not found"),
    ("model-bad-gguf", plain(model="text.gguf"), "not found"),
    ("prompt-int", plain(prompt=5), "prompt: Input should be a valid string"),
    ("prompt-surrogate", plain(prompt="\udcff"), "prompt: Value error, not valid Unicode"),
    ("unknown-field", plain(promt="typo"), "promt: Extra inputs are not permitted"),
    ("ring-size-field", plain(ring_size=2), "ring_size: Extra inputs are not permitted"),
    ("path-missing", plain(document=None, document_path="missing.txt"), "No such file"),
    ("path-dir", plain(document=None, document_path="."), "not a regular file"),
    ("path-empty", plain(document=None, document_path=""), "not a regular file"),
    ("path-binary", plain(document=None, document_path="zeros.bin"), "NUL bytes"),
    ("path-not-utf8", plain(document=None, document_path="latin1.txt"), "not UTF-8"),
    ("path-empty-file", plain(document=None, document_path="empty.txt"), "at least 1"),
    ("path-100mb", plain(document=None, document_path="huge-100mb.txt"), "over the limit"),
    ("path-dev-null", plain(document=None, document_path="/dev/null"), "not a regular file"),
    ("path-dev-zero", plain(document=None, document_path="/dev/zero"), "not a regular file"),
    ("path-fifo", plain(document=None, document_path="fifo"), "not a regular file"),
    ("path-nul", plain(document=None, document_path="a\x00b"), "embedded null byte"),
    ("path-loop", plain(document=None, document_path="loop.txt"), "Symlink loop"),
    ("path-long", plain(document=None, document_path="p" * 5000), "File name too long"),
    ("path-int", plain(document=None, document_path=5), "document_path: Input should be"),
    ("openai-get", openai(method="GET"), "method: Input should be 'POST'"),
    ("openai-url", openai(url="/v1/embeddings"), "url: Input should be '/v1/chat/completions'"),
    (
        "openai-no-body",
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions"},
        "body: Field required",
    ),
    ("openai-body-list", openai(body=[1]), "body: Input should be a valid dictionary"),
    ("openai-no-messages", openai(body={"max_tokens": 5}), "body.messages: Field required"),
    ("openai-messages-empty", openai(body=messages()), "body.messages: List should have at"),
    ("openai-messages-string", openai(body={"messages": "hi"}), "body.messages: Input should"),
    ("openai-message-string", openai(body=messages("hi")), "body.messages.0: Input should"),
    (
        "openai-last-assistant",
        openai(body=messages(USER, {"role": "assistant", "content": "x"})),
        "role 'assistant' is not supported",
    ),
    (
        "openai-tool",
        openai(body=messages({"role": "tool", "content": "x"}, USER)),
        "role 'tool' is not supported",
    ),
    (
        "openai-role-int",
        openai(body=messages({"role": 5, "content": "x"})),
        "role: Input should be a valid string",
    ),
    ("openai-content-int", openai(body=messages({"role": "user", "content": 5})), "content"),
    ("openai-content-null", openai(body=messages({"role": "user", "content": None})), "content"),
    (
        "openai-content-image",
        openai(
            body=messages({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})
        ),
        "content.list[TextPart].0.type: Input should be 'text'",
    ),
    (
        "openai-content-empty-list",
        openai(body=messages({"role": "user", "content": []})),
        "document: String should have at least 1",
    ),
    (
        "openai-content-empty",
        openai(body=messages({"role": "user", "content": ""})),
        "document: String should have at least 1",
    ),
    (
        "openai-content-surrogate",
        openai(body=messages({"role": "user", "content": "\ud800"})),
        "unicode string",
    ),
    (
        "openai-last-system",
        openai(body=messages(USER, {"role": "system", "content": "x"})),
        "the last message must be the user's",
    ),
    (
        "openai-max-tokens-negative",
        openai(body=messages(USER, max_tokens=-5)),
        "max_tokens: Input should be greater than",
    ),
    (
        "openai-max-completion-zero",
        openai(body=messages(USER, max_completion_tokens=0)),
        "max_tokens: Input should be greater than",
    ),
    (
        "openai-max-tokens-string",
        openai(body=messages(USER, max_tokens="64")),
        "body.max_tokens: Input should be a valid integer",
    ),
    (
        "openai-temperature",
        openai(body=messages(USER, temperature=9)),
        "temperature: Input should be less than",
    ),
    ("openai-model-unknown", openai(body=messages(USER, model="gpt-4o")), "not found"),
    (
        "openai-no-custom-id",
        {k: v for k, v in openai().items() if k != "custom_id"},
        "custom_id: Field required",
    ),
]


def batch_file_cases() -> list[Case]:
    """`ringq batch submit` with files that are bad as a whole, and bad options."""
    return [
        Case("batch-empty", ("batch", "submit", "{d}/empty.txt"), "no requests"),
        Case("batch-blank", ("batch", "submit", "{d}/blank.txt"), "no requests"),
        Case("batch-bom-only", ("batch", "submit", "{d}/bom-only.txt"), "no requests"),
        Case("batch-binary", ("batch", "submit", "{d}/zeros.bin"), "line 1: invalid JSON"),
        Case("batch-random", ("batch", "submit", "{d}/random.bin"), "not UTF-8"),
        Case("batch-utf16", ("batch", "submit", "{d}/utf16.txt"), "not UTF-8"),
        Case("batch-latin1", ("batch", "submit", "{d}/latin1.txt"), "not UTF-8"),
        Case("batch-gzip", ("batch", "submit", "{d}/gzip.bin"), "not UTF-8"),
        Case("batch-missing", ("batch", "submit", "{d}/missing.jsonl"), "No such file"),
        Case("batch-dir", ("batch", "submit", "{d}/empty-dir"), "is a directory"),
        Case("batch-100mb", ("batch", "submit", "{d}/huge-100mb.txt"), "line 1: invalid JSON"),
        Case("batch-text", ("batch", "submit", "{d}/good.txt"), "line 1: invalid JSON"),
        Case(
            "batch-max-tokens-0",
            ("batch", "submit", "{d}/good.txt", "--max-tokens=0"),
            "--max-tokens",
        ),
        Case(
            "batch-max-tokens-abc",
            ("batch", "submit", "{d}/good.txt", "--max-tokens=abc"),
            "--max-tokens",
        ),
        Case(
            "batch-model-unknown",
            ("batch", "submit", "{d}/all-good.jsonl", "--model=nope"),
            "line 1: model 'nope' does not run here (see the hint). Hint: model 'nope' not found",
        ),
        Case(
            "batch-skip-invalid-all-bad",
            ("batch", "submit", "{d}/all-bad.jsonl", "--skip-invalid"),
            "2 invalid line(s)",
        ),
    ]


@pytest.mark.parametrize("case", submit_cases() + batch_file_cases(), ids=lambda case: case.id)
def test_a_bad_submission_is_refused_clearly(case: Case, ringq, corpus, redis_conn):
    (corpus / "all-good.jsonl").write_text(json.dumps(GOOD_LINE) + "\n")
    (corpus / "all-bad.jsonl").write_text("nope\n[]\n")
    assert_refused(ringq(*case.args, "--json", stdin=case.stdin), case.expect, redis_conn)


@pytest.mark.parametrize(
    ("line", "expect"),
    [pytest.param(line, expect, id=name) for name, line, expect in BAD_LINES],
)
def test_a_bad_batch_line_refuses_the_batch(line, expect, ringq, corpus, redis_conn):
    """A good line, then the bad one: the error names line 2 and nothing is enqueued."""
    text = line if isinstance(line, str) else json.dumps(line)
    path = corpus / "batch.jsonl"
    path.write_text(json.dumps(GOOD_LINE) + "\n" + text + "\n", errors="surrogatepass")
    result = ringq("batch", "submit", str(path), "--json")
    assert_refused(result, expect, redis_conn)
    assert "line 2: " in result.stderr and "line 1: " not in result.stderr
    skipped = ringq("batch", "submit", str(path), "--skip-invalid", "--json")
    assert skipped.exit_code == 0, skipped.output  # the good line alone is enqueued
    assert json.loads(skipped.stdout)["total"] == 1 and admit_queue(redis_conn).count == 1


def test_file_names_that_are_not_utf8_are_escaped(ringq, tmp_path, redis_conn):
    """Such names reach Python as lone surrogates, which JSON cannot hold: the job keeps a
    backslash-escaped name instead of failing to serialise."""
    document = tmp_path / os.fsdecode(b"caf\xe9.txt")
    document.write_text("A document with an odd name.")
    batch = tmp_path / os.fsdecode(b"b\xe9.jsonl")
    batch.write_text(json.dumps({"custom_id": "a", "document_path": document.name}) + "\n")
    submitted = ringq("submit", "prefill", str(document), "--json")
    assert submitted.exit_code == 0, submitted.output
    record = JobStore(redis_conn).get(json.loads(submitted.stdout)["id"])
    assert record.spec.document_name == "caf\\udce9.txt"
    batched = ringq("batch", "submit", str(batch), "--json")
    assert batched.exit_code == 0, batched.output
    assert json.loads(batched.stdout)["input_name"] == "b\\udce9.jsonl"


BAD_SPECS: list[tuple[str, dict[str, Any], str]] = [
    ("no-kind", {"document": "x"}, "kind"),
    ("kind-bogus", {"kind": "decode", "document": "x"}, "kind"),
    ("kind-none", {"kind": None, "document": "x"}, "kind"),
    ("no-document", {"kind": "prefill"}, "document"),
    ("document-none", {"kind": "prefill", "document": None}, "document"),
    ("document-int", {"kind": "prefill", "document": 5}, "document"),
    ("document-dict", {"kind": "prefill", "document": {"a": 1}}, "document"),
    ("document-bytes-nul", {"kind": "prefill", "document": "\x00"}, "NUL"),
    ("max-tokens-abc", {"kind": "prefill", "document": "x", "max_tokens": "abc"}, "max_tokens"),
    ("max-tokens-list", {"kind": "prefill", "document": "x", "max_tokens": [1]}, "max_tokens"),
    ("max-tokens-1.5", {"kind": "prefill", "document": "x", "max_tokens": 1.5}, "max_tokens"),
    ("temperature-x", {"kind": "prefill", "document": "x", "temperature": "x"}, "temperature"),
    ("ranks-big", {"kind": "prefill", "document": "x", "ranks": "big"}, "ranks"),
    ("ranks-0", {"kind": "prefill", "document": "x", "ranks": 0}, "ranks"),
    ("strategy-x", {"kind": "prefill", "document": "x", "strategy": "x"}, "strategy"),
    (
        "single-ring-3",
        {"kind": "prefill", "document": "x", "strategy": "single", "ranks": 3},
        "ranks=3",
    ),
    ("custom-id-empty", {"kind": "prefill", "document": "x", "custom_id": ""}, "custom_id"),
    ("model-empty", {"kind": "prefill", "document": "x", "model": ""}, "model"),
    ("model-none", {"kind": "prefill", "document": "x", "model": None}, "model"),
    ("unknown-field", {"kind": "prefill", "document": "x", "priority": 1}, "priority"),
    (
        "name-surrogate",
        {"kind": "prefill", "document": "x", "document_name": "\udcff"},
        "document_name",
    ),
    ("prompt-surrogate", {"kind": "generate", "document": "x", "prompt": "\ud800"}, "prompt"),
]


@pytest.mark.parametrize(
    ("fields", "expect"), [pytest.param(f, e, id=name) for name, f, e in BAD_SPECS]
)
def test_a_bad_job_spec_names_the_field(fields, expect):
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(fields)
    assert expect in str(caught.value)


BAD_SUBMITS: list[tuple[str, str | None, str, str]] = [
    (f"id-{job_id[:10]!r}", job_id, GOOD_MODEL, "invalid job id")
    for job_id in ("-a", "a b", "a" * 65, "../x", "a/b", "é", "a\x00", "a\n", ".x", "_x")
] + [
    ("existing-id", "taken", GOOD_MODEL, "already exists"),
    ("model-name", None, "gpt-4o-mini", "not found"),
    ("model-random", None, "random:gpt-5", "no random model"),
    ("model-nul", None, "m\x00", "embedded null byte"),
    ("model-long", None, "m" * 5000, "File name too long"),
    ("model-home", None, "~no-such-user-ringq/m", "home directory"),
]


@pytest.mark.parametrize(
    ("job_id", "model", "expect"), [pytest.param(*case[1:], id=case[0]) for case in BAD_SUBMITS]
)
def test_submit_job_refuses_with_a_ringq_error(job_id, model, expect, redis_conn):
    spec = JobSpec(kind="prefill", document="A document.", model=model)
    taken = submit_job(redis_conn, spec.model_copy(update={"model": GOOD_MODEL}), "taken")
    keys_before = sorted(redis_conn.keys())
    with pytest.raises(RingqError, match=expect):
        submit_job(redis_conn, spec, job_id)
    assert sorted(redis_conn.keys()) == keys_before and admit_queue(redis_conn).count == 1
    assert JobStore(redis_conn).get("taken") == taken  # the existing job is untouched


def test_the_real_entry_point_prints_one_line(corpus):
    """`python -m cli.main` (what the `ringq` script runs): one 'Error:' line on stderr."""
    env = {**os.environ, "RINGQ_MAX_DOCUMENT_BYTES": str(LIMIT_BYTES), "RINGQ_REDIS_URL": ""}
    runs = [
        (["submit", "prefill", str(corpus / "huge-100mb.txt"), "--json"], "over the limit"),
        (["batch", "submit", str(corpus / "random.bin"), "--json"], "not UTF-8"),
    ]
    command = [sys.executable, "-m", "cli.main"]
    processes = [
        subprocess.Popen([*command, *args], env=env, stdout=PIPE, stderr=PIPE, text=True)
        for args, _ in runs  # side by side: each spends a second or more importing
    ]
    for (args, expect), process in zip(runs, processes, strict=True):
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode in (1, 2) and stdout == "", (args, stdout, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith("Error: "), stderr
        assert expect in stderr and "Traceback" not in stderr


def test_the_corpus_is_big_enough():
    cases = len(submit_cases()) + len(batch_file_cases()) + len(BAD_LINES)
    assert cases + len(BAD_SPECS) + len(BAD_SUBMITS) >= 200


# --- through a running cluster -------------------------------------------------------------


def wait_final(store: JobStore, job_id: str):
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (record := store.get(job_id)).state.is_final:
        assert time.monotonic() < deadline, f"job {job_id} stuck in {record.state}: {record}"
        time.sleep(0.1)
    return record


def test_bad_jobs_fail_in_the_cluster_and_it_stays_up(cluster, corpus):
    store = JobStore(connect(cluster.url))
    run = f"bad-{time.monotonic_ns()}"  # the session cluster keeps its jobs: fresh ids
    tiny = {"kind": "prefill", "model": GOOD_MODEL}
    submitted = {
        "over-context": (JobSpec(document="x" * 17_000, **tiny), "exceeds"),
        "over-context-with-answer": (
            JobSpec(kind="generate", document="x" * 16_000, model=GOOD_MODEL, max_tokens=1000),
            "+ 1000 to generate exceeds random:tiny-llama's context of 16384 tokens: shorten",
        ),
        "over-memory": (
            JobSpec(kind="prefill", document="A short one.", model="random:llama-3.1-8b"),
            "does not fit on the live nodes",
        ),
        "more-ranks-than-nodes": (
            JobSpec(document="short", ranks=8, **tiny),
            "8 nodes; 2 live",
        ),
        # past submit's model check, as if the model went away before admission
        "model-gone": (
            JobSpec(document="short", kind="prefill", model=str(corpus / "gone")),
            "not found",
        ),
        "model-garbage": (
            JobSpec(document="short", kind="prefill", model=str(corpus / "text.gguf")),
            "not a readable GGUF",
        ),
        "model-bad-config": (
            JobSpec(document="short", kind="prefill", model=str(corpus / "config-no-sizes")),
            "lacks positive integers",
        ),
    }
    for name, (spec, _) in submitted.items():
        store.create(f"{run}-{name}", spec)  # submit_job, less its model check
        admit_queue(store.conn).enqueue_many([admit_data(f"{run}-{name}")])
    with pytest.raises(InvalidJobError, match="already exists"):
        submit_job(store.conn, JobSpec(document="again", **tiny), f"{run}-over-context")
    [orphan] = admit_queue(store.conn).enqueue_many([admit_data(f"{run}-no-record")])

    problems = []
    for name, (_, expect) in submitted.items():
        record = wait_final(store, f"{run}-{name}")
        if record.state != JobState.FAILED or expect not in (record.error or ""):
            problems.append(f"{name}: {record.state} {record.error!r}, expected {expect!r}")
    assert problems == []
    assert store.get(f"{run}-over-context").document_chars == 17_000  # not overwritten
    wait_for(lambda: orphan.get_status(refresh=True) in ("finished", "failed"), "the orphan admit")
    cluster.check_children()  # the dispatcher and both node agents are alive

    good = submit_job(store.conn, JobSpec(document="A good short document.", **tiny))
    assert wait_final(store, good.id).state == JobState.FINISHED
    cluster.check_children()
