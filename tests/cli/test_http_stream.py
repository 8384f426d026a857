"""`stream: true` chat completions send the text as the job decodes it: the official `openai`
package against a real cluster (Redis, dispatcher, two node agents, rank processes) and a tiny
random model (no EOS: it always generates max_tokens). Its greedy answers are one character
repeated, so the tests also sample (temperature 1 with a seed: the same answer every time) for
varied text, random bytes that are often invalid UTF-8."""

from collections.abc import Iterator
from typing import cast

import openai
import pytest
import redis
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from jobs import keys
from jobs.job_text import TEXT_KEEP_AFTER_END_S, read_text
from jobs.redis_server import connect
from tests.cli.http_serving import call, serving
from tests.helpers import long_stream, wait_for

MODEL = "random:tiny-llama"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "A document about rings and the attention they pass around. "},
    {"role": "user", "content": "What is it about?"},
]
ANSWER_TOKENS = 40
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def base_url(cluster) -> Iterator[str]:
    with serving(cluster.settings, cluster.url) as url:
        yield url


@pytest.fixture(scope="module")
def conn(cluster) -> Iterator[redis.Redis]:
    client = connect(cluster.url)
    yield client
    client.close()


@pytest.fixture
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def whole_answer(client: openai.OpenAI, sampling: dict) -> str:
    """The answer of MESSAGES, not streamed."""
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=ANSWER_TOKENS, **sampling
    )
    assert whole.usage is not None and whole.usage.completion_tokens == ANSWER_TOKENS
    text = whole.choices[0].message.content
    assert text
    return text


def streamed(client: openai.OpenAI, **options) -> tuple[str, list[str], list[ChatCompletionChunk]]:
    """(job id, the content of each chunk that has some, every chunk)."""
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=ANSWER_TOKENS, stream=True, **options
    )
    chunks = list(cast(openai.Stream[ChatCompletionChunk], stream))
    contents = [c.choices[0].delta.content for c in chunks if c.choices]
    return chunks[0].id.removeprefix("chatcmpl-"), [c for c in contents if c], chunks


def published(conn: redis.Redis, job_id: str) -> list[str]:
    """What the job's lead rank published while it decoded."""
    deltas, _ = read_text(conn, job_id, "0")
    return [delta.text for delta in deltas]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_answer_streams_in_deltas_and_equals_the_whole_answer(client, conn, sampling):
    answer = whole_answer(client, sampling)
    job_id, contents, chunks = streamed(client, **sampling)
    assert len(contents) > 1, "the text came in more than one chunk"
    assert "".join(contents) == answer, "the same answer streamed or not"
    assert chunks[-1].choices[0].finish_reason == "length"
    deltas = published(conn, job_id)
    assert len(deltas) > 1, "the rank published the text while it decoded, in several deltas"
    assert "".join(deltas) == answer


def test_text_arrives_while_the_job_still_decodes(client, base_url):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4000, stream=True, **SAMPLED
    )
    with stream:
        chunks = iter(stream)
        job_id = next(chunks).id.removeprefix("chatcmpl-")
        first_text = next(c for c in chunks if c.choices and c.choices[0].delta.content)
        job = call("GET", f"{base_url}/api/jobs/{job_id}")[1]
    assert first_text.choices[0].finish_reason is None
    assert job["state"] == "decode", "text came before the job finished"
    assert job["progress"]["processed"] < 4000


def test_text_from_a_stop_string_on_is_never_sent(client, conn):
    answer = whole_answer(client, SAMPLED)
    start = next(
        i
        for i in range(len(answer) // 2, len(answer) - 3)
        if "\ufffd" not in answer[i : i + 3] and answer[i : i + 3].strip()
    )
    stop = answer[start : start + 3]
    expected = answer[: answer.index(stop)]
    job_id, contents, chunks = streamed(client, stop=[stop], **SAMPLED)
    assert "".join(contents) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(published(conn, job_id)) == expected, "the rank never published past it"


def test_the_text_stream_expires_with_its_job(client, conn):
    """Set when the rank first appends (the job's own expiry), cut to an hour when it ends."""
    job_id, _, _ = streamed(client)
    keep_ms = min(conn.pttl(keys.job(job_id)), TEXT_KEEP_AFTER_END_S * 1000)
    # the rank cuts it just after the job's final state, which the stream may report first
    wait_for(lambda: 0 < conn.pttl(keys.job_text(job_id)) <= keep_ms + 1000, "the cut", 30)


def test_a_cancelled_job_ends_its_stream_with_an_error(client, base_url):
    stream = long_stream(client, MODEL)
    chunks = iter(stream)
    job_id = next(chunks).id.removeprefix("chatcmpl-")
    status, _, _ = call("POST", f"{base_url}/api/jobs/{job_id}/cancel")
    assert status == 200
    with pytest.raises(openai.APIError) as ended:
        for _ in chunks:
            pass
    assert "cancelled" in str(ended.value)
    assert call("GET", f"{base_url}/api/jobs/{job_id}")[1]["state"] == "cancelled"
