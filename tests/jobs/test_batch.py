"""Batches: parsing tables with line numbers, then submit / status / results / cancel against a
real redis-server, and one batch run end to end on the cluster with the tiny model."""

import json
import time
from pathlib import Path

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.batch import (
    batch_counts,
    batch_results,
    cancel_batch,
    get_batch,
    submit_batch,
)
from jobs.batch_input import Defaults, parse_batch_lines, require_valid
from jobs.errors import BatchInputError, InvalidJobError
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobResult
from jobs.store import JobStore
from jobs.submit import admit_queue

DEFAULTS = Defaults(model=None, default_model="smollm2", max_tokens=64, max_document_bytes=1000)
URL = "/v1/chat/completions"


def plain(custom_id="a", **fields) -> str:
    return json.dumps({"custom_id": custom_id, **({"document": "Some text."} | fields)})


def chat(custom_id="a", messages=None, **body) -> str:
    if messages is None:
        messages = [{"role": "user", "content": "What is ringq?"}]
    line = {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"messages": messages}}
    line["body"].update(body)
    return json.dumps(line)


def parse(lines, base_dir=Path("."), defaults=DEFAULTS):
    return parse_batch_lines(lines, base_dir, "in.jsonl", defaults)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"document": "x"}', "custom_id: Field required"),
        ('{"custom_id": 5, "document": "x"}', "custom_id: Input should be a valid string"),
        ('{"custom_id": "a"}', "exactly one of 'document' and 'document_path'"),
        ('{"custom_id": "a", "document": "x", "colour": "red"}', "colour: Extra inputs"),
        (plain(document="  \n "), "the document is empty"),
        (plain(document="x" * 1001), "over the limit of 1000 bytes"),
        (plain(max_tokens="5"), "max_tokens: Input should be a valid integer"),
        (plain(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (plain(kind="decode"), "kind: Input should be 'prefill' or 'generate'"),
        (plain(model="gpt-17"), "model 'gpt-17' does not run here"),
        (plain(document=None, document_path="missing.txt"), "No such file"),
        (chat().replace(URL, "/v1/embeddings"), "url: Input should be '/v1/chat/completions'"),
        (chat().replace('"POST"', '"GET"'), "method: Input should be 'POST'"),
        (chat(messages=[]), "body.messages: List should have at least 1 item"),
        (
            chat(
                messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
            ),
            "role 'assistant' is not supported",
        ),
        (
            chat(messages=[{"role": "system", "content": "s"}]),
            "the last message must be the user's",
        ),
        (chat(temperature="hot"), "body.temperature: Input should be a valid number"),
    ],
)
def test_bad_line_is_reported_with_its_number(bad_line, message):
    parsed = parse([plain("good"), "", bad_line])  # the blank line still counts
    assert [item.custom_id for item in parsed.items] == ["good"]
    [error] = parsed.errors
    assert error.line_number == 3 and message in error.message, error
    assert "\n" not in error.message


@pytest.mark.parametrize(
    ("line", "document", "prompt", "kind", "max_tokens"),
    [
        (chat(), "What is ringq?", "", JobKind.GENERATE, 64),
        (
            chat(
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "A long report."},
                    {"role": "user", "content": [{"type": "text", "text": "Summarise it."}]},
                ],
                max_completion_tokens=9,
                max_tokens=99,
            ),
            "Be brief.\n\nA long report.",
            "Summarise it.",
            JobKind.GENERATE,
            9,
        ),
        (plain(prompt="Where?", max_tokens=5), "Some text.", "Where?", JobKind.GENERATE, 5),
        (plain(kind="prefill"), "Some text.", None, JobKind.PREFILL, 64),
    ],
)
def test_good_lines_become_job_specs(line, document, prompt, kind, max_tokens):
    [item] = require_valid(parse([line]), skip_invalid=False)
    spec = item.spec
    assert (spec.document, spec.prompt, spec.kind, spec.max_tokens) == (
        document,
        prompt,
        kind,
        max_tokens,
    )
    assert spec.custom_id == item.custom_id == "a" and spec.model == "smollm2"


def test_document_path_is_relative_to_the_file_and_model_can_be_overridden(
    tmp_path, tiny_llama_dir
):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "one.txt").write_text("The first document.")
    defaults = Defaults(str(tiny_llama_dir), "smollm2", 64, 1000)
    lines = [plain(document=None, document_path="docs/one.txt"), chat("b", model="gpt-4o-mini")]
    items = require_valid(parse(lines, tmp_path, defaults), skip_invalid=False)
    assert (
        items[0].spec.document == "The first document." and items[0].spec.document_name == "one.txt"
    )
    assert {item.spec.model for item in items} == {str(tiny_llama_dir)}


def test_duplicate_custom_ids_name_both_lines():
    parsed = parse([plain("x"), plain("y"), plain("x")])
    assert [item.custom_id for item in parsed.items] == ["x", "y"]
    assert [(e.line_number, e.message) for e in parsed.errors] == [
        (3, "custom_id 'x' repeats line 1")
    ]


def test_invalid_lines_refuse_the_batch_unless_skipped():
    lines = [plain("ok")] + [f"bad {n}" for n in range(25)]
    parsed = parse(lines)
    with pytest.raises(BatchInputError) as raised:
        require_valid(parsed, skip_invalid=False)
    message = str(raised.value)
    assert message.startswith("in.jsonl: 25 invalid line(s), nothing enqueued (--skip-invalid")
    assert "line 2: invalid JSON" in message and "line 21:" in message
    assert "line 22:" not in message and message.endswith("; and 5 more")
    assert len(raised.value.line_errors) == 25 and "\n" not in message
    assert [item.custom_id for item in require_valid(parsed, skip_invalid=True)] == ["ok"]


def test_openai_sampling_fields_are_honoured_or_refused_clearly():
    parsed = parse(
        [
            chat("s", stop="\n\n", seed=7, n=1, top_p=1),
            chat("l", stop=["END", "STOP"]),
            chat("n", n=3),
            chat("p", top_p=0.9),
            plain("q", stop=["."], seed=1),
        ]
    )
    specs = {item.custom_id: item.spec for item in parsed.items}
    assert (specs["s"].stop, specs["s"].seed) == (["\n\n"], 7)
    assert specs["l"].stop == ["END", "STOP"] and specs["l"].seed is None
    assert (specs["q"].stop, specs["q"].seed) == (["."], 1)
    errors = {e.custom_id: e.message for e in parsed.errors}
    assert "n=3: ringq returns one completion per request" in errors["n"]
    assert "top_p=0.9 is not supported" in errors["p"]


def test_lines_naming_models_that_do_not_run_here_get_one_hint():
    lines = [chat(f"c{n}", model="gpt-4o-mini") for n in range(30)]
    parsed = parse(lines)
    assert {e.message for e in parsed.errors} == {
        "model 'gpt-4o-mini' does not run here (see the hint)"
    }
    assert parsed.hint is not None and "--model smollm2" in parsed.hint
    assert "not found" in parsed.hint and "overriding the lines' models" in parsed.hint
    with pytest.raises(BatchInputError) as raised:
        require_valid(parsed, skip_invalid=False)
    assert str(raised.value).count("--model") == 1


def test_max_tokens_past_the_context_is_refused_per_line_saying_what_to_lower():
    parsed = parse([plain("big", model="random:tiny-llama", max_tokens=20000)])
    [error] = parsed.errors
    assert "exceeds random:tiny-llama's context of 16384 tokens" in error.message
    assert error.message.endswith("lower max_tokens below 16374")  # a token a byte


def test_a_batch_without_good_lines_is_refused_even_with_skip_invalid():
    for lines in ([], ["", "  "], ["oops"]):
        with pytest.raises(BatchInputError):
            require_valid(parse(lines), skip_invalid=True)


def submit(conn, lines, batch_id="b1"):
    parsed = parse(lines)
    return submit_batch(conn, require_valid(parsed, False), parsed.input_name, batch_id=batch_id)


def test_submit_records_the_batch_and_enqueues_every_job(redis_conn):
    record = submit(redis_conn, [plain("first"), "", chat("second")])
    assert [(e.custom_id, e.job_id) for e in record.entries] == [
        ("first", "b1-1"),
        ("second", "b1-3"),
    ]
    assert get_batch(redis_conn, "b1") == record
    assert admit_queue(redis_conn).count == 2
    job = Job.fetch("admit-b1-3", connection=redis_conn, serializer=JSONSerializer)
    assert job.func_name == "jobs.dispatcher.admit_job" and job.args == ["b1-3"]
    stored = JobStore(redis_conn).get("b1-3")
    assert stored.state == JobState.QUEUED and stored.spec.custom_id == "second"
    assert redis_conn.zscore(keys.BATCHES_INDEX, "b1") == pytest.approx(record.created_at)
    with pytest.raises(InvalidJobError, match="already exists"):
        submit(redis_conn, [plain("again")])


def finish(store, job_id, text="An answer.", generated_tokens=3, cached_tokens=0):
    for state in (JobState.ADMITTED, JobState.LOADING, JobState.PREFILL):
        store.transition(job_id, state)
    result = JobResult(
        text=text,
        prompt_tokens=10,
        generated_tokens=generated_tokens,
        prompt_tps=1.0,
        generation_tps=1.0,
        load_s=0.1,
        prefill_s=0.1,
        decode_s=0.1,
        peak_memory_bytes=[1],
        cached_tokens=cached_tokens,
    )
    store.transition(job_id, JobState.FINISHED, result=result)


@pytest.fixture
def mixed_batch(redis_conn):
    """Six jobs in input order: finished (stopped early), queued, loading (running), finished
    (hit max_tokens), failed, cancelled."""
    lines = [plain(f"c{n}", max_tokens=4) for n in range(6)]
    record = submit(redis_conn, lines)
    store = JobStore(redis_conn)
    ids = [entry.job_id for entry in record.entries]
    finish(store, ids[0], "First.", generated_tokens=2)
    store.transition(ids[2], JobState.ADMITTED)
    store.transition(ids[2], JobState.LOADING)
    finish(store, ids[3], "Fourth.", generated_tokens=4, cached_tokens=7)
    store.fail(ids[4], "rank 1 died")
    store.transition(ids[5], JobState.CANCELLED, error="stopped by a user")
    return record


def test_status_counts_every_state(redis_conn, mixed_batch):
    counts = batch_counts(redis_conn, mixed_batch)
    assert (counts.total, counts.queued, counts.running, counts.completed) == (6, 1, 1, 2)
    assert (counts.failed, counts.cancelled, counts.expired, counts.is_done) == (1, 1, 0, False)
    redis_conn.delete(keys.job("b1-2"))
    assert batch_counts(redis_conn, mixed_batch).expired == 1


def test_results_are_openai_lines_in_input_order(redis_conn, mixed_batch):
    found = batch_results(redis_conn, "b1")
    assert found.pending == 2
    assert [line["custom_id"] for line in found.outputs] == ["c0", "c3"]
    first = found.outputs[0]
    assert first["id"] == "batch_req_b1-1" and first["error"] is None
    assert first["response"]["status_code"] == 200 and first["response"]["request_id"] == "b1-1"
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smollm2"
    assert body["id"] == "chatcmpl-b1-1" and abs(body["created"] - time.time()) < 60
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "First."},
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    fourth = found.outputs[1]["response"]["body"]
    assert fourth["choices"][0]["finish_reason"] == "length"
    assert fourth["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}  # a kept prefix
    assert found.errors == [
        {
            "id": "batch_req_b1-5",
            "custom_id": "c4",
            "response": None,
            "error": {"code": "failed", "message": "rank 1 died"},
        },
        {
            "id": "batch_req_b1-6",
            "custom_id": "c5",
            "response": None,
            "error": {"code": "cancelled", "message": "stopped by a user"},
        },
    ]


def test_cancel_stops_every_live_job(redis_conn, mixed_batch):
    outcome = cancel_batch(redis_conn, "b1")
    assert (outcome.cancelled, outcome.stopping, outcome.already_final) == (1, 1, 4)
    store = JobStore(redis_conn)
    assert store.get("b1-2").state == JobState.CANCELLED
    assert store.get("b1-3").state == JobState.LOADING  # its ranks stop when they see the flag
    assert redis_conn.exists(keys.job_cancel("b1-3"))
    assert store.get("b1-1").state == JobState.FINISHED


E2E_TIMEOUT_S = 120


def test_batch_runs_on_the_cluster(cluster, tiny_llama_dir, tmp_path):
    conn = connect(cluster.url)
    (tmp_path / "doc.txt").write_text("The Eddystone rocks lie off Plymouth. " * 20)
    lines = [
        chat("q1", max_tokens=4),
        plain("p2", document=None, document_path="doc.txt", kind="prefill"),
        plain("g3", prompt="Where?", max_tokens=4),
    ]
    defaults = Defaults(str(tiny_llama_dir), "smollm2", 4, 10_000)
    parsed = parse_batch_lines(lines, tmp_path, "e2e.jsonl", defaults)
    record = submit_batch(conn, require_valid(parsed, False), parsed.input_name)
    deadline = time.monotonic() + E2E_TIMEOUT_S
    while not (counts := batch_counts(conn, record)).is_done:
        assert time.monotonic() < deadline, counts
        time.sleep(0.2)
    assert counts.completed == 3, batch_results(conn, record.id).errors
    found = batch_results(conn, record.id)
    assert [line["custom_id"] for line in found.outputs] == ["q1", "p2", "g3"]
    bodies = [line["response"]["body"] for line in found.outputs]
    assert all(1 <= body["usage"]["completion_tokens"] <= 4 for body in (bodies[0], bodies[2]))
    assert bodies[1]["usage"]["completion_tokens"] == 0
    assert bodies[1]["choices"][0]["message"]["content"] == ""
    assert all(body["usage"]["prompt_tokens"] > 0 for body in bodies)
    assert found.errors == [] and found.pending == 0


@pytest.mark.parametrize(
    ("text", "cut", "shown"),
    [
        ("Ring attention \ufffd", True, "Ring attention "),  # half of a character's bytes
        ("Ring \ufffd\ufffd", True, "Ring "),
        ("Ring \ufffd", False, "Ring \ufffd"),  # not cut: the model wrote it
        ("Ring é", True, "Ring é"),
    ],
)
def test_an_answer_cut_at_max_tokens_ends_on_a_whole_character(text, cut, shown):
    from jobs.batch import whole_characters

    assert whole_characters(text, cut) == shown


def test_a_kept_prefill_line_is_the_prefix_of_a_question_on_its_document(tmp_path):
    """A batch's `{"kind": "prefill", "keep_cache": true}` line prefills its document as a
    question's prompt begins (the chat template opened), so later questions on the document
    start from its KV; without keep_cache a prefill is the bare document."""
    from jobs.batch_input import Defaults, parse_batch_lines
    from jobs.model_catalog import resolve_model
    from jobs.prompts import prompt_tokens
    from jobs.settings import Settings

    document = "The Eddystone rocks lie fourteen kilometres off Plymouth. " * 40
    lines = [
        json.dumps(
            {"custom_id": "kept", "kind": "prefill", "keep_cache": True, "document": document}
        ),
        json.dumps({"custom_id": "bare", "kind": "prefill", "document": document}),
        json.dumps({"custom_id": "q", "document": document, "prompt": "How far?", "max_tokens": 8}),
    ]  # fmt: skip
    defaults = Defaults(None, "smollm2", 16, 1 << 20)
    parsed = parse_batch_lines(lines, tmp_path, "in.jsonl", defaults, Settings())
    assert parsed.errors == []
    source = resolve_model("smollm2", allowed_dirs=None)
    kept, bare, question = (prompt_tokens(item.spec, source) for item in parsed.items)
    assert parsed.items[0].spec.keep_cache and not parsed.items[1].spec.keep_cache
    shared = next(i for i, (a, b) in enumerate(zip(kept, question, strict=False)) if a != b)
    assert shared >= len(kept) - 8 > len(bare)  # all but the turn's closing tokens
    assert question[: len(bare) // 2] != bare[: len(bare) // 2]
