"""A mixed backlog through the service: every job submitted at once, then the makespan and each
job's latency, for automatic placement and forced all-ring / all-single (issue 9, item 5).

    python -m bench.gpu_backlog --mix 8x32768,2x131072 --out backlog.json

Each strategy gets a fresh `ringq up` (one node agent per GPU, default settings) and one job
first, so every run starts with a warm group of the layout a lone job gets."""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from admission.vocabulary import STRATEGY_CHOICES, StrategyChoice
from bench.gpu_service import document_of, job_row, wait_for_spare_ranks
from cli.services import LocalCluster
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import submit_job

POLL_S = 0.05


def parse_mix(text: str) -> list[int]:
    """ "8x32768,2x131072" -> eight 32768s then two 131072s."""
    lengths = []
    for part in text.split(","):
        count, tokens = part.split("x")
        lengths += [int(tokens)] * int(count)
    return lengths


def run_backlog(
    model: str, lengths: list[int], strategy: StrategyChoice, timeout_s: float
) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="ringq-backlog-"))
    try:
        with LocalCluster(Settings(home=home, redis_url=None)) as cluster:
            cluster.wait_ready(timeout_s=120)
            wait_for_spare_ranks(home / "logs", cluster.node_names, {})
            conn = connect(cluster.url)
            store = JobStore(conn)
            specs = [
                JobSpec(
                    kind=JobKind.PREFILL,
                    document=document_of(tokens),
                    model=model,
                    strategy=strategy,
                )
                for tokens in [lengths[-1], *lengths]
            ]
            first = submit_job(conn, specs[0]).id  # a lone job: warms the lone layout's group
            wait_final(store, [first], timeout_s)
            started = time.time()
            ids = [submit_job(conn, spec).id for spec in specs[1:]]
            wait_final(store, ids, timeout_s)
            rows = [job_row(store.get(job_id)) for job_id in ids]
            ended = max(store.get(job_id).updated_at for job_id in ids)
            return {
                "strategy": strategy,
                "lone_job": job_row(store.get(first)),
                "makespan_s": ended - started,
                "jobs": rows,
            }
    finally:
        shutil.rmtree(home, ignore_errors=True)


def wait_final(store: JobStore, ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(store.get(job_id).state.is_final for job_id in ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs not final after {timeout_s} s")
        time.sleep(POLL_S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--mix", default="8x32768,2x131072")
    parser.add_argument("--strategies", default="auto,ring,single")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lengths = parse_mix(args.mix)
    runs = []
    strategies = args.strategies.split(",")
    if unknown := set(strategies) - set(STRATEGY_CHOICES):
        parser.error(f"unknown strategies {sorted(unknown)}: use {', '.join(STRATEGY_CHOICES)}")
    for strategy in strategies:
        run = run_backlog(args.model, lengths, cast(StrategyChoice, strategy), args.timeout_s)
        latencies = sorted(row["submit_to_finished_s"] for row in run["jobs"] if "pp" in row)
        summary = {
            "strategy": strategy,
            "makespan_s": round(run["makespan_s"], 2),
            "lone_job_layout": f"{run['lone_job'].get('strategy')}-{run['lone_job'].get('ranks')}",
            "latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
            "latency_max_s": latencies[-1] if latencies else None,
        }
        print(json.dumps(summary), flush=True)
        runs.append(run)
    if args.out:
        report = {"command": " ".join(sys.argv), "model": args.model, "runs": runs}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
