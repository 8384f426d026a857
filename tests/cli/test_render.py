"""What `ringq status`, `result` and `nodes` print: pure functions of records, table tests."""

import io
import time

from rich.console import Console

from admission.estimate import BatchRow
from cli.render import (
    describe,
    live_batch_size,
    nodes_table,
    result_json,
    stats_line,
    status_json,
)
from jobs import keys
from jobs.lifecycle import JobState
from jobs.schemas import (
    GroupSpec,
    JobKind,
    JobRecord,
    JobResult,
    JobSpec,
    NodeInfo,
    Placement,
    Progress,
)
from jobs.warm_groups import WarmGroups

STATS = {
    "prompt_tokens": 1032,
    "cached_tokens": 1015,
    "prompt_tps": 32.0,
    "generated_tokens": 18,
    "generation_tps": 9.5,
    "load_s": 0.0,
    "prefill_s": 0.5,
    "decode_s": 1.9,
    "peak_memory_bytes": [2**20],
}


def record(state=JobState.QUEUED, prompt=None, **fields) -> JobRecord:
    spec = JobSpec(kind=JobKind.GENERATE, document="doc", prompt=prompt)
    now = time.time()
    progress = fields.pop("progress", Progress(phase=state))
    return JobRecord(
        id="j1",
        kind=JobKind.GENERATE,
        state=state,
        spec=spec,
        progress=progress,
        created_at=now,
        updated_at=now,
        **fields,
    )


def test_stats_line_says_how_many_prompt_tokens_came_from_the_cache():
    assert stats_line(STATS).startswith(
        "prompt 1032 tok (1015 from the kept cache, 17 computed) at 32.0 tok/s · generated 18"
    )
    assert stats_line({**STATS, "cached_tokens": 0}).startswith("prompt 1032 tok at 32.0 tok/s")


def test_status_says_the_default_prompt_the_waiting_reason_and_the_placement_reason():
    waiting = describe(record(waiting_reason="needs 3.0 GiB on node-0"))
    assert "waiting: needs 3.0 GiB on node-0" in waiting
    assert "prompt: none given, so the default: “Summarise the document" in waiting
    placement = Placement(
        strategy="ring",
        ranks=2,
        nodes=["a", "b"],
        group_id="g",
        bytes_per_node=1,
        reason="32,000 tokens: ring-2 fits, single does not",
    )
    decoding = Progress(phase=JobState.DECODE, processed=10, total=110, generation_tps=20.0)
    running = record(JobState.DECODE, prompt="Why?", placement=placement, progress=decoding)
    text = describe(running)
    assert "placement: 32,000 tokens: ring-2 fits, single does not" in text
    assert "decode: 10/110 tok at 20.0 tok/s, ETA 0:05" in text and "prompt:" not in text
    payload = status_json(running)
    assert payload["placement"]["reason"] == placement.reason
    assert payload["progress"]["eta_s"] == 5.0 and payload["prompt"] == "Why?"


def test_result_json_says_when_the_default_prompt_was_used():
    assert result_json(record())["default_prompt"] is True
    assert result_json(record(prompt="Why?"))["default_prompt"] is False


def test_nodes_table_shows_each_nodes_device():
    now = time.time()
    common = dict(memory_bytes=2**30, available_bytes=2**30, address="h", pid=1)
    gpu = NodeInfo(
        name="n0",
        backend="cuda",
        device="cuda:1 NVIDIA H200",
        started_at=now,
        heartbeat_at=now,
        **common,
    )
    cpu = NodeInfo(name="n1", backend="cpu", started_at=now, heartbeat_at=now, **common)
    out = io.StringIO()
    Console(file=out, width=200).print(nodes_table([gpu, cpu], {}))
    rows = out.getvalue().splitlines()
    assert any("n0" in row and "cuda:1 NVIDIA H200" in row for row in rows)
    assert any("n1" in row and "cpu" in row for row in rows)


def test_status_shows_the_batch_a_job_decoded_in():
    alone = JobResult.model_validate({**STATS, "text": "ok"})
    batched = alone.model_copy(update={"batch_size": 3})
    assert "batch:" not in describe(record(JobState.FINISHED, result=alone))
    text = describe(record(JobState.FINISHED, result=batched))
    assert "batch: decoded with up to 3 sequences at once" in text
    assert status_json(record(JobState.FINISHED, result=batched))["batch_size"] == 3
    assert result_json(record(JobState.FINISHED, result=batched))["batch_size"] == 3


def test_status_shows_the_batch_a_job_decodes_in_now(redis_conn):
    """While it decodes: how many jobs its group's batch runs (jobs/warm_groups.py), before
    its result says the most it decoded with."""
    group = GroupSpec(
        group_id="g-live", job_id="j1", model="m", addresses=["127.0.0.1:1"], nodes=["n0"]
    )
    warm = WarmGroups(redis_conn)
    warm.offer(group, 1000)
    warm.started(group, "j1", BatchRow(256, 0))
    placement = Placement(
        strategy="single", ranks=1, nodes=["n0"], group_id="g-live", bytes_per_node=1000
    )
    decoding = record(JobState.DECODE, placement=placement)
    assert live_batch_size(redis_conn, decoding) == 1
    assert "batch:" not in describe(decoding, live_batch_size(redis_conn, decoding))
    for other in ("j2", "j3"):
        assert warm.join(group, other, 8, row=BatchRow(256, 0)) == "joined"
    now = live_batch_size(redis_conn, decoding)
    assert now == 3
    assert "batch: decoding in a batch of 3 jobs now" in describe(decoding, now)
    assert status_json(decoding, now)["batch_size"] == 3
    assert live_batch_size(redis_conn, record(JobState.PREFILL, placement=placement)) is None
    warm.ended(group, "j1")  # left the batch: its result is about to say the rest
    assert live_batch_size(redis_conn, decoding) is None
    for other in ("j2", "j3"):
        warm.ended(group, other)
    redis_conn.hdel(keys.WARM_GROUPS, "g-live")


def test_a_job_list_reads_whole_words_at_80_columns():
    """The short columns (id, kind, state, tokens, age) keep their words whole in an 80-column
    terminal; a long model path shows its last part and the long columns wrap instead."""
    import io as text_io

    from rich.console import Console

    from cli.render import jobs_table
    from jobs.listing import JobSummary
    from jobs.schemas import Progress

    now = 1_000_000.0
    done = Progress(phase=JobState.FINISHED, processed=131072, total=131072)
    jobs = [
        JobSummary(
            id="3f2a9c1b7d0e", kind="generate", state="finished", progress=done,
            created_at=now - 65, updated_at=now, model="/models/deep/path/Qwen2.5-7B-1M/q4.gguf",
            document_name="annual-report-of-the-company.txt",
        ),
        JobSummary(
            id="a1b2c3d4e5f6", kind="prefill", state="cancelled", progress=done,
            created_at=now - 5, updated_at=now, model="smollm2", error="cancelled by the user",
        ),
    ]  # fmt: skip
    out = text_io.StringIO()
    Console(file=out, width=80).print(jobs_table(jobs, now=now))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    for word in (
        "3f2a9c1b7d0e",
        "generate",
        "finished",
        "cancelled",
        "131K/131K",
        "1:05",
        "q4.gguf",
    ):
        assert word in text, word
    assert "/models/deep" not in text
