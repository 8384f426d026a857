"""`ringq cache`: the KV prefixes kept for automatic reuse (design: jobs/prefix_cache.py)."""

import time

import click
from rich.console import Console
from rich.table import Table

from cli.common import echo_json, redis_connection
from jobs.prefix_cache import CacheEntry
from jobs.prefix_index import PrefixIndex
from ring_worker.runtime.prefix_reuse import drop_entry

console = Console()


@click.group()
def cache() -> None:
    """KV prefixes kept on the nodes: later jobs whose prompt starts the same way compute only
    the rest. Each node keeps at most RINGQ_CACHE_BYTES on disk (least recently used go first;
    --keep-cache ones last)."""


@cache.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def list_caches(as_json: bool) -> None:
    """Kept prefixes, most recently used first."""
    entries = PrefixIndex(redis_connection()).listing()
    if as_json:
        echo_json({"caches": [e.model_dump(mode="json") for e in entries]})
        return
    if not entries:
        click.echo("no kept KV prefixes")
        return
    console.print(entries_table(entries))


def entries_table(entries: list[CacheEntry]) -> Table:
    table = Table("id (job)", "model", "tokens", "layout", "size", "pinned", "last used")
    now = time.time()
    for e in entries:
        size_bytes = sum(s.bytes for s in e.shards)
        table.add_row(
            e.id,
            e.model_name(),
            str(e.tokens),
            e.describe(),
            f"{size_bytes / 1024**2:.1f} MiB",
            "yes" if e.pinned else "",
            f"{now - e.last_used_at:.0f}s ago",
        )
    return table


@cache.command("drop")
@click.argument("ids", nargs=-1)
@click.option("--all", "drop_all", is_flag=True, help="Drop every kept prefix.")
def drop(ids: tuple[str, ...], drop_all: bool) -> None:
    """Forget kept prefixes and delete their files (those on other machines are left to that
    node's LRU: no job uses them once forgotten)."""
    if bool(ids) == drop_all:
        raise click.UsageError("name the cache ids to drop, or give --all")
    index = PrefixIndex(redis_connection())
    targets = [e.id for e in index.listing()] if drop_all else list(ids)
    missing = []
    for entry_id in targets:
        dropped = drop_entry(index, entry_id)
        if dropped is None:
            missing.append(entry_id)
            continue
        note = f", {len(dropped.elsewhere)} on other machines" if dropped.elsewhere else ""
        click.echo(f"dropped {entry_id} ({len(dropped.deleted)} files deleted{note})")
    if missing:
        raise click.ClickException(f"no kept cache {', '.join(missing)} (see `ringq cache list`)")
