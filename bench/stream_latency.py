"""What publishing generated text costs the lead rank per decoded token
(ring_worker/runtime/text_stream.py
over RedisJobIO.text into a real Redis).

    uv run python -m bench.stream_latency [--tokens 2000]

Feeds SmolLM2-tokenised text (this repo's README) through a TextStream as fast as it goes, in
three ways: flushing every token (no throttle), flushing every 16 tokens (the default's token
bound), and detokenising without publishing. Once with the text's own lines, once with it all on
one line (the detokenizer re-decodes the current line each token: its worst case). Prints
microseconds per token and the number of stream entries; a decode step on this machine's CPU
takes milliseconds, on an H200 about 5-25 ms for the models in bench/results.
"""

import shutil
import tempfile
import time
from pathlib import Path

import click

from jobs import keys
from jobs.model_catalog import resolve_model
from jobs.redis_server import connect, ensure_redis
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.tokenizer import load_tokenizer
from ring_worker.runtime.job_io import RedisJobIO
from ring_worker.runtime.text_stream import TextStream

README = Path(__file__).resolve().parents[1] / "README.md"


def per_token_us(
    store: JobStore, tokenizer, tokens: list[int], flush_tokens: int | None
) -> tuple[float, int]:
    job_id = f"bench-{time.monotonic_ns()}"
    spec = JobSpec(kind=JobKind.GENERATE, model="smollm2", document="d", max_tokens=len(tokens))
    store.create(job_id, spec)
    io = RedisJobIO(store, job_id, "bench")
    publish = io.text if flush_tokens is not None else (lambda delta: None)
    stream = TextStream(
        tokenizer, [], publish, flush_interval_s=float("inf"), flush_tokens=flush_tokens or 10**9
    )
    started = time.perf_counter()
    for token in tokens:
        stream.push(token)
    stream.close()
    elapsed_s = time.perf_counter() - started
    return elapsed_s / len(tokens) * 1e6, int(store.conn.xlen(keys.job_text(job_id)))


@click.command()
@click.option("--tokens", type=click.IntRange(16), default=2000, show_default=True)
def main(tokens: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="ringq-ts-", dir="/tmp"))
    handle = ensure_redis(Settings(home=home, redis_url=None))
    try:
        store = JobStore(connect(handle.url), job_ttl_s=600)
        tokenizer = load_tokenizer(resolve_model("smollm2", allowed_dirs=None))
        text = README.read_text()
        for layout, body in (("lines", text), ("one line", text.replace("\n", " "))):
            ids = tokenizer.encode(body, add_special_tokens=False)[:tokens]
            for label, flush in (("every token", 1), ("every 16", 16), ("no publish", None)):
                us, entries = per_token_us(store, tokenizer, ids, flush)
                click.echo(f"{layout:9} {label:12} {us:8.1f} us/token  {entries:5} entries")
    finally:
        handle.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
