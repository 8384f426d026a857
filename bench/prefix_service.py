"""The service side of bench/prefix_reuse.py: the same questions as jobs through a local
cluster (its own Redis, dispatcher and node agents), once with RINGQ_PREFIX_CACHE=off (each
question submitted after the previous one finished) and once with it on (all questions
submitted at once, as `ringq submit generate DOC --prompt Q1 ... --prompt Q8` does)."""

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
                timeout_s: float) -> tuple[list[JobRecord], float]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ringq-pb-", dir="/tmp") as home:
        settings = Settings(home=Path(home), redis_url=None)
        with LocalCluster(settings, nodes, name_prefix="pb", extra_env=env) as cluster:
            cluster.wait_ready()
            store = JobStore(connect(cluster.url))
            warm = enqueue_jobs(store.conn, [(new_job_id(), warm_up_spec(specs[0]))])
            finished(store, [warm[0].id], timeout_s)  # load the model and compile once
            started = time.perf_counter()
            if at_once:
                ids = [r.id for r in enqueue_jobs(store.conn, [(new_job_id(), s) for s in specs])]
                records = finished(store, ids, timeout_s)
            else:
                records = []
                for spec in specs:
                    [record] = enqueue_jobs(store.conn, [(new_job_id(), spec)])
                    records += finished(store, [record.id], timeout_s)
            return records, time.perf_counter() - started


def warm_up_spec(spec: JobSpec) -> JobSpec:
    """A short job on the same model and layout (its own document: it keeps nothing useful)."""
    return spec.model_copy(update={"document": "Warm up. " * 8, "max_tokens": 2})


def row(record: JobRecord) -> dict[str, Any]:
    result = record.result
    assert result is not None
    return {"job": record.id, "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens, "prefill_s": result.prefill_s,
            "decode_s": result.decode_s, "text": result.text,
            "placement": record.placement.nodes if record.placement else None}  # fmt: skip


def service_level(model: str, document: str, questions: list[str], max_tokens: int, nodes: int,
                  timeout_s: float, env: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    specs = [
        JobSpec(
            kind=JobKind.GENERATE,
            document=document,
            prompt=q,
            model=model,
            max_tokens=max_tokens,
            strategy="single",
        )  # fmt: skip
        for q in questions
    ]
    off, off_s = run_cluster(specs, {**env, "RINGQ_PREFIX_CACHE": "off"}, nodes, False, timeout_s)
    on, on_s = run_cluster(specs, {**env, "RINGQ_PREFIX_CACHE": "on"}, nodes, True, timeout_s)
    return {"off": [row(r) for r in off], "on": [row(r) for r in on], "off_total_s": off_s,
            "on_total_s": on_s}  # fmt: skip
