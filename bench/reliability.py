"""Reliability trials against a real local cluster (Redis, dispatcher, 2 node agents), many more
times than CI runs them; prints a summary and writes JSON (docs/reliability.md quotes it).

    uv run python -m bench.reliability rank-kill --trials 20
    uv run python -m bench.reliability redis-restart --jobs 100
    uv run python -m bench.reliability soak --jobs 500

rank-kill: a ring-2 prefill, kill -9 of a random rank after a random part of its prefill; a
trial is correct when the job finishes exactly once, the lost group's ranks are gone within 30 s
and its memory is released. redis-restart: N queued jobs, Redis stopped and started under them.
soak: N small jobs; RSS of the dispatcher and agents sampled throughout.
"""

import json
import os
import random
import signal
import time
from contextlib import suppress
from pathlib import Path

import click
import psutil

from cli.services import LocalCluster
from jobs import keys
from jobs.lifecycle import JobState
from jobs.redis_server import connect, ensure_redis
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id, submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    completions,
    private_cluster,
    rank_pid,
    rank_processes,
    wait_for,
)

MODEL = "random:tiny-llama"  # byte tokenizer: one token per byte
DOCUMENT = LONG_DOCUMENT[:6000]
ENV = {
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
    "RINGQ_RANK_PORT_BASE": "33300",
}
OUT = Path(__file__).parent / "results"


def final(store: JobStore, job_id: str, timeout_s: float = 300) -> JobRecord:
    return wait_for(
        lambda: (r := store.get(job_id)).state.is_final and r, f"job {job_id}", timeout_s
    )


def short_jobs(count: int) -> list[tuple[str, JobSpec]]:
    spec = JobSpec(kind=JobKind.PREFILL, document="A short note. " * 20, model=MODEL)
    return [(new_job_id(), spec) for _ in range(count)]


def rank_kill_trial(cluster: LocalCluster, store: JobStore, rng: random.Random) -> dict:
    spec = JobSpec(kind=JobKind.PREFILL, document=DOCUMENT, model=MODEL, ranks=2)
    record = submit_job(store.conn, spec)
    started = wait_for(
        lambda: (r := store.get(record.id)).state == JobState.PREFILL and r, "prefill", 120
    )
    group_id = started.placement.group_id
    time.sleep(rng.uniform(0.0, 1.5))  # somewhere in the prefill (about 2-4 s here)
    victim = rng.choice([0, 1])
    killed_at = time.monotonic()
    with suppress(AssertionError, ProcessLookupError):  # the group ended already: still checked
        os.kill(rank_pid(group_id, victim), signal.SIGKILL)
    teardown_s = None
    while time.monotonic() - killed_at < 60:
        if not rank_processes(group_id):
            teardown_s = time.monotonic() - killed_at
            break
        time.sleep(0.05)
    end = final(store, record.id)
    leases = [store.conn.zscore(keys.node_leases(n), group_id) for n in started.placement.nodes]
    released = all((lease or 0) < time.time() for lease in leases)
    runs = completions(cluster, record.id)
    correct = (
        end.state == JobState.FINISHED
        and runs == 1
        and teardown_s is not None
        and teardown_s < 30
        and released
    )
    return {
        "job": record.id,
        "killed_rank": victim,
        "state": end.state,
        "attempt": end.attempt,
        "completions": runs,
        "teardown_s": teardown_s,
        "memory_released": released,
        "correct": correct,
        "retry_reasons": end.retry_reasons,
        "error": end.error,
    }


@click.group()
def main() -> None:
    """Reliability trials (see the module docstring)."""


@main.command("rank-kill")
@click.option("--trials", default=20, show_default=True)
@click.option("--seed", default=0, show_default=True)
def rank_kill(trials: int, seed: int) -> None:
    rng = random.Random(seed)
    with private_cluster("rel", ENV) as cluster:
        store = JobStore(connect(cluster.url))
        results = []
        for i in range(trials):
            result = rank_kill_trial(cluster, store, rng)
            results.append(result)
            print(
                f"trial {i + 1}/{trials}: killed rank {result['killed_rank']}, "
                f"{result['state']} after {result['attempt']} retries, teardown "
                f"{result['teardown_s'] or float('nan'):.2f} s, correct={result['correct']}",
                flush=True,
            )
        cluster.check_children()
    report("rank-kill", {"trials": trials, "correct": sum(r["correct"] for r in results)}, results)


@main.command("redis-restart")
@click.option("--jobs", "count", default=100, show_default=True)
@click.option("--down-s", default=3.0, show_default=True, help="How long Redis stays down.")
def redis_restart(count: int, down_s: float) -> None:
    with private_cluster("rel", ENV) as cluster:
        store = JobStore(connect(cluster.url))
        jobs = enqueue_jobs(store.conn, short_jobs(count))
        wait_for(lambda: store.get(jobs[0].id).state != JobState.QUEUED, "a first admission")
        url = cluster.url
        assert cluster.redis is not None
        cluster.redis.stop()
        time.sleep(down_s)
        cluster.redis = ensure_redis(cluster.settings)
        assert cluster.url == url
        store = JobStore(connect(url))
        ends = [final(store, job.id, timeout_s=1800) for job in jobs]
        runs = [completions(cluster, job.id) for job in jobs]
        cluster.check_children()
    summary = {
        "jobs": count,
        "finished": sum(e.state == JobState.FINISHED for e in ends),
        "ran_twice": sum(r > 1 for r in runs),
        "never_completed": sum(r == 0 for r in runs),
        "retried": sum(e.attempt > 0 for e in ends),
    }
    report("redis-restart", summary, [])


@main.command()
@click.option("--jobs", "count", default=500, show_default=True)
@click.option("--sample-s", default=5.0, show_default=True)
def soak(count: int, sample_s: float) -> None:
    with private_cluster("rel", ENV) as cluster:
        store = JobStore(connect(cluster.url))
        services = {label: psutil.Process(p.pid) for label, p, _ in cluster.children}
        started = time.monotonic()
        jobs = enqueue_jobs(store.conn, short_jobs(count))
        samples = []
        pending = {job.id for job in jobs}
        while pending:
            rss = {label: proc.memory_info().rss for label, proc in services.items()}
            ranks = rank_rss(cluster)
            rss["ranks_max"] = max(ranks, default=0)
            pending = {j for j in pending if not store.get(j).state.is_final}
            samples.append({"t_s": time.monotonic() - started, "done": count - len(pending), **rss})
            print(
                f"{samples[-1]['t_s']:7.1f} s  {count - len(pending)}/{count} done  "
                + "  ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in rss.items()),
                flush=True,
            )
            if pending:
                time.sleep(sample_s)
        ends = [store.get(job.id) for job in jobs]
        cluster.check_children()
    growth = {
        label: {
            "first_mib": samples[0][label] / 2**20,
            "after_10pct_mib": samples[len(samples) // 10][label] / 2**20,
            "max_mib": max(s[label] for s in samples) / 2**20,
            "last_mib": samples[-1][label] / 2**20,
        }
        for label in [*services, "ranks_max"]
    }
    summary = {
        "jobs": count,
        "finished": sum(e.state == JobState.FINISHED for e in ends),
        "wall_s": samples[-1]["t_s"],
        "rss": growth,
    }
    report("soak", summary, samples)


def rank_rss(cluster: LocalCluster) -> list[int]:
    """RSS of this cluster's rank processes (warm groups live through many jobs)."""
    home, found = str(cluster.settings.home), []
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "ring_worker.rank_main" in cmdline and home in cmdline:
            found.append(proc.info["memory_info"].rss)
    return found


def report(name: str, summary: dict, details: list) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"reliability-{name}.json"
    path.write_text(
        json.dumps(
            {"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "summary": summary, "details": details},
            indent=1,
            default=str,
        )
    )
    print(json.dumps(summary, indent=1, default=str))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
