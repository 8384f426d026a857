"""How fast a large batch is read, enqueued and cancelled: `ringq batch submit` and `ringq batch
cancel` must not take minutes.

Writes a JSONL of N small requests (OpenAI Batch and plain lines alternating, model smollm2),
then times, separately: resolving the model (once per distinct model: reading the GGUF's
metadata), parsing and validating every line, and enqueueing (batch record, job records and RQ
jobs through pipelines). Redis is a fresh embedded server unless --redis-url is given (that
database is not flushed; the batch gets a fresh id).

    uv run python -m bench.enqueue_batch [--lines 10000] [--redis-url URL]
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

import click

from jobs.batch import batch_counts, cancel_batch, submit_batch
from jobs.batch_input import Defaults, parse_batch_file, require_valid
from jobs.model_catalog import resolve_model
from jobs.redis_server import connect, ensure_redis
from jobs.settings import Settings
from jobs.submit import admit_queue

MODEL = "smollm2"


def write_jsonl(path: Path, lines: int) -> None:
    with path.open("w") as file:
        for index in range(lines):
            file.write(json.dumps(request_line(index)) + "\n")


def request_line(index: int) -> dict:
    text = f"Document {index}: the Eddystone rocks lie fourteen kilometres off Plymouth."
    if index % 2:
        return {"custom_id": f"req-{index}", "document": text, "prompt": "Where?", "model": MODEL}
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "Where?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 16}
    return {
        "custom_id": f"req-{index}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body,
    }


def timed(label: str, func, *args):
    start_s = time.perf_counter()
    value = func(*args)
    elapsed_s = time.perf_counter() - start_s
    click.echo(f"{label:<28} {elapsed_s:7.3f} s")
    return value, elapsed_s


@click.command()
@click.option("--lines", type=click.IntRange(1), default=10_000, show_default=True)
@click.option("--redis-url", default=None, help="Use this Redis (default: a fresh embedded one).")
def main(lines: int, redis_url: str | None) -> None:
    """Time parse+validate and enqueue of a LINES-request batch."""
    work_dir = Path(tempfile.mkdtemp(prefix="ringq-bench-"))
    handle = None if redis_url else ensure_redis(Settings(home=work_dir / "home", redis_url=None))
    try:
        conn = connect(redis_url or handle.url if handle else redis_url or "")
        path = work_dir / "batch.jsonl"
        write_jsonl(path, lines)
        click.echo(f"{lines} lines, {path.stat().st_size / 1024:.0f} KiB, model {MODEL}")
        timed("resolve model (once)", resolve_model, MODEL)
        defaults = Defaults(None, MODEL, 256, 16 * 1024 * 1024)
        parsed, _ = timed("parse + validate", parse_batch_file, path, defaults)
        items = require_valid(parsed, skip_invalid=False)
        record, enqueue_s = timed("enqueue", submit_batch, conn, items, parsed.input_name)
        counts, _ = timed("status (pipelined HGETs)", batch_counts, conn, record)
        click.echo(f"total {counts.total}, queued {counts.queued}; {lines / enqueue_s:,.0f} jobs/s")
        click.echo(f"admit queue length {admit_queue(conn).count}")
        outcome, _ = timed("cancel (every job queued)", cancel_batch, conn, record.id)
        click.echo(f"cancelled {outcome.cancelled}, stopping {outcome.stopping}")
    finally:
        if handle:
            handle.stop()
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
