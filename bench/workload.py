"""The user's whole batch, measured: a fixed, seeded workload that stands for the mission, run at
default settings through ringq's OpenAI Batch API and through the server an MLX user runs
instead, `mlx_lm.server`, on the same machine and weights in one run, with ringq's own engine
time for the same work as the floor.

    uv run python -m bench.workload --scale cpu                  # SmolLM2, 6 documents
    python -m bench.workload --scale gpu --peak-tflops 989       # 8B shape, >= 1M prompt tokens

The workload (`make_workload`): documents whose lengths are log-uniform over the scale's range,
windows of the demo document (cli/demo/document.md, tiled) at seeded offsets in the model's own
tokens. Every PREFILL_EVERY-th document (the 2nd, 7th, ...) is one plain prefill job (a
`{"custom_id", "kind": "prefill", "document"}` line; for the peer a one-token /v1/completions
request of the same text); every other gets 1-4 questions, each a chat completion of one user
message, the document then the question, so the questions on one document share its prefix.
Greedy; max_tokens per question drawn from the scale's range.

The sides, one after another (bench/workload_sides.py); the JSON is written after each, so a run
cut short keeps what it measured:
1. ringq: `ringq up` and `ringq serve` (an API key) in a temporary RINGQ_HOME, default settings;
   one warm-up chat completion, then the file uploaded and one batch created with the official
   `openai` client, polled until it ends. Makespan: batch created -> its last job finished (the
   job records); per request its latency from the batch's creation, wait, prefill, decode,
   cached tokens and batch size.
2. The floor, in this process: ringq's Engine prefills each document's shared prefix once and
   each request's rest, one BatchDecoder (ringq's default batch limit) decodes the questions.
3. mlx_lm.server on the same weights (what a rank computes with, written as an mlx-lm model
   dir), once per setting of the grid: one warm-up request, then every request in file order
   from a thread pool as large as its decode concurrency (the `openai` client, which retries
   connection errors); makespan: first request sent -> last answer. The best try is the peer.

MFU: the prompt FLOPs of the distinct work (each shared prefix once) by ModelShape's formula,
over the makespan and the card's dense peak (--peak-tflops; else the matmul probe's measure).
Writes bench/results/workload-<machine>.json; `identical_texts` compares greedy answers.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from bench.workload_plan import (
    RESULTS,
    SCALES,
    PeerSettings,
    make_workload,
    prompt_tokens_of,
)


def default_machine() -> str:
    """'h100' / 'h200' from the first GPU's name, else 'cpu'."""
    from ring_worker.engine.devices import gpu_name, visible_gpus

    gpus = visible_gpus()
    found = re.search(r"\b([A-Z]+\d+)\b", gpu_name(gpus[0])) if gpus else None
    return found.group(1).lower() if found else "cpu"


def load_average() -> dict[str, Any]:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"loadavg": os.getloadavg(), "uptime": uptime}


SIDES = ("ringq", "engine_floor", "mlx_lm_server")  # in the order they run


@click.command()
@click.option("--scale", type=click.Choice(sorted(SCALES)), default="cpu", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--machine", default=None, help="Names the result file (default: h100/h200/cpu).")
@click.option(
    "--peak-tflops",
    type=float,
    default=None,
    help="The card's dense bf16 peak (989 on an H100 SXM / H200); default: measured.",
)
@click.option(
    "--peer-grid",
    default=None,
    help="mlx_lm.server tries, 'decode,prompt,cache_size[,cache_bytes];...' "
    "(default: the scale's).",
)
@click.option(
    "--port-base",
    default=37500,
    show_default=True,
    help="RINGQ_RANK_PORT_BASE of the ringq cluster (apart from other clusters here).",
)
@click.option(
    "--sides",
    default=",".join(SIDES),
    show_default=True,
    help="Which sides run (a subset when a lent machine's time is short; the ratios then "
    "need the others from the same run).",
)
@click.option("--logs", type=click.Path(path_type=Path), default=None)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    scale: str,
    seed: int,
    machine: str | None,
    peak_tflops: float | None,
    peer_grid: str | None,
    port_base: int,
    sides: str,
    logs: Path | None,
    out: Path | None,
) -> None:
    from bench import workload_sides
    from bench.decode_throughput import git_commit
    from bench.workload_report import build_report, peak
    from cli.bench_machine import machine_info
    from jobs.model_catalog import resolve_model
    from jobs.settings import get_settings
    from jobs.tokenizer import load_tokenizer

    chosen = SCALES[scale]
    grid = [PeerSettings.parse(t) for t in (peer_grid or chosen.peer_grid).split(";") if t]
    tokenizer = load_tokenizer(resolve_model(chosen.model, allowed_dirs=None))
    requests = make_workload(chosen, tokenizer, seed)
    tokens = prompt_tokens_of(requests, chosen.model)
    context: dict[str, Any] = {
        "machine": machine or default_machine(),
        "commit": git_commit(),
        "command": " ".join(["python -m bench.workload", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine_info": machine_info(get_settings()),
        "scale": scale,
        "seed": seed,
        "model": chosen.model,
        "load_before": load_average(),
    }
    click.echo(
        f"workload: {len(requests)} requests, {sum(map(len, tokens.values()))} prompt tokens",
        err=True,
    )
    chosen_sides = set(sides.split(","))
    if unknown := chosen_sides - set(SIDES):
        raise click.BadParameter(f"unknown sides {sorted(unknown)}", param_hint="--sides")
    ran: dict[str, dict[str, Any]] = {k: {"error": "not run"} for k in SIDES}
    path = out or RESULTS / f"workload-{context['machine']}.json"

    def write() -> dict[str, Any]:  # after each side, so a run cut short keeps what it measured
        context["load_after"] = load_average()
        context["peak"] = context.get("peak") or peak(peak_tflops)
        report = build_report(context, requests, tokens, ran)
        path.write_text(json.dumps(report, indent=1))
        return report

    if "ringq" in chosen_sides:
        ran["ringq"] = workload_sides.run_ringq(requests, chosen.model, port_base, logs)
        click.echo(f"ringq: makespan {ran['ringq'].get('makespan_s')}", err=True)
        write()
    if "engine_floor" in chosen_sides:
        ran["engine_floor"] = workload_sides.engine_floor(requests, tokens, chosen.model)
        click.echo(f"engine floor: {ran['engine_floor'].get('seconds')}", err=True)
        write()
    if "mlx_lm_server" in chosen_sides:

        def partial(summary: dict[str, Any]) -> None:
            ran["mlx_lm_server"] = summary
            write()

        ran["mlx_lm_server"] = workload_sides.run_peer(requests, chosen.model, grid, logs, partial)
        best = ran["mlx_lm_server"].get("best") or {}
        click.echo(f"mlx_lm.server: best {best.get('makespan_s')}", err=True)
    report = write()
    shown = ("prompt_tokens", "distinct_prompt_tokens", "engine_floor_s", "ratio", "mfu")
    click.echo(json.dumps({k: report[k] for k in shown}, indent=1))
    click.echo(f"wrote {path}", err=True)


if __name__ == "__main__":
    from bench.decode_throughput import reexec_with_openblas

    reexec_with_openblas("bench.workload")  # the floor computes here, as a CPU rank does
    main()
