"""`ringq batch`: a JSONL file of requests (OpenAI Batch or plain lines) as one batch of jobs."""

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.common import client, echo_json, redis_connection
from cli.render import format_eta
from jobs.batch import (
    BatchCounts,
    batch_counts,
    batch_results,
    cancel_batch,
    get_batch,
)
from jobs.batch_input import Defaults, LineError, parse_batch_file
from jobs.schemas import BatchRecord
from jobs.settings import get_settings

WATCH_INTERVAL_S = 0.5


@click.group()
def batch() -> None:
    """Many requests from one JSONL file, enqueued together and followed as one batch.

    \b
    Each line is one request, either
      OpenAI Batch:  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"messages": [{"role": "user", "content": "..."}], "max_tokens": 64}}
      plain:         {"custom_id": "b", "document_path": "doc.txt", "prompt": "Summarise",
                      "kind": "generate", "max_tokens": 64}
    An OpenAI request runs as one user turn: its last (user) message is the question, the
    messages before it are the document. `ringq batch results` writes OpenAI Batch output lines.
    """


@batch.command("submit")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--skip-invalid", is_flag=True, help="Enqueue the valid lines, report the others.")
@click.option(
    "--model", default=None, help="Run every line on this model (overrides the lines' models)."
)
@click.option(
    "--max-tokens",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="For lines that give no max_tokens.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def submit(file: Path, skip_invalid: bool, model: str | None, max_tokens: int, as_json: bool):
    """Check every line of FILE and enqueue them as one batch; prints its id.

    With any invalid line nothing is enqueued (the error names the lines) unless --skip-invalid.
    document_path is relative to FILE's directory. Lines without a model use RINGQ_DEFAULT_MODEL
    (OpenAI model names such as gpt-4o-mini do not run here: pass --model).
    """
    settings = get_settings()
    parsed = parse_batch_file(file, Defaults.of(settings, model, max_tokens), settings)
    record = client().batch_submit_parsed(parsed, skip_invalid=skip_invalid)
    if as_json:
        skipped_lines = [skipped_json(e) for e in parsed.errors]
        echo_json({**record_json(record), "skipped": skipped_lines, "hint": parsed.hint})
        return
    for error in parsed.errors:
        click.echo(f"skipped {error}", err=True)
    if parsed.hint:
        click.echo(f"hint: {parsed.hint}", err=True)
    click.echo(record.id)


@batch.command("list")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="At most N."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def list_(limit: int, as_json: bool):
    """Batches, newest first, with their request counts by state."""
    from jobs.listing import list_batches

    conn = redis_connection()
    rows = []
    for summary in list_batches(conn, limit):
        counts = batch_counts(conn, get_batch(conn, summary.id))
        rows.append({**summary.model_dump(mode="json"), **counts_json(counts)})
    if as_json:
        echo_json({"batches": rows})
    elif not rows:
        click.echo("no batches")
    else:
        Console().print(batches_table(rows))


def batches_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    table = Table()
    table.add_column("batch", no_wrap=True)
    for name in ("input", "age", "total", "queued", "running", "completed", "failed"):
        table.add_column(name)
    table.add_column("cancelled")
    table.add_column("skipped")
    now = time.time()
    for row in rows:
        table.add_row(
            row["id"],
            row["input_name"],
            format_eta(now - row["created_at"]),
            *(str(row[k]) for k in ("total", "queued", "running", "completed", "failed")),
            str(row["cancelled"]),
            str(row["skipped_lines"]),
        )
    return table


@batch.command("status")
@click.argument("batch_id", metavar="BATCH")
@click.option("--watch", "follow", is_flag=True, help="Live progress bar until every job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(batch_id: str, follow: bool, as_json: bool):
    """Counts of BATCH's jobs: queued, running, completed, failed, cancelled."""
    conn = redis_connection()
    record = get_batch(conn, batch_id)
    if follow:
        counts = watch_batch(lambda: batch_counts(conn, record), Console(stderr=True))
    else:
        counts = batch_counts(conn, record)
    if as_json:
        echo_json({**record_json(record), **counts_json(counts)})
    else:
        click.echo(f"{record.id}  {record.input_name}  {describe_counts(counts)}")


@batch.command("results")
@click.argument("batch_id", metavar="BATCH")
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write OpenAI Batch output lines of completed requests here, in input order.",
)
@click.option(
    "--errors",
    "errors_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write error lines of failed, cancelled and skipped (invalid) requests here (default: "
    "not written).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def results(batch_id: str, output: Path, errors_path: Path | None, as_json: bool):
    """Write OpenAI Batch output lines of BATCH's finished requests.

    Requests still queued or running are left out for now: run it again later; the files are
    rewritten, complete up to that moment. Prefill requests get an empty assistant message and
    their prompt token count in usage.
    """
    found = batch_results(redis_connection(), batch_id)
    write_jsonl(output, found.outputs)
    if errors_path is not None:
        write_jsonl(errors_path, found.errors)
    summary = {
        "id": batch_id,
        "output": str(output),
        "written": len(found.outputs),
        "errors": str(errors_path) if errors_path else None,
        "errors_written": len(found.errors) if errors_path else 0,
        "failed": found.count("failed") + found.count("expired"),
        "cancelled": found.count("cancelled"),
        "skipped": found.count("skipped"),
        "pending": found.pending,
    }
    if as_json:
        echo_json(summary)
        return
    click.echo(f"{len(found.outputs)} results written to {output}")
    if found.errors:
        where = f"written to {errors_path}" if errors_path else "not written (use --errors FILE)"
        counts = ", ".join(f"{summary[k]} {k}" for k in ("failed", "cancelled", "skipped"))
        click.echo(f"error lines ({counts}): {where}")
    if found.pending:
        click.echo(f"{found.pending} still queued or running: run this again when they finish")


@batch.command("cancel")
@click.argument("batch_id", metavar="BATCH")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cancel(batch_id: str, as_json: bool):
    """Cancel every job of BATCH that has not ended.

    Queued jobs end at once; running ones stop at their next chunk or decode step.
    """
    outcome = cancel_batch(redis_connection(), batch_id)
    if as_json:
        echo_json({"id": batch_id, **vars(outcome)})
        return
    click.echo(
        f"{batch_id}: {outcome.cancelled} cancelled, {outcome.stopping} stopping, "
        f"{outcome.already_final} had already ended"
    )


def record_json(record: BatchRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "input_name": record.input_name,
        "created_at": record.created_at,
        "total": len(record.entries),
        "skipped_lines": record.skipped_lines,
    }


def counts_json(counts: BatchCounts) -> dict[str, Any]:
    return {**vars(counts), "done": counts.is_done}


def skipped_json(error: LineError) -> dict[str, Any]:
    return {"line": error.line_number, "error": error.message}


def describe_counts(counts: BatchCounts) -> str:
    text = (
        f"total {counts.total}  queued {counts.queued}  running {counts.running}  "
        f"completed {counts.completed}  failed {counts.failed}  cancelled {counts.cancelled}"
    )
    return text + (f"  expired {counts.expired}" if counts.expired else "")


def watch_batch(poll, console: Console) -> BatchCounts:
    """A bar of finished jobs out of the total, with the counts, until every job has ended."""
    columns = (
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        counts = poll()
        task = bar.add_task("", total=counts.total)
        while True:
            bar.update(task, completed=counts.done, description=describe_counts(counts))
            if counts.is_done:
                return counts
            time.sleep(WATCH_INTERVAL_S)
            counts = poll()


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as file:
        for line in lines:
            file.write(json.dumps(line, ensure_ascii=False) + "\n")
