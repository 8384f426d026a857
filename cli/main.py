"""`ringq`: submit long-document prefill / generate jobs, watch them, read results."""

import sys

import click
from pydantic import ValidationError
from rich.console import Console

from cli.batch import batch
from cli.bench import bench
from cli.cache import cache
from cli.common import echo_json, expand_files, redis_connection
from cli.local_run import run
from cli.options import build_spec, submit_job_options
from cli.render import describe, nodes_table, print_result, result_json, status_json, watch
from cli.services import demo, dispatcher, node, up
from cli.top import top
from jobs.cancel import cancel_job
from jobs.errors import RingqError
from jobs.lifecycle import JobState
from jobs.overview import reserved_per_node
from jobs.schemas import JobKind, Sharding
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id, submit_job

console = Console()


class RingqGroup(click.Group):
    """Errors a user can act on become one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RingqError as exc:
            raise click.ClickException(str(exc)) from None
        except ValidationError as exc:
            raise click.ClickException(validation_message(exc)) from None


def validation_message(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "input"
        parts.append(f"{where}: {error['msg']}")
    return "invalid job: " + "; ".join(parts)


@click.group(cls=RingqGroup, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """ringq: batch long-context LLM prefill on MLX, over Redis/RQ and ring groups of nodes.

    Start everything locally with `ringq up` (or try `ringq demo`), then `ringq submit`.
    """


@cli.command()
@click.argument("kind", type=click.Choice([k.value for k in JobKind]))
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@submit_job_options
@click.option("--ring-size", default="auto", show_default=True, help="Ranks (nodes) or 'auto'.")
@click.option(
    "--sharding",
    type=click.Choice([s.value for s in Sharding]),
    default="auto",
    show_default=True,
    help="auto: the dispatcher chooses; ring: sequence parallel; pipeline: layers split over "
    "nodes; single: one node.",
)
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
def submit(
    kind,
    files,
    model,
    prompts,
    max_tokens,
    temperature,
    as_json,
    ring_size,
    sharding,
    job_id,
    keep_cache,
    cache_from,
):
    """Enqueue a prefill or generate job per FILE; prints the job ids, one a line.

    FILE is a file, '-' (stdin), a directory (its files, sorted, not hidden ones) or a quoted
    glob pattern ('docs/*.txt'). Every file is read and checked before any job is enqueued.
    With one plain FILE, --json prints one object; otherwise a list. Several --prompt: one job
    per FILE and question, in that order; jobs sharing a document prefill it once.
    """
    paths = expand_files(files)
    questions = list(prompts) or [None]
    if job_id and len(paths) * len(questions) > 1:
        raise click.UsageError("--id names one job: give one FILE and at most one --prompt")
    options = dict(
        model=model,
        max_tokens=max_tokens,
        temperature=temperature,
        keep_cache=keep_cache,
        cache_from=cache_from,
    )
    specs = [
        build_spec(kind, path, prompt=q, ring_size=ring_size, sharding=sharding, **options)
        for path in paths
        for q in questions
    ]
    conn = redis_connection()
    if len(specs) == 1:
        records = [submit_job(conn, specs[0], job_id)]
    else:
        records = enqueue_jobs(conn, [(new_job_id(), spec) for spec in specs])
    if not as_json:
        click.echo("\n".join(record.id for record in records))
    elif len(specs) == 1 and paths == list(files):  # one plain FILE: one object, as before
        echo_json(status_json(records[0]))
    else:
        echo_json([status_json(record) for record in records])


@cli.command()
@click.argument("job_id")
@click.option("--watch", "follow", is_flag=True, help="Live view until the job ends.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(job_id, follow, as_json):
    """Phase, progress and placement of a job."""
    store = JobStore(redis_connection())
    record = watch(store, job_id, Console(stderr=True)) if follow else store.get(job_id)
    if as_json:
        echo_json(status_json(record))
    else:
        click.echo(describe(record))


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def result(job_id, as_json):
    """The answer and stats of a finished job (exit code 1 if it failed)."""
    record = JobStore(redis_connection()).get(job_id)
    payload = result_json(record)
    if as_json:
        echo_json(payload)
    else:
        print_result(console, payload)
    if record.error:
        sys.exit(1)


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def cancel(job_id, as_json):
    """Cancel a job: a queued one never starts, a running one stops at its next chunk."""
    record = cancel_job(redis_connection(), job_id)
    if as_json:
        echo_json(status_json(record))
    elif record.state == JobState.CANCELLED:
        click.echo(f"{record.id} cancelled")
    else:
        click.echo(f"{record.id} cancelling: its ranks stop at the next chunk or decode step")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def nodes(as_json):
    """Live node agents, their memory budget and what running groups have reserved of it."""
    conn = redis_connection()
    live = JobStore(conn).live_nodes()
    reserved = reserved_per_node(conn, [n.name for n in live])
    if as_json:
        rows = [{**n.model_dump(mode="json"), "reserved_bytes": reserved[n.name]} for n in live]
        echo_json({"nodes": rows})
    else:
        console.print(nodes_table(live, reserved))


for _command in (run, bench, up, demo, node, dispatcher, batch, top):
    cli.add_command(_command)
cli.add_command(cache)


def main() -> None:
    """Entry point: every error, usage errors included, is one line on stderr and exit code 1+."""
    try:
        cli(standalone_mode=False)
    except click.ClickException as exc:
        click.echo(f"Error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
