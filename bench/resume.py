"""Resume benchmark: a long CPU prefill through the service (Redis, dispatcher, 2 node agents),
once uninterrupted, then killed (kill -9 of a rank) at about 85 % of its prefill twice: with
checkpoints, where the retry continues from the group's last one (RINGQ_CHECKPOINT_TOKENS), and
with RINGQ_CHECKPOINT_TOKENS=0, where the retry restarts from zero. Goal: the resumed retry takes
at most 0.3 of the restarted one.

    uv run python -m bench.resume --repeat 400 --every 1024

Writes bench/results/resume-<model>-<tokens>.json: the prefill times (the engine's own
`prefill_s`) of the uninterrupted job and of both retries; the kill-to-finished time of both
retries; their ratios, resumed over restarted (`resume_vs_restart_prefill_ratio`,
`resume_vs_restart_kill_to_finished_ratio`) and, as before, over the uninterrupted job; where
the kills fell and where the retries resumed.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import click

from jobs.checkpoint_marks import checkpoint_hint, read_marks
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import final_record, private_cluster, rank_pid, wait_for

OUT = Path(__file__).parent / "results"
SENTENCE = "Ring attention splits a long prompt over several machines, block by block. "
ENV = {
    "RINGQ_PREFIX_CACHE": "off",  # both runs compute the whole prompt
    "RINGQ_GROUP_IDLE_S": "0",  # and each starts its own group
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
}
TIMEOUT_S = 1800.0


def late_in_prefill(store: JobStore, job_id: str, share: float) -> JobRecord | None:
    record = store.get(job_id)
    if record.state.is_final:
        raise click.ClickException(f"job {job_id} ended before the kill: {record.error}")
    progress = record.progress
    late = record.state == JobState.PREFILL and progress.processed >= share * progress.total > 0
    return record if late else None


def resumed_from(home: Path, job_id: str) -> int:
    """Where rank 0 of the retry said it continued from (0: from the start)."""
    return resume_read(home, job_id)[0]


def resume_read(home: Path, job_id: str) -> tuple[int, float]:
    """Where rank 0 of the retry said it continued from (0: from the start), and the seconds
    its read of the checkpoint took (0 where it logged none)."""
    pattern = re.compile(
        rf"job {job_id} rank 0: resuming from the checkpoint at (\d+) tokens"
        r"(?: \([\d.]+ GB read in ([\d.]+)s\))?"
    )
    for log_path in (home / "logs").glob("*-rank0.log"):
        if found := pattern.search(log_path.read_text()):
            return int(found.group(1)), float(found.group(2) or 0.0)
    return 0, 0.0


def run_jobs(model: str, document: str, every_tokens: int, kill_share: float, nodes: int) -> dict:
    """The uninterrupted job and the killed one, checkpoints on; then the killed one again in a
    cluster with checkpoints off (the same kill point): the restart from zero."""
    spec = JobSpec(kind=JobKind.PREFILL, document=document, model=model)
    with private_cluster("resume", cluster_env(every_tokens), nodes) as cluster:
        store = JobStore(connect(cluster.url))
        clean = submit_job(store.conn, spec)
        whole = wait_for(lambda: final_record(store, clean.id), "the clean run", TIMEOUT_S)
        if whole.state != JobState.FINISHED or whole.result is None:
            raise click.ClickException(f"the uninterrupted run ended {whole.state}: {whole.error}")
        resumed = killed_run(store, cluster.settings.home, spec, kill_share)
    with private_cluster("restart", cluster_env(0), nodes) as cluster:
        restarted = killed_run(
            JobStore(connect(cluster.url)), cluster.settings.home, spec, kill_share
        )
    return {
        "prompt_tokens": whole.result.prompt_tokens,
        "placement": whole.placement.reason if whole.placement else None,
        "uninterrupted_prefill_s": whole.result.prefill_s,
        "uninterrupted_submit_to_finished_s": whole.updated_at - whole.created_at,
        **resumed,
        **{f"restart_{key}": value for key, value in restarted.items()},
    }


def cluster_env(every_tokens: int) -> dict[str, str]:
    port_base = os.environ.get("RINGQ_RANK_PORT_BASE", "34800")
    return {**ENV, "RINGQ_CHECKPOINT_TOKENS": str(every_tokens), "RINGQ_RANK_PORT_BASE": port_base}


def killed_run(store: JobStore, home: Path, spec: JobSpec, kill_share: float) -> dict:
    """Submit `spec`, kill -9 its last rank once `kill_share` of the prefill is done, and wait
    for the retry to finish."""
    job = submit_job(store.conn, spec)
    late = wait_for(lambda: late_in_prefill(store, job.id, kill_share), "the kill", TIMEOUT_S)
    assert late.placement is not None
    hint = checkpoint_hint(read_marks(store.conn, job.id))
    killed_at = time.time()
    placement, last = late.placement, late.placement.ranks - 1
    node = placement.nodes[last * len(placement.nodes) // placement.ranks]
    os.kill(rank_pid(placement.group_id, last, store.conn, node), signal.SIGKILL)
    end = wait_for(lambda: final_record(store, job.id), "the retry", TIMEOUT_S)
    if end.state != JobState.FINISHED or end.result is None:
        raise click.ClickException(f"the retried run ended {end.state}: {end.error}")
    return {
        "killed_at_tokens": late.progress.processed,
        "checkpoint_at_kill_tokens": hint.tokens if hint else 0,
        "retry_resumed_from_tokens": resumed_from(home, job.id),
        "retry_placement": end.placement.reason if end.placement else None,
        "retry_prefill_s": end.result.prefill_s,
        "retry_kill_to_finished_s": end.updated_at - killed_at,
    }


def ratios(result: dict) -> dict[str, float]:
    """Resumed retry over the restart from zero (the goal: at most 0.3), and over the
    uninterrupted job (prefill) / its submit-to-finished (kill to finished)."""
    return {
        "resume_vs_restart_prefill_ratio": result["retry_prefill_s"]
        / result["restart_retry_prefill_s"],
        "resume_vs_restart_kill_to_finished_ratio": result["retry_kill_to_finished_s"]
        / result["restart_retry_kill_to_finished_s"],
        "retry_prefill_ratio": result["retry_prefill_s"] / result["uninterrupted_prefill_s"],
        "retry_end_to_end_ratio": result["retry_kill_to_finished_s"]
        / result["uninterrupted_submit_to_finished_s"],
    }


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--repeat", default=400, show_default=True, help="Sentences in the document.")
@click.option("--every", "every_tokens", default=1024, show_default=True)
@click.option("--kill-at", "kill_share", default=0.85, show_default=True)
@click.option("--nodes", default=2, show_default=True, help="Node agents (1 on a one-GPU host).")
@click.option("--out", type=click.Path(path_type=Path), help="The JSON (default: bench/results).")
def main(
    model: str, repeat: int, every_tokens: int, kill_share: float, nodes: int, out: Path | None
) -> None:
    """Run the three jobs (see the module docstring) and write their JSON."""
    result = run_jobs(model, SENTENCE * repeat, every_tokens, kill_share, nodes)
    result.update(ratios(result))
    result.update(
        model=model,
        checkpoint_tokens=every_tokens,
        kill_share=kill_share,
        nodes=nodes,
        load_avg_1m=os.getloadavg()[0],
        when=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
    out = out or OUT / f"resume-{model.replace(':', '-')}-{result['prompt_tokens']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    click.echo(json.dumps(result, indent=1))
    click.echo(f"written: {out}")


if __name__ == "__main__":
    main()
