"""How jobs look in a terminal and in --json output. rich is imported by the functions that draw
(plain `ringq status` prints text without it)."""

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.lifecycle import JobState
from jobs.listing import JobSummary, eta_s
from jobs.schemas import DEFAULT_GENERATE_PROMPT, JobKind, JobRecord, NodeInfo, Placement
from jobs.schemas import Progress as JobProgress

if TYPE_CHECKING:
    import redis
    from rich.console import Console
    from rich.table import Table

    from jobs.store import JobStore

WATCH_INTERVAL_S = 0.25


def status_json(record: JobRecord, batch_now: int | None = None) -> dict[str, Any]:
    """`batch_now`: the jobs its group's batch runs now (`live_batch_size`), while it runs."""
    placement = record.placement
    return {
        "id": record.id,
        "kind": record.kind.value,
        "state": record.state.value,
        "progress": {
            "phase": record.progress.phase.value,
            "processed": record.progress.processed,
            "total": record.progress.total,
            "prompt_tps": record.progress.prompt_tps,
            "generation_tps": record.progress.generation_tps,
            "eta_s": eta_s(record.progress) if not record.state.is_final else None,
        },
        "placement": {
            "strategy": placement.strategy if placement else None,
            "ranks": placement.ranks if placement else None,
            "nodes": placement.nodes if placement else [],
            "warm": placement.warm if placement else False,
            "reason": placement.reason if placement else None,
        },
        "prompt": prompt_shown(record),
        "model": record.spec.model,
        "cached_tokens": record.result.cached_tokens if record.result else 0,
        "cache_source": record.result.cache_source if record.result else None,
        "batch_size": record.result.batch_size if record.result else batch_now,
        "custom_id": record.spec.custom_id,
        "error": record.error,
        "waiting_reason": record.waiting_reason,
        "attempt": record.attempt,
        "retry_reasons": record.retry_reasons,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
    }


def prompt_shown(record: JobRecord) -> str | None:
    """The instruction a generate job ran with (the default one when none was given)."""
    return record.spec.prompt_text() if record.kind == JobKind.GENERATE else None


def result_json(record: JobRecord) -> dict[str, Any]:
    result = record.result
    fields = result.model_dump(mode="json") if result else {}
    return {
        "id": record.id,
        "state": record.state.value,
        "error": record.error,
        "text": None,
        "prompt": prompt_shown(record),
        "default_prompt": record.kind == JobKind.GENERATE and record.spec.prompt is None,
        **fields,
    }


def print_result(console: "Console", payload: dict[str, Any]) -> None:
    if payload.get("default_prompt"):
        console.print(f"[dim]no --prompt given: asked “{DEFAULT_GENERATE_PROMPT}”[/dim]")
    if payload.get("text"):
        console.print(payload["text"].strip(), markup=False, highlight=False)
        console.print()
    if payload.get("error"):
        state = payload["state"]  # failed or cancelled
        partial = " (the text above is what it generated before)" if payload.get("text") else ""
        console.print(f"[red]{state}:[/red] {payload['error']}{partial}", highlight=False)
        return
    if payload.get("prompt_tokens") is None:
        console.print(f"state: {payload['state']} (no result yet; --wait waits for it)")
        return
    console.print(f"[dim]{stats_line(payload)}[/dim]", highlight=False)


def stats_line(payload: dict[str, Any]) -> str:
    """prompt tokens (and how many came from a kept cache), speeds, times, peak memory."""
    peaks = ", ".join(f"{p / 1024**2:.0f} MiB" for p in payload["peak_memory_bytes"])
    cached = payload.get("cached_tokens") or 0
    computed = payload["prompt_tokens"] - cached
    prompt = f"prompt {payload['prompt_tokens']} tok"
    if cached:
        prompt += f" ({cached} from the kept cache, {computed} computed)"
    return (
        f"{prompt} at {payload['prompt_tps']:.1f} tok/s · "
        f"generated {payload['generated_tokens']} tok at {payload['generation_tps']:.1f} tok/s · "
        f"load {payload['load_s']:.1f}s prefill {payload['prefill_s']:.1f}s "
        f"decode {payload['decode_s']:.1f}s · peak memory per rank: {peaks}"
    )


def live_batch_size(conn: "redis.Redis", record: JobRecord) -> int | None:
    """While the job decodes: how many jobs its group's batch runs now, it among them (those
    decoding together and any prefilling to join them: jobs/warm_groups.py). None otherwise
    (its result then says the most it decoded with)."""
    from jobs.warm_groups import WarmGroups

    placement = record.placement
    if record.state != JobState.DECODE or placement is None:
        return None
    members = WarmGroups(conn).batch(placement.group_id)
    return len(members) if record.id in members else None


def describe(record: JobRecord, batch_now: int | None = None) -> str:
    where = placement_text(record.placement)
    line = f"{record.id}  {record.kind.value}  {record.state.value}  {where}"
    if record.placement is not None and record.placement.warm:
        line += " (warm group)"
    progress = record.progress
    if not record.state.is_final and progress.total:
        line += f"\n  {progress.phase.value}: {progress.processed}/{progress.total} tok"
        rate = progress.generation_tps or progress.prompt_tps
        line += f" at {rate:.1f} tok/s, ETA {format_eta(eta_s(progress))}" if rate else ""
    if record.placement is not None and record.placement.reason:
        line += f"\n  placement: {record.placement.reason}"
    if record.waiting_reason and record.state == JobState.QUEUED:
        line += f"\n  waiting: {record.waiting_reason}"
    if record.kind == JobKind.GENERATE and record.spec.prompt is None:
        line += f"\n  prompt: none given, so the default: “{DEFAULT_GENERATE_PROMPT}”"
    if record.result is not None and record.result.cached_tokens:
        source = record.result.cache_source or "a kept KV cache"
        line += f"\n  prefix: {record.result.cached_tokens} prompt tokens from {source}"
    if record.result is not None and record.result.batch_size > 1:
        line += f"\n  batch: decoded with up to {record.result.batch_size} sequences at once"
    elif record.result is None and batch_now is not None and batch_now > 1:
        line += f"\n  batch: decoding in a batch of {batch_now} jobs now"
    for i, reason in enumerate(record.retry_reasons, 1):
        line += f"\n  retry {i}: {reason}"
    if record.error:
        line += f"\n  error: {record.error}"
    return line


def placement_text(placement: Placement | None) -> str:
    if placement is None:
        return "not placed"
    return f"{placement.strategy}-{placement.ranks} on {','.join(placement.nodes)}"


def format_eta(seconds: float | None) -> str:
    """`1:05` / `1:02:05` left, or `-` when the phase has no speed to go by."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def watch(store: "JobStore", job_id: str, console: "Console") -> JobRecord:
    """Live view of a job in Redis until it reaches a final state."""
    latest: list[JobRecord] = []

    def poll() -> tuple[JobProgress, bool]:
        latest[:] = [store.get(job_id)]
        return latest[0].progress, latest[0].state.is_final

    live_progress(poll, console)
    return latest[0]


def live_progress(poll: Callable[[], tuple[JobProgress, bool]], console: "Console") -> None:
    """A bar (phase, tokens done/total, tok/s, ETA) refreshed until poll() says done. The ETA is
    the job's own remaining tokens / reported tok/s (prefill's prompt tokens; decode's up to
    max_tokens), not rich's guess from bar updates, which would count the time spent loading
    as slow progress."""
    from rich.progress import BarColumn, Progress, TextColumn

    columns = (
        TextColumn("{task.description:<9}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tok"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[eta]}"),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("queued", total=1, rate="", eta="")
        while True:
            progress, done = poll()
            speed = progress.generation_tps or progress.prompt_tps
            rate = f"{speed:.0f} tok/s" if speed else ""
            left = eta_s(progress)
            bar.update(
                task,
                description=progress.phase.value,
                completed=progress.processed,
                total=max(progress.total, 1),
                rate=rate,
                eta=f"ETA {format_eta(left)}" if left is not None and not done else "",
            )
            if done:
                return
            time.sleep(WATCH_INTERVAL_S)


def nodes_table(nodes: list[NodeInfo], reserved_bytes: dict[str, int]) -> "Table":
    """`device`: what its ranks compute on; `memory`: the node's budget; `reserved`: what
    running groups hold of it; `free (OS)`: what the operating system (or the GPU) reports free
    right now."""
    from rich.table import Table

    table = Table("node", "device", "address", "memory", "reserved", "free (OS)", "heartbeat")
    now = time.time()
    for n in nodes:
        table.add_row(
            n.name,
            n.device if n.device != "cpu" else n.backend,  # agents before `device` say only this
            n.address,
            f"{n.memory_bytes / 1024**3:.1f} GiB",
            f"{reserved_bytes.get(n.name, 0) / 1024**3:.2f} GiB",
            f"{(n.available_bytes if n.free_bytes is None else n.free_bytes) / 1024**3:.1f} GiB",
            f"{now - n.heartbeat_at:.1f}s ago",
        )
    return table


def count(tokens: int) -> str:
    """4096 -> 4096, 131072 -> 131K, 1048576 -> 1.0M: a token count in a few characters."""
    if tokens < 10_000:
        return str(tokens)
    if tokens < 1_000_000:
        return f"{tokens // 1000}K"
    return f"{tokens / 1e6:.1f}M"


def jobs_table(jobs: "list[JobSummary]", now: float | None = None) -> "Table":
    """A job list: progress for live jobs, the waiting reason of queued ones, the error of
    failed ones."""
    from rich.table import Table

    now = time.time() if now is None else now
    from rich import box

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    # The short columns keep their words whole (80 columns hold them); on a narrow terminal the
    # long ones give way: a model path shows its last part, a document name is cut, a note wraps.
    for name, width in (("job", 12), ("kind", 8), ("state", 9), ("tokens", 6)):
        table.add_column(name, no_wrap=True, min_width=width)
    table.add_column("model", overflow="fold", ratio=1)
    table.add_column("document", overflow="fold", ratio=1)
    table.add_column("age", no_wrap=True, min_width=4)
    table.add_column("note", overflow="fold", ratio=2)
    for job in jobs:
        progress = job.progress
        tokens = f"{count(progress.processed)}/{count(progress.total)}" if progress.total else "-"
        note = job.waiting_reason if job.state == JobState.QUEUED else job.error
        table.add_row(
            job.id,
            job.kind.value,
            job.state.value,
            tokens,
            Path(job.model).name if job.model else "-",
            job.document_name or "-",
            format_eta(now - job.created_at),
            note or "",
        )
    return table
