"""The service path on a GPU machine, with default settings: start the services as `ringq up`
does (one node agent per GPU), submit prefill jobs through Redis, and record per job submit ->
finished, prefill tok/s and load time, cold (the first job of a fresh group) and warm.

    python -m bench.gpu_service --model random:llama-3.1-8b --pp 32768,131072 \
        --out bench/results/h200-service/service.json

Each prompt length gets a fresh `ringq up` (its first job is a cold group), then `--warm`
more jobs on the same group. Each job's document is a different rotation of the text, so a
warm job prefills its whole prompt (the same document would start from the kept prefix:
bench.prefix_speedup measures that). `--env KEY=VALUE` runs a variant (e.g. RINGQ_WARM_UP=0);
`--home DIR` keeps one RINGQ_HOME over the runs (a second `ringq up` on the same machine).
Times come from the job records (server-side clocks): created_at, prefill_started_at, and the
finishing transition's updated_at.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

from admission.vocabulary import STRATEGY_CHOICES
from cli.services import LocalCluster
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import submit_job

POLL_S = 0.02


def document_of(tokens: int, variant: int = 0) -> str:
    """About `tokens` tokens of text for the random models' byte tokenizer (one per byte);
    each `variant` starts at a different place in the text (no prefix in common)."""
    text = files("cli").joinpath("demo/document.md").read_text().encode("ascii", "ignore")
    shift = variant * 997 % len(text)
    text = text[shift:] + text[:shift]
    tiled = (text * (tokens // len(text) + 1))[:tokens]
    return tiled.decode("ascii")


def run_job(store: JobStore, conn: Any, spec: JobSpec, timeout_s: float) -> dict[str, Any]:
    record = submit_job(conn, spec)
    deadline = time.monotonic() + timeout_s
    while not (record := store.get(record.id)).state.is_final:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {record.id} still {record.state} after {timeout_s} s")
        time.sleep(POLL_S)
    return job_row(record)


def job_row(record: JobRecord) -> dict[str, Any]:
    row: dict[str, Any] = {"id": record.id, "state": record.state.value, "error": record.error}
    if record.placement is not None:
        row |= {
            "strategy": record.placement.strategy,
            "ranks": record.placement.ranks,
            "warm": record.placement.warm,
            "chunk_tokens": record.placement.chunk_tokens,
            "devices": record.placement.devices,
            "reason": record.placement.reason,
        }
    result = record.result
    if result is not None:
        submit_to_finished = record.updated_at - record.created_at
        started = result.prefill_started_at or record.created_at
        row |= {
            "pp": result.prompt_tokens,
            "prompt_tps": result.prompt_tps,
            "prefill_s": result.prefill_s,
            "decode_s": result.decode_s,
            "load_s": result.load_s,
            "submit_to_finished_s": submit_to_finished,
            "submit_to_prefill_s": started - record.created_at,
            "overhead_fraction": 1 - (result.prefill_s + result.decode_s) / submit_to_finished,
            "peak_memory_bytes": result.peak_memory_bytes,
        }
    return row


def wait_for_spare_ranks(logs: Path, nodes: list[str], env: dict[str, str]) -> None:
    """A service that has been up a while has its spare ranks ready: wait for that (at most
    60 s), so that "cold" measures a new group, not the service's own start."""
    if env.get("RINGQ_STANDBY_RANK") == "off":
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        texts = [(logs / f"{n}-standby.log") for n in nodes]
        if all(p.exists() and "spare rank ready" in p.read_text() for p in texts):
            return
        time.sleep(0.2)


def run_length(args: argparse.Namespace, pp: int, env: dict[str, str]) -> list[dict[str, Any]]:
    """A fresh `ringq up`, one cold job and `args.warm` warm ones of `pp` tokens."""
    home = args.home or Path(tempfile.mkdtemp(prefix="ringq-gpu-service-"))
    os.environ.update(env)
    rows = []
    try:
        settings = Settings(home=home, redis_url=None)
        with LocalCluster(settings, args.nodes, extra_env=env) as cluster:
            cluster.wait_ready(timeout_s=120)
            wait_for_spare_ranks(home / "logs", cluster.node_names, env)
            conn = connect(cluster.url)
            store = JobStore(conn)
            for index in range(1 + args.warm):
                spec = JobSpec(
                    kind=JobKind.PREFILL,
                    document=document_of(pp, index),
                    model=args.model,
                    strategy=args.strategy,
                )
                row = run_job(store, conn, spec, args.timeout_s)
                row |= {"cold": index == 0, "env": env, "nodes": cluster.describe()}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for key in env:
            os.environ.pop(key, None)
        if args.logs is not None:  # the services' and ranks' logs, for the profile
            args.logs.mkdir(parents=True, exist_ok=True)
            shutil.copytree(home / "logs", args.logs / f"{pp}-{home.name}", dirs_exist_ok=True)
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--pp", default="32768,131072")
    parser.add_argument("--warm", type=int, default=2, help="warm jobs after the cold one")
    parser.add_argument("--nodes", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--strategy", default="auto", choices=STRATEGY_CHOICES)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for a variant")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--logs", type=Path, help="copy each run's service and rank logs here")
    parser.add_argument(
        "--home", type=Path, help="RINGQ_HOME kept between runs (its kernel cache); default: fresh"
    )
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    rows = []
    for pp in (int(p) for p in args.pp.split(",")):
        rows.extend(run_length(args, pp, env))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"command": " ".join(sys.argv), "model": args.model, "jobs": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
