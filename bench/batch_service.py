"""Continuous batching through the service (issue 14), side by side in one run: N generate jobs
submitted together to a one-node local cluster with RINGQ_MAX_BATCH=B, then the same N with
RINGQ_MAX_BATCH=1 (one job at a time).

    uv run python -m bench.batch_service --model smollm2 --jobs 16 --max-tokens 64

Both clusters run one group per node (RINGQ_NODE_MAX_GROUPS=1: "one at a time" is one group,
not two sharing the cores), prefix reuse as --prefix-cache says (default on, the service's
default: the documents share no prefix, so each job's prompt KV is written to disk and nothing
is reused; off: nothing is kept), and a warm group: one
warm-up job loads the model before the N are submitted, so loading is not timed. Documents are
distinct windows of about --doc-tokens tokens of the model's own tokenizer over the demo
document (tiled where it is shorter: a byte-level random model needs ~4x the characters of
SmolLM2), each job a different length; `doc_tokens` in the JSON says what they came to.

Per run: makespan (submit of the N -> the last one finished), end-to-end generated tok/s over
the makespan, decode tok/s = generated tokens / the group's time not spent prefilling
(makespan - the jobs' prefill_s summed: one group does one or the other, in both runs), per-job
latency (submit -> finished) percentiles, and each job's batch_size. `decode_union_s` is the
union of the jobs' [finished - decode_s, finished] (a batched job's decode_s counts from when
it joined, through the prefills of the jobs joining after it). Starvation (issue 14: no job's
submit -> finished over 1.5x what it takes one at a time behind the same queue order):
`latency_ratio` is each job's batched latency / what it takes one at a time behind the same
queue order: the one-at-a-time run's service times (prefill start -> finished), summed in queue
order up to it. One at a time, waiting jobs retry admission every RINGQ_ADMIT_RETRY_S, so they
need not run in queue order; the sum is what they take in order, and it leaves out the gaps
between jobs, so it is the stricter reference (the measured `latencies_s` of both runs are in
the JSON).

With --rounds R each run submits R bursts of other documents, each once the last has finished:
the batched group's first burst is a fresh group's, the later ones a warm group's (its join
budget has measured its steps). `bursts` compares each burst with the same burst one at a time,
and also against each job's median service time one at a time over the R bursts
(`worst_latency_median_reference`): one burst's reference for job 0 is a single sample. The
top-level `batched`, `one_at_a_time`, `ratio` and `latency_ratio` are the first burst's. With
--mlx-lm, mlx-lm's `batch_generate` then runs the same prompt tokens (the
service's, read from its store) in this process at its defaults: its wall time against the
batched run's makespan is the end-to-end ratio. With --logs, each run's service and rank logs
(a batch's time breakdown is one line of rank 0's log when it empties) are copied there. The
JSON also records the commit, the machine and the load before and after. Writes
bench/results/batch-service-<model>.json (or --out).
"""

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path

import click

from bench.decode_throughput import mlx_lm_batch
from cli.bench_machine import machine_info
from jobs.lifecycle import JobState
from jobs.model_catalog import resolve_model
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.settings import get_settings
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id, submit_job
from jobs.tokenizer import ChatTokenizer, load_tokenizer
from tests.helpers import private_cluster

RESULTS = Path(__file__).parent / "results"
STRIDE_TOKENS = 211  # where each document's window starts, after the previous one's
STARVATION_GOAL = 1.5  # issue 14: batched latency / one at a time, per job, at most


def documents(
    tokenizer: ChatTokenizer, count: int, tokens: int, rounds: int = 1
) -> list[list[str]]:
    """`rounds` bursts of `count` distinct texts of about `tokens` tokens (each a few shorter
    than the last; the k-th of every burst as long as the k-th of the first, and no text
    repeated: a repeated document's KV would be reused)."""
    text = " ".join(files("cli").joinpath("demo/document.md").read_text().split())
    ids = tokenizer.encode(text, add_special_tokens=False)
    needed = STRIDE_TOKENS * count * rounds + tokens
    ids = ids * -(-needed // len(ids))  # tiled: a byte-level model's tokens are characters
    bursts = []
    for burst in range(rounds):
        found = []
        for i in range(count):
            start = (burst * count + i) * STRIDE_TOKENS
            window = ids[start : start + tokens - 8 * (i % 5)]
            found.append(f"Document {burst * count + i}. " + tokenizer.decode(window))
        bursts.append(found)
    return bursts


def spec(model: str, document: str, max_tokens: int) -> JobSpec:
    return JobSpec(
        kind=JobKind.GENERATE,
        document=document,
        model=model,
        max_tokens=max_tokens,
        prompt="Summarise the document.",
        strategy="single",
    )


def specs(model: str, docs: Sequence[str], max_tokens: int) -> list[tuple[str, JobSpec]]:
    return [(new_job_id(), spec(model, d, max_tokens)) for d in docs]


def wait_final(store: JobStore, job_id: str) -> JobRecord:
    while not (record := store.get(job_id)).state.is_final:
        time.sleep(0.05)
    assert record.state == JobState.FINISHED, record.error
    return record


def run(
    model: str,
    bursts: list[list[str]],
    max_tokens: int,
    max_batch: int,
    port: int,
    prefix_cache: str,
    logs: Path | None,
) -> tuple[list[dict], list[list[int]]]:
    """Each burst's summary (a burst is submitted once the one before has finished, to the same
    warm group), and the first burst's prompt tokens as the service tokenized them."""
    env = {
        "RINGQ_MAX_BATCH": str(max_batch),
        "RINGQ_NODE_MAX_GROUPS": "1",
        "RINGQ_PREFIX_CACHE": prefix_cache,
        "RINGQ_GROUP_IDLE_S": "120",
        "RINGQ_RANK_PORT_BASE": str(port),
    }
    summaries: list[dict] = []
    prompts: list[list[int]] = []
    with private_cluster(f"bsb{max_batch}", env, node_count=1) as cluster:
        store = JobStore(connect(cluster.url))
        wait_final(store, submit_job(store.conn, spec(model, "Warm up. " * 20, 4)).id)
        for docs in bursts:
            submitted = time.time()
            jobs = enqueue_jobs(store.conn, specs(model, docs, max_tokens))
            records = [wait_final(store, job.id) for job in jobs]
            summaries.append(summary(records, submitted, max_batch))
            print(json.dumps({k: v for k, v in summaries[-1].items() if k != "texts"}), flush=True)
            prompts = prompts or [store.get_tokens(job.id) for job in jobs]
        if logs is not None:
            shutil.copytree(cluster.settings.home / "logs", logs, dirs_exist_ok=True)
    return summaries, prompts


def summary(records: list[JobRecord], submitted: float, max_batch: int) -> dict:
    results = [r.result for r in records]
    assert all(result is not None for result in results)
    generated = sum(r.result.generated_tokens for r in records if r.result)
    ends = [r.updated_at for r in records]
    decoding = [(r.updated_at - r.result.decode_s, r.updated_at) for r in records if r.result]
    in_order = [end - submitted for end in ends]  # queue order: the order they were enqueued
    latencies = sorted(in_order)
    makespan = max(ends) - submitted
    prefill_s = sum(r.result.prefill_s for r in records if r.result)
    service_s = [r.updated_at - (r.result.prefill_started_at or r.created_at) for r in records
                 if r.result]  # fmt: skip
    return {
        "max_batch": max_batch,
        "jobs": len(records),
        "generated_tokens": generated,
        "makespan_s": makespan,
        "end_to_end_tok_s": generated / makespan,
        "decode_union_s": union_s(decoding),
        "prefill_s_sum": prefill_s,
        "group_decode_s": makespan - prefill_s,
        "decode_tok_s": generated / (makespan - prefill_s),
        "latency_s": {
            "p50": statistics.median(latencies),
            "p90": latencies[int(0.9 * (len(latencies) - 1))],
            "max": latencies[-1],
        },
        "latencies_s": in_order,
        "service_s": service_s,
        "batch_sizes": [r.result.batch_size for r in records if r.result],
        "texts": [r.result.text for r in records if r.result],
    }


def latency_ratio(batched_s: list[float], alone_service_s: list[float]) -> dict:
    """Each job's batched latency over what it takes one at a time behind the same queue
    order: the one-at-a-time service times summed in queue order up to it."""
    behind = [sum(alone_service_s[: i + 1]) for i in range(len(alone_service_s))]
    per_job = [b / a for b, a in zip(batched_s, behind, strict=True)]
    return {
        "alone_in_queue_order_s": behind,
        "per_job": per_job,
        "max": max(per_job),
        "goal_max": STARVATION_GOAL,
        "goal_met": max(per_job) <= STARVATION_GOAL,
    }


def by_job(alone: list[dict]) -> list[tuple[float, ...]]:
    """The k-th job's service times one at a time, one per burst (the k-th document of each
    burst is as long)."""
    return list(zip(*(burst["service_s"] for burst in alone), strict=True))


def median_service_s(alone: list[dict]) -> list[float]:
    """The k-th job's service time one at a time: its median over the bursts. One burst's
    times alone spread widely (an H200's 1st-99th percentiles 1.54-2.30 s around 1.75,
    bench/results/batch-decode.md), and a job's reference is one of them."""
    return [statistics.median(times) for times in by_job(alone)]


def compare(batched: dict, alone: dict, reference_s: list[float]) -> dict:
    """One burst batched against the same burst one at a time, and against `reference_s`."""
    # a random model's byte-level tokenizer decodes its tokens past 255 to nothing: an empty
    # pair compares nothing (the H200 runs' "32 of 32 identical" before 2026-12-05 were such)
    pairs = [(a, b) for a, b in zip(batched["texts"], alone["texts"], strict=True) if a or b]
    by_median = latency_ratio(batched["latencies_s"], reference_s)
    return {
        "decode_tok_s": batched["decode_tok_s"] / alone["decode_tok_s"],
        "makespan": alone["makespan_s"] / batched["makespan_s"],
        "worst_latency": latency_ratio(batched["latencies_s"], alone["service_s"])["max"],
        "worst_latency_median_reference": by_median["max"],
        "worst_job_median_reference": by_median["per_job"].index(by_median["max"]),
        "identical_texts": sum(a == b for a, b in pairs),
        "compared_texts": len(pairs),
    }


def mlx_lm_end_to_end(model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """mlx-lm's batch_generate over the same prompt tokens, all in one batch, its prefill step
    its default, stopping at the model's EOS as the service does; the model is loaded as a
    rank loads it (ring_worker/engine/models.py), and neither the load nor a warm-up (two of the
    prompts, 2 tokens: on a GPU its first call compiles kernels) is timed, as the service's
    warm group is warm."""
    from ring_worker.engine.models import load_for_this_device

    resolved = resolve_model(model, allowed_dirs=None)
    loaded, tokenizer = load_for_this_device(resolved), load_tokenizer(resolved)
    mlx_lm_batch(loaded, prompts[:2], 2, tokenizer=tokenizer)  # its kernels compiled, untimed
    found = mlx_lm_batch(loaded, prompts, max_tokens, tokenizer=tokenizer)
    found["generated_tokens"] = sum(len(t) for t in found.pop("tokens"))
    return found


def union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def load_average() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--jobs", "count", default=16, show_default=True)
@click.option("--max-tokens", default=64, show_default=True)
@click.option("--doc-tokens", default=500, show_default=True)
@click.option("--max-batch", default=8, show_default=True)
@click.option("--port-base", default=36500, show_default=True)
@click.option("--prefix-cache", type=click.Choice(["on", "off"]), default="on", show_default=True)
@click.option("--mlx-lm", "with_mlx_lm", is_flag=True, help="Also time mlx-lm batch_generate.")
@click.option(
    "--rounds",
    default=1,
    show_default=True,
    help="Bursts of --jobs other documents each run submits, one after another, to its warm "
    "group: the batched group's first burst is a fresh group's, later ones a warm group's "
    "(its join budget knows its step times); each job's one-at-a-time reference is also the "
    "median over the bursts.",
)
@click.option("--logs", type=click.Path(path_type=Path), default=None)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    model: str,
    count: int,
    max_tokens: int,
    doc_tokens: int,
    max_batch: int,
    port_base: int,
    prefix_cache: str,
    with_mlx_lm: bool,
    rounds: int,
    logs: Path | None,
    out: Path | None,
) -> None:
    tokenizer = load_tokenizer(resolve_model(model, allowed_dirs=None))
    bursts = documents(tokenizer, count, doc_tokens, rounds)
    sizes = [len(tokenizer.encode(d, add_special_tokens=False)) for d in bursts[0]]
    report: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.batch_service", *sys.argv[1:]]),
        "machine": machine_info(get_settings()),  # its "source" is the commit
        "model": model,
        "doc_tokens": {"asked": doc_tokens, "min": min(sizes), "max": max(sizes)},
        "uptime_before": load_average(),
    }
    report["prefix_cache"] = prefix_cache
    report["rounds"] = rounds
    batch_logs, alone_logs = (None, None) if logs is None else (logs / "batched", logs / "alone")
    batched, prompts = run(
        model, bursts, max_tokens, max_batch, port_base, prefix_cache, batch_logs
    )
    alone, _ = run(model, bursts, max_tokens, 1, port_base + 100, prefix_cache, alone_logs)
    report["uptime_after"] = load_average()
    report["batched"], report["one_at_a_time"] = batched[0], alone[0]  # the first burst
    report["later_bursts"] = {"batched": batched[1:], "one_at_a_time": alone[1:]}
    reference_s = median_service_s(alone)
    report["reference_service_s"] = {
        "median": reference_s,
        "min": [min(times) for times in by_job(alone)],
        "max": [max(times) for times in by_job(alone)],
    }
    report["bursts"] = [compare(b, a, reference_s) for b, a in zip(batched, alone, strict=True)]
    first = ("decode_tok_s", "makespan", "identical_texts", "compared_texts")
    report["ratio"] = {k: report["bursts"][0][k] for k in first}
    report["latency_ratio"] = latency_ratio(batched[0]["latencies_s"], alone[0]["service_s"])
    if with_mlx_lm:
        report["mlx_lm_batch_generate"] = mlx_lm_end_to_end(model, prompts, max_tokens)
        report["ratio"]["end_to_end_vs_mlx_lm"] = (
            report["mlx_lm_batch_generate"]["wall_s"] / batched[0]["makespan_s"]
        )
    name = model.replace("/", "_").replace(":", "_")
    path = out or RESULTS / f"batch-service-{name}.json"
    path.write_text(json.dumps(report, indent=1))
    shown = {k: report[k] for k in ("ratio", "bursts", "uptime_after")}
    shown["latency_ratio"] = {k: v for k, v in report["latency_ratio"].items() if k != "per_job"}
    print(json.dumps(shown, indent=1))


if __name__ == "__main__":
    main()
