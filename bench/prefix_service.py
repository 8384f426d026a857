"""The service side of bench/prefix_speedup.py: the same questions as jobs through a local
cluster (its own Redis, dispatcher and node agents), once with RINGQ_PREFIX_CACHE=off (each
question submitted after the previous one finished) and once with it on (all questions
submitted at once, as `ringq submit generate DOC --prompt Q1 ... --prompt Q8` does)."""

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.services import LocalCluster
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id

POLL_S = 0.02


def finished(store: JobStore, job_ids: list[str], timeout_s: float) -> list[JobRecord]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = [store.get(i) for i in job_ids]
        if all(r.state.is_final for r in records):
            failed = [f"{r.id}: {r.error}" for r in records if r.state != JobState.FINISHED]
            if failed:
                raise RuntimeError("jobs failed: " + "; ".join(failed))
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not done within {timeout_s} s")
        time.sleep(POLL_S)


def run_cluster(specs: list[JobSpec], env: dict[str, str], nodes: int, at_once: bool,
                timeout_s: float, logs: Path | None = None,
                ) -> tuple[list[JobRecord], float, float]:  # fmt: skip
    """The jobs' records, the makespan (first submit to last finish) and its unix start; the
    services' and ranks' logs are copied to `logs` (before the cluster's home is removed)."""
    with tempfile.TemporaryDirectory(prefix="ringq-pb-", dir="/tmp") as home:
        settings = Settings(home=Path(home), redis_url=None)
        try:
            return run_jobs(settings, specs, env, nodes, at_once, timeout_s)
        finally:
            if logs is not None:
                shutil.copytree(Path(home) / "logs", logs, dirs_exist_ok=True)


def run_jobs(settings: Settings, specs: list[JobSpec], env: dict[str, str], nodes: int,
             at_once: bool, timeout_s: float) -> tuple[list[JobRecord], float, float]:  # fmt: skip
    with LocalCluster(settings, nodes, name_prefix="pb", extra_env=env) as cluster:
        cluster.wait_ready()
        store = JobStore(connect(cluster.url))
        warm_up(store, specs, timeout_s)
        started, started_unix = time.perf_counter(), time.time()
        if at_once:
            ids = [r.id for r in enqueue_jobs(store.conn, [(new_job_id(), s) for s in specs])]
            records = finished(store, ids, timeout_s)
        else:
            records = []
            for spec in specs:
                [record] = enqueue_jobs(store.conn, [(new_job_id(), spec)])
                records += finished(store, [record.id], timeout_s)
        return records, time.perf_counter() - started, started_unix


def warm_up(store: JobStore, specs: list[JobSpec], timeout_s: float) -> None:
    """Load the model and compile once in a warm group of every layout the specs ask for: short
    jobs on their own document (they keep nothing the questions can use)."""
    layouts = {(s.strategy, s.ranks): s for s in specs}
    for spec in layouts.values():
        warm = spec.model_copy(update={"document": "Warm up. " * 8, "max_tokens": 2})
        [record] = enqueue_jobs(store.conn, [(new_job_id(), warm)])
        finished(store, [record.id], timeout_s)


def row(record: JobRecord, started: float) -> dict[str, Any]:
    """One job's figures; `*_at_s` are seconds since the run's first submit (unix clock)."""
    result, placement = record.result, record.placement
    assert result is not None and placement is not None
    began = result.prefill_started_at or record.created_at
    return {"job": record.id, "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens, "cache_source": result.cache_source,
            "prefill_s": result.prefill_s, "decode_s": result.decode_s,
            "submitted_at_s": round(record.created_at - started, 3),
            "prefill_started_at_s": round(began - started, 3),
            "finished_at_s": round(record.updated_at - started, 3),
            "text": result.text, "placement": placement.nodes, "layout": placement.strategy,
            "group": placement.group_id, "warm": placement.warm}  # fmt: skip


def question_specs(
    model: str,
    document: str,
    questions: list[str],
    max_tokens: int,
    first_ring: int,
    ranks: int = 1,
) -> list[JobSpec]:
    """One job per question: on one node, or with `ranks` > 1 every one on a ring of that many
    nodes; with `first_ring` > 1 only the first on a ring of that many (the others then start
    from the ring's kept KV, resharded for one node)."""
    if ranks > 1 and first_ring > 1:
        raise ValueError(f"--ranks {ranks} puts every question on a ring: drop --first-ring")
    layout: dict[str, Any] = {"strategy": "single"}
    if ranks > 1:
        layout = {"strategy": "ring", "ranks": ranks}
    specs = [
        JobSpec(
            kind=JobKind.GENERATE,
            document=document,
            prompt=q,
            model=model,
            max_tokens=max_tokens,
            **layout,
        )  # fmt: skip
        for q in questions
    ]
    if first_ring > 1:
        ring = {"strategy": "ring", "ranks": first_ring}
        specs[0] = specs[0].model_copy(update=ring)
    return specs


def service_level(
    model: str,
    document: str,
    questions: list[str],
    max_tokens: int,
    nodes: int,
    timeout_s: float,
    env: dict[str, str],
    first_ring: int = 1,
    ranks: int = 1,
    logs: Path | None = None,
    modes: tuple[str, ...] = ("off", "on"),
) -> dict[str, Any]:
    specs = question_specs(model, document, questions, max_tokens, first_ring, ranks)
    runs: dict[str, Any] = {}
    for mode, at_once in (("off", False), ("on", True)):
        if mode not in modes:
            continue
        mode_env = {**env, "RINGQ_PREFIX_CACHE": mode}
        mode_logs = logs / mode if logs is not None else None
        records, total_s, started = run_cluster(
            specs, mode_env, nodes, at_once, timeout_s, mode_logs
        )
        runs[mode] = [row(r, started) for r in records]
        runs[f"{mode}_total_s"] = total_s
    return runs
