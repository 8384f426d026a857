"""Text published while a sequence decodes (ring_worker/runtime/text_stream.py), with real
tokenizers:
the byte-level one of the random models (a token per byte, so multi-byte characters arrive in
pieces) and SmolLM2's BPE."""

import json
import math
import random

import pytest

from jobs.model_catalog import resolve_model
from jobs.schemas import JobKind, JobSpec
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.decode_text import cut_at_stop
from ring_worker.runtime.job_io import FileJobIO
from ring_worker.runtime.text_stream import DecodeText, TextStream, held_back

MULTI_BYTE = "héllo wörld — €5 💡 done\nnext line ✓ ok"


@pytest.fixture(scope="module")
def bytes_tokenizer():
    return load_tokenizer(resolve_model("random:tiny-llama", allowed_dirs=None))


@pytest.fixture(scope="module")
def bpe_tokenizer():
    return load_tokenizer(resolve_model("smollm2", allowed_dirs=None))


def published(tokenizer, tokens, stops=(), **throttle) -> tuple[list[str], TextStream]:
    deltas: list[str] = []
    stream = TextStream(tokenizer, stops, deltas.append, **throttle)
    for token in tokens:
        stream.push(token)
    stream.close()
    return deltas, stream


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("abc S", ["STOP"], 1),
        ("abc ST", ["STOP"], 2),
        ("abc STO", ["STOP", "TOAST"], 3),
        ("abc STOX", ["STOP"], 0),
        ("abc TO", ["STOP", "TOAST"], 2),
        ("abc", [], 0),
        ("S", ["STOP"], 1),
        ("abc STOP", ["STOP"], 0),  # a whole stop string is cut, not held
    ],
)
def test_held_back(text, stops, expected):
    assert held_back(text, stops) == expected


def test_multi_byte_characters_are_never_split(bytes_tokenizer):
    tokens = bytes_tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    assert len(tokens) == len(MULTI_BYTE.encode())  # a token per byte: characters come in pieces
    deltas, _ = published(bytes_tokenizer, tokens, flush_tokens=1)
    assert "".join(deltas) == MULTI_BYTE
    assert not any("\ufffd" in delta for delta in deltas)
    assert len(deltas) > 20  # flushed at (almost) every token


def test_text_from_a_stop_string_on_is_never_published(bytes_tokenizer):
    text = "a STAR b STOP never this"
    tokens = bytes_tokenizer.encode(text, add_special_tokens=False)
    deltas: list[str] = []
    stream = TextStream(bytes_tokenizer, ["STOP"], deltas.append, flush_tokens=1)
    for count, token in enumerate(tokens, 1):
        stream.push(token)
        sent = "".join(deltas)
        assert "STO" not in sent, f"after {text[:count]!r}: {sent!r}"
        if text[:count] == "a ST":
            assert sent == "a ", "a possible start of a stop string waits"
        if text[:count] == "a STA":
            assert sent == "a STA", "released once it cannot be one"
    stream.close()
    assert "".join(deltas) == "a STAR b " == stream.sent


def test_deltas_come_every_flush_tokens_or_interval(bytes_tokenizer):
    tokens = bytes_tokenizer.encode("x" * 40, add_special_tokens=False)
    deltas, _ = published(bytes_tokenizer, tokens, flush_tokens=16, flush_interval_s=math.inf)
    assert deltas == ["x" * 16, "x" * 16, "x" * 8]
    deltas, _ = published(bytes_tokenizer, tokens, flush_tokens=10**6, flush_interval_s=0.0)
    assert deltas == ["x"] * 40


# Newlines between pieces of multi-byte characters: where a line-by-line detokenizer can slip.
NEWLINES_AND_PIECES = "\n€💡é A"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("which", ["bytes", "bpe", "newlines"])
def test_deltas_add_up_to_the_result_text(request, which, seed):
    """Random tokens (invalid UTF-8, lone spaces, special tokens, newlines amid split
    characters): what is published is exactly the job's result text, `decode` of the tokens cut
    at the first stop string."""
    tokenizer = request.getfixturevalue(f"{'bpe' if which == 'bpe' else 'bytes'}_tokenizer")
    rng = random.Random(seed)
    if which == "newlines":  # a token per byte: these bytes in any order
        alphabet = sorted(set(tokenizer.encode(NEWLINES_AND_PIECES, add_special_tokens=False)))
        assert len(alphabet) == len(set(NEWLINES_AND_PIECES.encode()))
    else:
        alphabet = list(range(len(tokenizer.hf)))
    tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 300))]
    text = tokenizer.decode(tokens)
    stops = [text[len(text) // 2 : len(text) // 2 + 3]] if seed % 2 and len(text) > 6 else []
    flush_tokens = rng.randrange(1, 20)
    deltas, _ = published(
        tokenizer, tokens, stops, flush_tokens=flush_tokens, flush_interval_s=math.inf
    )
    assert "".join(deltas) == cut_at_stop(text, stops)
    assert all(deltas), "no empty deltas"


def test_end_of_sequence_tokens_are_not_text(bpe_tokenizer):
    tokens = bpe_tokenizer.encode("The answer is 42.", add_special_tokens=False)
    [eos, *_] = bpe_tokenizer.eos_token_ids
    deltas, _ = published(bpe_tokenizer, [*tokens, eos], flush_tokens=1)
    assert "".join(deltas) == "The answer is 42."


def file_io(tmp_path) -> FileJobIO:
    spec = JobSpec(kind=JobKind.GENERATE, model="random:tiny-llama", document="doc", max_tokens=64)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"id": "j1", "spec": spec.model_dump(mode="json"), "tokens": [1]}))
    return FileJobIO(job, tmp_path / "events.jsonl")


def text_events(io: FileJobIO) -> list[str]:
    if not io.events_path.exists():
        return []
    events = [json.loads(line) for line in io.events_path.read_text().splitlines()]
    return [event["data"] for event in events if event["event"] == "text"]


@pytest.mark.parametrize("lead", [True, False])
def test_decode_text_stops_every_rank_and_only_the_lead_publishes(bytes_tokenizer, tmp_path, lead):
    io = file_io(tmp_path)
    tokens = bytes_tokenizer.encode("one two END three", add_special_tokens=False)
    watch = DecodeText(io, bytes_tokenizer, ["END"], lead)
    stopped_at = next(n for n in range(1, len(tokens) + 1) if watch.stop_when(tokens[:n]))
    watch.close(tokens[:stopped_at])
    assert stopped_at == len("one two END")
    assert "".join(text_events(io)) == ("one two " if lead else "")


def test_decode_text_publishes_the_last_token_it_was_not_asked_about(bytes_tokenizer, tmp_path):
    """The engine does not call stop_when for the token that reaches max_tokens."""
    io = file_io(tmp_path)
    tokens = bytes_tokenizer.encode("all of it", add_special_tokens=False)
    watch = DecodeText(io, bytes_tokenizer, [], lead=True)
    for n in range(1, len(tokens)):
        assert not watch.stop_when(tokens[:n])
    watch.close(tokens)
    assert "".join(text_events(io)) == "all of it"


def test_a_paced_stream_publishes_that_many_times_less_often(bytes_tokenizer):
    """A member of a decode batch streams at sqrt(rows) times the single-job cadence
    (ring_worker/runtime/batch_serve.py `pace`): FLUSH_TOKENS x 4 here, and the same text in the
    end."""
    deltas: list[str] = []
    stream = TextStream(bytes_tokenizer, (), deltas.append)
    stream.pace(4)
    stream._flush_interval_s = math.inf  # tokens alone decide, whatever the machine's speed
    for token in bytes_tokenizer.encode("x" * 100, add_special_tokens=False):
        stream.push(token)
    stream.close()
    assert deltas == ["x" * 64, "x" * 36]
