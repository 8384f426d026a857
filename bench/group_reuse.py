"""Warm groups vs a fresh group per job, side by side on one machine: N jobs one after another
through a local cluster with RINGQ_GROUP_IDLE_S=60, then the same N with RINGQ_GROUP_IDLE_S=0.

    uv run python -m bench.group_reuse --model smollm2 --jobs 20

Per job: wait = prefill start - enqueue (the rank's clock minus the record's created_at; one
machine, one clock), load_s from the result, end-to-end = final record update - enqueue.
Writes bench/results/warm-groups.json.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import click

from admission.vocabulary import STRATEGY_CHOICES, StrategyChoice
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import private_cluster

OUT = Path(__file__).parent / "results" / "warm-groups.json"
DOCUMENT = "Warm groups keep a model loaded between jobs of the same shape. " * 20


def run_jobs(model: str, count: int, idle_s: float, strategy: StrategyChoice) -> list[dict]:
    env = {"RINGQ_GROUP_IDLE_S": str(idle_s), "RINGQ_RANK_PORT_BASE": "36300"}
    rows = []
    with private_cluster("warmb", env) as cluster:
        store = JobStore(connect(cluster.url))
        for i in range(count):
            spec = JobSpec(
                kind=JobKind.PREFILL, document=f"{i}. {DOCUMENT}", model=model, strategy=strategy
            )
            record = submit_job(store.conn, spec)
            while not (final := store.get(record.id)).state.is_final:
                time.sleep(0.005)
            assert final.state == JobState.FINISHED, final.error
            assert final.result is not None and final.result.prefill_started_at is not None
            assert final.placement is not None
            rows.append(
                {
                    "job": i,
                    "warm": final.placement.warm,
                    "wait_ms": 1000 * (final.result.prefill_started_at - final.created_at),
                    "load_s": final.result.load_s,
                    "prefill_s": final.result.prefill_s,
                    "end_to_end_s": final.updated_at - final.created_at,
                }
            )
            print(json.dumps({"idle_s": idle_s, **rows[-1]}), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    waits = sorted(r["wait_ms"] for r in rows)
    return {
        "jobs": len(rows),
        "warm_jobs": sum(r["warm"] for r in rows),
        "median_wait_ms": median("wait_ms"),
        "p90_wait_ms": waits[int(0.9 * (len(waits) - 1))],
        "median_load_s": median("load_s"),
        "median_end_to_end_s": median("end_to_end_s"),
    }


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--jobs", "count", default=20, show_default=True)
@click.option(
    "--strategy",
    type=click.Choice(STRATEGY_CHOICES),
    default="single",
    show_default=True,
)
def main(model: str, count: int, strategy: StrategyChoice) -> None:
    warm = run_jobs(model, count, 60.0, strategy)
    cold = run_jobs(model, count, 0.0, strategy)
    result: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.group_reuse", *sys.argv[1:]]),
        "model": model,
        "strategy": strategy,
        # the first warm-run job loads its group: the rest are the warm ones
        "warm": summary([r for r in warm if r["warm"]]),
        "cold": summary(cold),
        "rows": {"warm": warm, "cold": cold},
    }
    result["end_to_end_speedup"] = (
        result["cold"]["median_end_to_end_s"] / result["warm"]["median_end_to_end_s"]
    )
    OUT.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("warm", "cold", "end_to_end_speedup")}, indent=1))


if __name__ == "__main__":
    main()
