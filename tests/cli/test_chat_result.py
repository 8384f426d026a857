"""/v1/chat/completions answers with the same body as a batch output line (cli/http/
chat_result.py, jobs/batch.py `output_line`): its usage says, as OpenAI's does, how many prompt
tokens came from a kept KV cache."""

import pytest

from cli.http.chat_result import completion
from cli.http.job_views import JobView
from jobs.lifecycle import JobState
from jobs.schemas import BatchEntry, JobKind, JobResult, Progress


def finished_view(cached_tokens: int) -> JobView:
    result = JobResult(
        text="An answer.", prompt_tokens=700, generated_tokens=3, prompt_tps=1.0,
        generation_tps=1.0, load_s=0.1, prefill_s=0.1, decode_s=0.1, peak_memory_bytes=[1],
        cached_tokens=cached_tokens,
    )  # fmt: skip
    return JobView(
        id="chat-1", kind=JobKind.GENERATE, state=JobState.FINISHED,
        progress=Progress(phase=JobState.FINISHED), result=result, created_at=1.0,
        updated_at=2.0,
    )  # fmt: skip


@pytest.mark.parametrize("cached", [0, 512])
def test_a_chat_completion_reports_its_cached_prompt_tokens(cached):
    entry = BatchEntry(custom_id="c", job_id="chat-1", model="smollm2", max_tokens=16)
    usage = completion(entry, finished_view(cached))["usage"]
    assert usage["prompt_tokens"] == 700 and usage["total_tokens"] == 703
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
