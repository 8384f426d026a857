"""`ringq submit | status | result | cancel | jobs | nodes`: one job at a time, through the
Python client (jobs/client.py). Only what each command needs is imported: rich for tables and
bars, rq for enqueueing."""

import sys

import click

from admission.vocabulary import STRATEGY_CHOICES
from cli.common import client, echo_json, expand_files
from cli.options import build_spec, renamed_option, submit_job_options
from cli.render import describe, live_batch_size, result_json, status_json
from jobs.lifecycle import JobState
from jobs.schemas import JobKind


@click.command()
@click.argument("kind", type=click.Choice([k.value for k in JobKind]))
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@submit_job_options
@click.option("--ranks", default="auto", show_default=True, help="Ranks (nodes) or 'auto'.")
@renamed_option("--ring-size", "--ranks", "ranks")
@click.option(
    "--strategy",
    type=click.Choice(STRATEGY_CHOICES),
    default="auto",
    show_default=True,
    help="auto: the dispatcher chooses; ring: sequence parallel; pipeline: layers split over "
    "nodes; single: one node.",
)
@renamed_option("--sharding", "--strategy", "strategy", type=click.Choice(STRATEGY_CHOICES))
@click.option(
    "--id", "job_id", default=None, help="Job id to use, one FILE only (default: random)."
)
@click.option(
    "--keep-cache",
    is_flag=True,
    help="prefill: keep the KV cache on its node (one node) for later generate jobs.",
)
@click.option(
    "--cache-from",
    metavar="JOB",
    default=None,
    help="generate: start from prefill JOB's kept KV cache; only the rest of the prompt is "
    "computed.",
)
def submit(kind, files, as_json, ranks, strategy, job_id, prompts, **options):
    """Enqueue a prefill or generate job per FILE; prints the job ids, one a line.

    FILE is a file, '-' (stdin), a directory (its files, sorted, not hidden ones) or a quoted
    glob pattern ('docs/*.txt'). Every file is read and checked before any job is enqueued
    (the model, and --max-tokens against its context). A generate job without --prompt
    summarises the document. With one plain FILE, --json prints one object; otherwise a list.
    Several --prompt: one job per FILE and question, in that order; jobs sharing a document
    prefill it once.
    """
    paths = expand_files(files)
    questions = list(prompts) or [None]
    if job_id and len(paths) * len(questions) > 1:
        raise click.UsageError("--id names one job: give one FILE and at most one --prompt")
    specs = [
        build_spec(kind, path, prompt=q, ranks=ranks, strategy=strategy, **options)
        for path in paths
        for q in questions
    ]
    ringq = client()
    if len(specs) == 1:
        records = [ringq.submit_spec(specs[0], job_id)]
    else:
        from jobs.submit import enqueue_jobs, new_job_id

        jobs = [(new_job_id(), spec) for spec in specs]
        records = enqueue_jobs(ringq.conn, jobs, settings=ringq.settings)
    if not as_json:
        click.echo("\n".join(record.id for record in records))
    elif len(specs) == 1 and paths == list(files):  # one plain FILE: one object
        echo_json(status_json(records[0]))
    else:
        echo_json([status_json(record) for record in records])


@click.command()
@click.argument("job_id")
@click.option("--watch", "follow", is_flag=True, help="Live view until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(job_id, follow, as_json):
    """Phase, progress and placement of a job (and why it waits, or was placed so)."""
    ringq = client()
    if follow:
        from rich.console import Console

        from cli.render import watch

        record = watch(ringq.store, job_id, Console(stderr=True))
    else:
        record = ringq.status(job_id)
    batch_now = live_batch_size(ringq.conn, record)
    if as_json:
        echo_json(status_json(record, batch_now))
    else:
        click.echo(describe(record, batch_now))


@click.command()
@click.argument("job_id")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=None,
    is_flag=False,
    flag_value=float("inf"),
    metavar="[SECONDS]",
    help="Wait until the job ends (at most SECONDS when given).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def result(job_id, wait_s, as_json):
    """The answer and stats of a job. Exit code 0 only for a finished job: 1 if it failed or
    was cancelled (a cancelled job keeps the text it had generated), 3 if it has not ended
    (--wait waits for it)."""
    ringq = client()
    timeout_s = None if wait_s == float("inf") else wait_s
    record = ringq.wait(job_id, timeout_s) if wait_s is not None else ringq.status(job_id)
    payload = result_json(record)
    if as_json:
        echo_json(payload)
    else:
        from rich.console import Console

        from cli.render import print_result

        print_result(Console(), payload)
    if record.state != JobState.FINISHED:
        sys.exit(1 if record.state.is_final else 3)


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cancel(job_id, as_json):
    """Cancel a job: a queued one never starts, a running one stops at its next chunk."""
    record = client().cancel(job_id)
    if as_json:
        echo_json(status_json(record))
    elif record.state == JobState.CANCELLED:
        click.echo(f"{record.id} cancelled")
    else:
        click.echo(f"{record.id} cancelling: its ranks stop at the next chunk or decode step")


@click.command()
@click.option(
    "--state",
    type=click.Choice([s.value for s in JobState]),
    default=None,
    help="Only jobs in this state.",
)
@click.option("--batch", "batch_id", metavar="BATCH", default=None, help="Only BATCH's jobs.")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="At most N."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def jobs(state, batch_id, limit, as_json):
    """Jobs, newest first (a batch's in input order): id, kind, state, progress, model,
    document, age, and why a queued job waits or a failed one failed."""
    from cli.render import jobs_table

    found = client().jobs(state=state, batch=batch_id, limit=limit)
    if as_json:
        echo_json({"jobs": [job.model_dump(mode="json") for job in found]})
    elif found:
        from rich.console import Console

        Console().print(jobs_table(found))
    else:
        click.echo("no jobs" + (f" in state {state}" if state else ""))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def nodes(as_json):
    """Live node agents: device, memory budget and what running groups have reserved of it."""
    from jobs.overview import reserved_per_node

    ringq = client()
    live = ringq.nodes()
    reserved = reserved_per_node(ringq.conn, [n.name for n in live])
    if as_json:
        rows = [{**n.model_dump(mode="json"), "reserved_bytes": reserved[n.name]} for n in live]
        echo_json({"nodes": rows})
    else:
        from rich.console import Console

        from cli.render import nodes_table

        Console().print(nodes_table(live, reserved))
