"""Redis memory under a large OpenAI batch: `used_memory` (INFO memory) before and after a batch
of 1,000 lines of 100 KB is created through a real `ringq serve` process at its defaults
(RINGQ_BATCH_WINDOW), and, for contrast, after `ringq batch submit` enqueues the same file whole.

    uv run python -m bench.batch_memory [--lines 1000] [--document-bytes 102400] [--out FILE]

Starts a private Redis and RINGQ_HOME under a temporary folder; no cluster runs, so no job ends
and the window stays full: what Redis holds then is the most the batch costs it. The lines name
random:llama-3.1-8b, whose 128K context holds a 100 KB document. Writes one JSON object
(bench/results/batch-memory.json)."""

import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import openai
import redis

from cli.bench_machine import source_revision
from jobs.batch import read_feed
from jobs.redis_server import connect, ensure_redis
from jobs.settings import Settings

MODEL = "random:llama-3.1-8b"
SETTLE_S = 3.0  # several polls of the feeder after the batch is in progress


def write_batch(path: Path, lines: int, document_bytes: int) -> None:
    text = ("ring attention " * (document_bytes // 15 + 1))[:document_bytes]
    with path.open("w") as out:
        for i in range(lines):
            messages = [{"role": "user", "content": f"{i} {text}"}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 2}
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            out.write(json.dumps({**line, "body": body}) + "\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def used_memory(conn: redis.Redis) -> int:
    return int(conn.info("memory")["used_memory"])


def through_serve(conn: redis.Redis, env: dict[str, str], path: Path) -> dict[str, Any]:
    """Upload and create the batch through `ringq serve`; Redis's growth once it is fed."""
    port = free_port()
    server = subprocess.Popen(
        ["ringq", "serve", "--port", str(port), "--log-level", "warning"], env=env
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=20)
        client.models.list()  # retried until the server listens
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        before, started = used_memory(conn), time.monotonic()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while client.batches.retrieve(batch.id).status == "validating":
            time.sleep(0.2)
        in_progress_s = time.monotonic() - started
        time.sleep(SETTLE_S)
        after = used_memory(conn)
        feed = read_feed(conn, batch.id)
        retrieved = client.batches.retrieve(batch.id)
        counts = retrieved.request_counts
        return {
            "status": retrieved.status,
            "request_counts": counts.model_dump() if counts else None,
            "feed": asdict(feed) if feed else None,
            "create_to_in_progress_s": round(in_progress_s, 2),
            "used_memory_before": before,
            "used_memory_after": after,
            "growth_bytes": after - before,
        }
    finally:
        server.terminate()
        server.wait(timeout=30)


def through_cli(conn: redis.Redis, env: dict[str, str], path: Path) -> dict[str, Any]:
    before = used_memory(conn)
    subprocess.run(
        ["ringq", "batch", "submit", str(path)], env=env, check=True, capture_output=True
    )
    after = used_memory(conn)
    return {
        "used_memory_before": before,
        "used_memory_after": after,
        "growth_bytes": after - before,
    }


@click.command()
@click.option("--lines", default=1000, show_default=True)
@click.option("--document-bytes", default=100 * 1024, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(lines: int, document_bytes: int, out: Path | None) -> None:
    root = Path(tempfile.mkdtemp(prefix="ringq-batch-memory-"))
    server = ensure_redis(Settings(home=root / "redis", redis_url=None))
    conn = connect(server.url)
    env = {**os.environ, "RINGQ_REDIS_URL": server.url, "RINGQ_HOME": str(root / "home")}
    env.pop("RINGQ_BATCH_WINDOW", None)
    try:
        path = root / "batch.jsonl"
        write_batch(path, lines, document_bytes)
        result = {
            "command": "python -m bench.batch_memory "
            f"--lines {lines} --document-bytes {document_bytes}",
            "commit": (source_revision() or {}).get("commit"),
            "machine": {
                "platform": platform.platform(),
                "cpu_count": os.cpu_count(),
                "load_avg_start": os.getloadavg(),
            },  # fmt: skip
            "lines": lines,
            "document_bytes": document_bytes,
            "file_bytes": path.stat().st_size,
            "serve_windowed": through_serve(conn, env, path),
            "cli_whole": through_cli(conn, env, path),
        }
    finally:
        conn.close()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=1)
    click.echo(text)
    if out is not None:
        out.write_text(text + "\n")


if __name__ == "__main__":
    main()
