"""Run one job on a group of rank processes on this machine, without Redis (`ringq run`, bench)."""

import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from admission.estimate import Layout
from admission.group_plan import GroupPlan, NodeFacts, default_chunk_tokens, plan_group
from admission.vocabulary import Exchange, KVLayout, Strategy
from jobs.model_catalog import default_dtype, resolve_model
from jobs.schemas import GroupSpec, JobResult, JobSpec, Progress
from ring_worker.engine.devices import node_backend, visible_gpus
from ring_worker.engine.group import free_loopback_ports
from ring_worker.runtime.processes import rank_environment, spawn_rank, terminate_all

POLL_INTERVAL_S = 0.1


class LocalRunError(RuntimeError):
    pass


def run_local(
    job_id: str,
    spec: JobSpec,
    tokens: list[int],
    ranks: int,
    chunk_tokens: int | None,
    *,
    scratch_root: Path,
    strategy: Strategy | None = None,
    exchange: Exchange | None = None,
    kv_layout: KVLayout = "replicated",
    blas: str = "auto",
    backend: str = "auto",
    on_progress: Callable[[Progress], None] | None = None,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
) -> JobResult:
    """Spawn `ranks` rank processes on loopback, feed them the job through files, follow their
    events. The group follows the same plan as the service's (admission.group_plan): a GPU per
    rank while there are enough, NCCL only then. Raises LocalRunError with the ranks' own reason
    when the job fails."""
    scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"run-{job_id}-", dir=scratch_root))
    layout = Layout(strategy or ("single" if ranks == 1 else "ring"), ranks, kv_layout)
    plan = local_plan(layout, spec.model, chunk_tokens, exchange, backend)
    group = GroupSpec.from_plan(
        plan,
        group_id=scratch.name,
        job_id=job_id,
        model=spec.model,
        addresses=[f"127.0.0.1:{p}" for p in free_loopback_ports(ranks)],
    )
    (scratch / "group.json").write_text(group.model_dump_json())
    job_file = scratch / "job.json"
    job = {"id": job_id, "spec": spec.model_dump(mode="json"), "tokens": tokens}
    job_file.write_text(json.dumps({**job, "chunk_tokens": plan.chunk_tokens}))
    events = scratch / "events.jsonl"
    events.touch()
    threads = max(1, (os.cpu_count() or 1) // ranks)
    procs = [
        spawn_rank(
            [
                "-m",
                "ring_worker.rank_main",
                "--group",
                str(scratch / "group.json"),
                "--rank",
                str(rank),
                "--job-file",
                str(job_file),
                "--events-file",
                str(events),
            ],
            rank_environment(
                blas,
                threads=threads,
                local_rank=rank,
                backend="cpu" if plan.devices[rank] == "cpu" else backend,
            ),
            scratch / f"rank{rank}.log",
        )
        for rank in range(ranks)
    ]
    try:
        return follow(procs, events, scratch, on_progress, timeout_s, stop)
    finally:
        terminate_all(procs)


def local_plan(
    layout: Layout,
    model: str,
    chunk_tokens: int | None,
    exchange: Exchange | None,
    backend: str = "auto",
) -> GroupPlan:
    """The plan for ranks on this machine: rank i on GPU i mod G (sharing when fewer)."""
    device = node_backend(backend)
    gpus = visible_gpus() if device == "cuda" else []
    facts = [
        NodeFacts("local", device, f"local/{gpus[i % len(gpus)]}" if gpus else None)
        for i in range(layout.size)
    ]
    return plan_group(
        layout,
        facts,
        model_dtype=default_dtype(resolve_model(model, allowed_dirs=None)),  # ranks check it
        chunk_tokens=chunk_tokens or default_chunk_tokens(device),
        exchange=exchange,
    )


def follow(procs, events: Path, scratch: Path, on_progress, timeout_s, stop) -> JobResult:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    offset = 0
    while True:
        with events.open() as stream:
            stream.seek(offset)
            lines = stream.readlines()
            offset = stream.tell()
        for line in lines:
            event = json.loads(line)
            if event["event"] == "progress" and on_progress:
                on_progress(Progress.model_validate(event["data"]))
            elif event["event"] == "error":
                raise LocalRunError(event["data"])
            elif event["event"] == "result":
                return JobResult.model_validate(event["data"])
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
            time.sleep(POLL_INTERVAL_S)  # a failing rank writes its reason just before it exits
            if events.stat().st_size == offset:
                raise LocalRunError(f"ranks exited with codes {codes}; logs in {scratch}")
        if stop is not None and stop.is_set():
            raise LocalRunError("interrupted")
        if deadline and time.monotonic() > deadline:
            raise LocalRunError(f"timed out after {timeout_s} s; logs in {scratch}")
        time.sleep(POLL_INTERVAL_S)
