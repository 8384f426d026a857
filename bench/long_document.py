"""A long document through the service at default settings: admitted, paced, checkpointed by
the rule, answered, and asked again.

    python -m bench.long_document --model random:qwen2.5-7b-1m --tokens 1000000   # one H200
    python -m bench.long_document --model random:qwen2.5-7b-1m --tokens 524288    # one H100
    python -m bench.long_document --model random:tiny-qwen2 --tokens 32768 --nodes 1 \
        --peak-tflops 0                                                           # the CPU

On a fresh `ringq up` (one node agent per GPU, or `--nodes`):
1. a generate job on the document, sampled while it runs: its progress and ETA (`eta_s`, the
   rank's own, counted down), and the memory in use (the GPU's, from nvidia-smi; on the CPU the
   rank processes' resident memory);
2. a second question on the same document: its prefill starts from the kept prefix in memory;
3. the same document rotated (no prefix in common) submitted again and its last rank killed
   with SIGKILL at `--kill-at` of its prefill: the retry resumes from its checkpoint if the
   prefill took checkpoints by the rule (RINGQ_CHECKPOINT_AFTER_S), else restarts.
`resume_s` is the killed job's kill -> finished: noticing the death, placing the retry, its load
and warm-up, reading the checkpoint, the rest of the prefill and the answer. `restart_s` is the
same retry had it started from zero: `resume_s` less its checkpoint read and its prefill, plus the
first job's whole prefill (`first_job_s`, that job's submit -> finished, also holds a fresh
machine's kernel compiles, which a retry's group finds cached). `prefill_share_after_kill` is
the prompt's FLOPs after the kill's token over all of them: what even a checkpoint taken at the
kill leaves to redo (at 80 % of the tokens, about a third: each later token attends to more).
`ideal_s` is the prompt's FLOPs (2 P + 2 layers d_model N per token) over 60 % of
`--peak-tflops` (dense bf16: 989 for an H100 or H200).
Writes bench/results/long-document-<machine>.json.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import psutil

from bench.gpu_service import document_of
from bench.resume import late_in_prefill, resume_read
from cli.bench_machine import machine_info, source_revision
from cli.services import LocalCluster
from jobs.listing import eta_s
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import final_record, rank_pid, rank_processes, wait_for

OUT = Path(__file__).parent / "results"
TIMEOUT_S = 3600.0
SAMPLE_S = 0.5
IDEAL_SHARE = 0.6  # of the card's dense peak: the line a prefill is held to
ETA_FROM_SHARE = 0.1  # ETA errors count from this share of the prompt on
ETA_LAST_S = 1.0  # and not in the last second, where a relative error says nothing
Phase = Callable[[dict[str, Any]], object]  # given the report so far


class Sampler:
    """Every SAMPLE_S while a job runs: its progress, its ETA, and the memory in use."""

    def __init__(self, store: JobStore, job_id: str, gpu: bool):
        self.store, self.job_id, self.gpu = store, job_id, gpu
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            record = self.store.get(self.job_id)
            progress = record.progress
            self.rows.append({
                "t": time.time(),
                "phase": progress.phase.value,
                "processed": progress.processed,
                "total": progress.total,
                "eta_s": eta_s(progress),
                "memory_bytes": self._memory(record),
            })  # fmt: skip

    def _memory(self, record: JobRecord) -> int | None:
        if self.gpu:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, check=False,
            ).stdout  # fmt: skip
            return sum(int(v) for v in out.split()) * 1024**2 if out.strip() else None
        if record.placement is None:
            return None
        pids = rank_processes(record.placement.group_id)
        return sum(psutil.Process(p).memory_info().rss for p in pids if psutil.pid_exists(p))


def eta_errors(samples: list[dict[str, Any]], prefill_end: float) -> list[float]:
    """|ETA - the real time left| / the real time left, from the 10 % mark of the prefill on
    (the last second left out: a relative error of a near-zero remainder says nothing)."""
    errors = []
    for row in samples:
        left = prefill_end - row["t"]
        if row["phase"] != "prefill" or row["eta_s"] is None or left < ETA_LAST_S:
            continue
        if row["processed"] >= ETA_FROM_SHARE * row["total"] > 0:
            errors.append(abs(row["eta_s"] - left) / left)
    return errors


def finished(store: JobStore, job_id: str) -> JobRecord:
    end = wait_for(lambda: final_record(store, job_id), f"job {job_id}", TIMEOUT_S)
    if end.result is None:
        raise click.ClickException(f"job {job_id} ended {end.state}: {end.error}")
    return end


def kill_late(store: JobStore, home: Path, spec: JobSpec, share: float) -> dict[str, Any]:
    job = submit_job(store.conn, spec)
    late = wait_for(lambda: late_in_prefill(store, job.id, share), "the kill", TIMEOUT_S)
    assert late.placement is not None
    placement, last = late.placement, late.placement.ranks - 1
    node = placement.nodes[last * len(placement.nodes) // placement.ranks]
    killed_at = time.time()
    os.kill(rank_pid(placement.group_id, last, store.conn, node), signal.SIGKILL)
    end = finished(store, job.id)
    assert end.result is not None
    resumed, read_s = resume_read(home, job.id)
    return {
        "killed_at_tokens": late.progress.processed,
        "resumed_from_tokens": resumed,
        "resume_s": end.updated_at - killed_at,
        "retry_prefill_s": end.result.prefill_s,
        "checkpoint_read_s": read_s,
    }


def measure(args: dict[str, Any], on_phase: Phase | None = None) -> dict[str, Any]:
    """The report; `on_phase(report so far)` after the first job and after the second question,
    so a run cut short keeps what it measured."""
    question = JobSpec(
        kind=JobKind.GENERATE, document=document_of(args["tokens"]), model=args["model"],
        max_tokens=32, prompt="What is this document about?",
    )  # fmt: skip
    home = Path(tempfile.mkdtemp(prefix="ringq-long-document-"))
    try:
        return run_jobs(args, question, home, on_phase or (lambda report: None))
    finally:
        if args.get("logs") and (home / "logs").is_dir():  # the ranks' own account of each phase
            shutil.copytree(home / "logs", args["logs"], dirs_exist_ok=True)
        shutil.rmtree(home, ignore_errors=True)


def run_jobs(
    args: dict[str, Any], question: JobSpec, home: Path, on_phase: Phase
) -> dict[str, Any]:
    model, tokens, gpu = args["model"], args["tokens"], args["peak_tflops"] > 0
    settings = Settings(home=home, redis_url=None)
    shape = read_model_shape(resolve_model(model, allowed_dirs=None))
    with LocalCluster(settings, args["nodes"]) as cluster:
        cluster.wait_ready(timeout_s=180)
        store = JobStore(connect(cluster.url))
        first = submit_job(store.conn, question)
        with Sampler(store, first.id, gpu) as sampler:
            one = finished(store, first.id)
        report = first_job(one, sampler.rows, shape, args["peak_tflops"] * 1e12)
        on_phase(report)
        again = submit_job(store.conn, question.model_copy(update={"prompt": "Who wrote it?"}))
        two = finished(store, again.id)
        assert two.result is not None
        report |= {
            "second_question_prefill_s": two.result.prefill_s,
            "second_question_cached_tokens": two.result.cached_tokens,
            "second_question_cache_source": two.result.cache_source,
        }
        on_phase(report)
        rotated = question.model_copy(update={"document": document_of(tokens, 1)})
        killed = kill_late(store, home, rotated, args["kill_at"])
    prompt_tokens = report["prompt_tokens"]
    # the same retry from zero: its own placement, load, warm-up and answer, a whole prefill
    restart_s = (
        killed["resume_s"] - killed["checkpoint_read_s"] - killed["retry_prefill_s"]
        + report["prefill_s"]
    )  # fmt: skip
    return report | {
        **killed,
        "restart_s": restart_s,
        "resume_over_restart": killed["resume_s"] / restart_s,
        # the prefill a retry redoes even from a checkpoint at the kill: a late token costs more
        "prefill_share_after_kill": shape.prefill_flops(killed["killed_at_tokens"], prompt_tokens)
        / shape.prefill_flops(0, prompt_tokens),
    }


def first_job(
    one: JobRecord, samples: list[dict[str, Any]], shape: Any, peak: float
) -> dict[str, Any]:
    """The first job's figures: its prefill against the FLOPs line, memory, ETA and time."""
    assert one.result is not None and one.placement is not None
    started = one.result.prefill_started_at or one.created_at
    errors = eta_errors(samples, started + one.result.prefill_s)
    prompt_tokens = one.result.prompt_tokens
    flops = shape.prefill_flops(0, prompt_tokens)
    memory = [row["memory_bytes"] for row in samples if row["memory_bytes"]]
    return {
        "model": one.spec.model,
        "prompt_tokens": prompt_tokens,
        "placement": one.placement.reason,
        "prefill_s": one.result.prefill_s,
        "ideal_s": flops / (IDEAL_SHARE * peak) if peak else None,
        "mfu": flops / one.result.prefill_s / peak if peak else None,
        "predicted_peak_bytes": one.placement.job_bytes_per_node,
        "measured_peak_bytes": max(one.result.peak_memory_bytes),
        "sampled_memory_max_bytes": max(memory, default=None),
        "eta_error_max": max(errors, default=None),
        "eta_error_median": sorted(errors)[len(errors) // 2] if errors else None,
        "eta_samples": len(errors),
        "first_job_s": one.updated_at - one.created_at,
        "samples": samples,
    }


@click.command()
@click.option("--model", default="random:qwen2.5-7b-1m", show_default=True)
@click.option("--tokens", default=1_000_000, show_default=True, help="Document length.")
@click.option("--nodes", type=int, default=None, help="Node agents (default: one per GPU).")
@click.option("--kill-at", default=0.8, show_default=True, help="Share of the prefill.")
@click.option("--peak-tflops", default=989.0, show_default=True, help="0: no FLOPs line (CPU).")
@click.option("--machine", default=None, help="Names the result file (default: this machine).")
@click.option("--out", type=click.Path(path_type=Path), help="Default: bench/results/.")
@click.option("--logs", type=click.Path(path_type=Path), default=None, help="Keep the logs here.")
def main(**args: Any) -> None:
    info = machine_info(Settings())
    machine = args["machine"] or ("gpu" if args["peak_tflops"] else "cpu")
    head = {
        "machine": machine,
        "commit": (source_revision() or {}).get("commit"),
        "machine_info": info,
        "command": " ".join(["python -m bench.long_document", *sys.argv[1:]]),
    }
    out = args["out"] or OUT / f"long-document-{machine}.json"

    def write(measured: dict[str, Any]) -> dict[str, Any]:
        report = head | measured
        out.write_text(json.dumps(report, indent=1) + "\n")
        return report

    report = write(measure(args, write))
    summary = {k: v for k, v in report.items() if k != "samples"}
    click.echo(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
