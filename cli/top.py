"""`ringq top`: queues, nodes and running jobs, refreshed in place (or one frame / one object)."""

import time
from collections.abc import Callable

import click
import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from admission.placement import gib
from cli.common import echo_json, redis_connection
from cli.render import format_eta, nodes_table, placement_text
from cli.supervisor import services_line
from jobs.overview import Overview, QueueRow, RunningJob, take_overview
from jobs.store import JobStore


@click.command()
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object and exit.")
@click.option(
    "--interval",
    "interval_s",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
def top(once: bool, as_json: bool, interval_s: float) -> None:
    """Live view of the service: RQ queues of the admit queue and live nodes, live nodes,
    running jobs, queued jobs with why they wait, idle warm groups (Ctrl-C quits)."""
    conn = redis_connection()
    if as_json:
        echo_json(take_overview(JobStore(conn)).model_dump(mode="json"))
    elif once:
        Console().print(render_overview(take_overview(JobStore(conn))))
    else:
        follow(conn, interval_s, Console())


def follow(
    conn: redis.Redis,
    interval_s: float,
    console: Console,
    pause: Callable[[float], None] = time.sleep,
) -> None:
    """Redraw in place until Ctrl-C; a full-screen view so a long job list does not scroll (it is
    cut at the bottom of the terminal). Redrawn once per snapshot, not by rich's refresh thread."""
    store = JobStore(conn)
    first = render_overview(take_overview(store))
    with Live(first, console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                pause(interval_s)
                live.update(render_overview(take_overview(store)), refresh=True)
        except KeyboardInterrupt:
            pass


def render_overview(overview: Overview) -> Group:
    stamp = time.strftime("%H:%M:%S", time.localtime(overview.taken_at))
    running = jobs_table(overview.running)
    running.title = f"running jobs: {len(overview.running)}"
    nodes = nodes_table(overview.nodes, overview.reserved_bytes)
    nodes.title = f"live nodes: {len(overview.nodes)}"
    idle = Table("group", "model", "strategy", "nodes", "reserved / node")
    idle.title = f"idle warm groups: {len(overview.idle_groups)}"
    for g in overview.idle_groups:
        idle.add_row(g.group_id, g.model, g.strategy, ", ".join(g.nodes), gib(g.bytes_per_node))
    busy = Table("group", "model", "strategy", "nodes", "decoding", "batch")
    busy.title = f"busy warm groups: {len(overview.busy_groups)}"
    for b in overview.busy_groups:
        members = ", ".join(b.jobs)
        busy.add_row(b.group_id, b.model, b.strategy, ", ".join(b.nodes), str(b.decoding), members)
    return Group(
        f"[bold]ringq top[/bold]  [dim]{stamp}[/dim]",
        services_line(overview.services),
        queues_table(overview.queues),
        nodes,
        running,
        queued_table(overview),
        busy,
        idle,
    )


def queued_table(overview: Overview) -> Table:
    """The jobs placed next, oldest first, and why each waits (none yet: not admitted so far)."""
    table = Table("job", "kind", "model", "waiting", "reason")
    shown = len(overview.queued)
    more = f" (the {shown} oldest shown)" if overview.queued_total > shown else ""
    table.title = f"queued jobs: {overview.queued_total}{more}"
    for job in overview.queued:
        table.add_row(
            job.id,
            job.kind.value,
            job.model or "-",
            format_eta(overview.taken_at - job.created_at),
            job.waiting_reason or "not admitted yet",
        )
    return table


def queues_table(queues: list[QueueRow]) -> Table:
    table = Table("queue", "queued", "started", title="RQ queues")
    for q in queues:
        table.add_row(q.name, str(q.queued), str(q.started))
    return table


def jobs_table(jobs: list[RunningJob]) -> Table:
    table = Table("job", "kind", "state", "phase", "tokens", "tok/s", "ETA", "placement")
    for job in jobs:
        progress = job.progress
        table.add_row(
            job.id,
            job.kind.value,
            job.state.value,
            progress.phase.value,
            f"{progress.processed}/{progress.total}",
            f"{speed:.0f}" if (speed := progress.generation_tps or progress.prompt_tps) else "-",
            format_eta(job.eta_s),
            placement_text(job.placement),
        )
    return table
