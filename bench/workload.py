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

The sides, one after another (bench/workload_sides.py):
1. ringq: `ringq up` and `ringq serve` (an API key) in a temporary RINGQ_HOME, default settings;
   one warm-up chat completion, then the file uploaded and one batch created with the official
   `openai` client, polled until it ends. Makespan: batch created -> its last job finished (the
   job records); per request its latency from the batch's creation, wait, prefill, decode,
   cached tokens and batch size.
2. mlx_lm.server on the same weights (what a rank computes with, written as an mlx-lm model
   dir), once per setting of the grid: one warm-up request, then every request in file order
   from a thread pool as large as its decode concurrency (the `openai` client, which retries
   connection errors); makespan: first request sent -> last answer. The best try is the peer.
3. The floor, in this process: ringq's Engine prefills each document's shared prefix once and
   each request's rest, one BatchDecoder (ringq's default batch limit) decodes the questions.

MFU: the prompt FLOPs of the distinct work (each shared prefix once) by ModelShape's formula,
over the makespan and the card's dense peak (--peak-tflops; else the matmul probe's measure).
Writes bench/results/workload-<machine>.json; `identical_texts` compares greedy answers.
"""

import json
import math
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import click

RESULTS = Path(__file__).parent / "results"
PREFILL_EVERY = 5  # documents 1, 6, 11, ... are plain prefill jobs
QUESTIONS = (
    "Summarise the passage above in three sentences.",
    "Who is named in the passage above, and what did each of them do?",
    "Why was the reef dangerous to ships?",
    "What materials were the towers built from, according to the passage?",
    "List the dates mentioned above in order, with what happened on each.",
    "What went wrong with the earlier towers?",
    "Explain in plain words how the last tower was built.",
    "Which sentence above surprised you most, and why?",
)


@dataclass(frozen=True)
class PeerSettings:
    """One try of mlx_lm.server: its continuous-batching and prompt-cache flags."""

    decode_concurrency: int
    prompt_concurrency: int
    prompt_cache_size: int
    prompt_cache_bytes: str | None = None  # mlx-lm's size syntax, e.g. "24GB"

    @classmethod
    def parse(cls, text: str) -> "PeerSettings":
        """'decode,prompt,cache_size[,cache_bytes]', e.g. '32,8,10' (mlx_lm.server's defaults)."""
        parts = [p.strip() for p in text.split(",")]
        if not 3 <= len(parts) <= 4:
            raise click.BadParameter(f"{text!r}: want decode,prompt,cache_size[,cache_bytes]")
        return cls(int(parts[0]), int(parts[1]), int(parts[2]), parts[3] if parts[3:] else None)

    def flags(self) -> list[str]:
        found = [
            "--decode-concurrency",
            str(self.decode_concurrency),
            "--prompt-concurrency",
            str(self.prompt_concurrency),
            "--prompt-cache-size",
            str(self.prompt_cache_size),
        ]
        return found + (
            ["--prompt-cache-bytes", self.prompt_cache_bytes] if self.prompt_cache_bytes else []
        )


@dataclass(frozen=True)
class Scale:
    model: str
    documents: int | None  # None: as many as reach min_prompt_tokens
    doc_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    peer_grid: str  # PeerSettings, ';'-separated
    min_prompt_tokens: int = 0


SCALES = {
    "tiny": Scale("smollm2", 3, (40, 160), (4, 4), "4,2,10"),  # the test's
    # mlx_lm.server's defaults, then prompts prefilled one at a time (its batched prefill pads
    # every prompt to the longest)
    "cpu": Scale("smollm2", 6, (600, 6000), (32, 32), "32,8,10;8,1,10"),
    "gpu": Scale(
        "random:llama-3.1-8b",
        None,
        (4096, 130_000),  # 128K context less the template, a question and 256 answer tokens
        (32, 256),
        # not its defaults: 32 rows, 8 prompts prefilled together and 10 kept prompts, at up to
        # 17 GB of KV a 128K-token prompt, do not fit beside 16 GB of weights on an 80 GB card
        "8,1,10,8GB;4,1,10,8GB",
        min_prompt_tokens=1_000_000,
    ),
}


@dataclass(frozen=True)
class Request:
    custom_id: str
    document: int
    kind: str  # "generate" | "prefill"
    text: str  # a question's one user message (document, then question), or a prefill's document
    max_tokens: int  # a prefill's: 1 (the peer's one-token completion)

    def batch_line(self, model: str) -> dict[str, Any]:
        if self.kind == "prefill":
            return {
                "custom_id": self.custom_id,
                "kind": "prefill",
                "document": self.text,
                "model": model,
            }
        body = {
            "model": model,
            "messages": [{"role": "user", "content": self.text}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        return {
            "custom_id": self.custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }


def make_workload(scale: Scale, tokenizer: Any, seed: int) -> list[Request]:
    """The seeded requests, documents in order, each document's questions together."""
    rng = random.Random(seed)
    ids = tokenizer.encode(
        files("cli").joinpath("demo/document.md").read_text(), add_special_tokens=False
    )
    low, high = scale.doc_tokens
    requests: list[Request] = []
    prompt_tokens = index = 0
    while index < (scale.documents or sys.maxsize) and (
        scale.documents or prompt_tokens < scale.min_prompt_tokens
    ):
        length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        start = rng.randrange(len(ids))
        tiled = ids * (2 + (start + length) // len(ids))
        document = f"Document {index}.\n" + tokenizer.decode(tiled[start : start + length]).strip()
        if index % PREFILL_EVERY == 1:
            requests.append(Request(f"doc{index}-prefill", index, "prefill", document, 1))
            prompt_tokens += length
        else:
            for number, question in enumerate(rng.sample(QUESTIONS, rng.randint(1, 4))):
                answer = rng.randint(*scale.output_tokens)
                text = f"{document}\n\n{question}"
                requests.append(Request(f"doc{index}-q{number}", index, "generate", text, answer))
                prompt_tokens += length
        index += 1
    return requests


def prompt_tokens_of(requests: list[Request], model: str) -> dict[str, list[int]]:
    """Each request's prompt as ringq tokenizes it (jobs.prompts: the chat template over the one
    user message; a prefill's document as it is)."""
    from jobs.model_catalog import resolve_model
    from jobs.prompts import prompt_tokens
    from jobs.schemas import JobKind, JobSpec

    source = resolve_model(model, allowed_dirs=None)
    found = {}
    for request in requests:
        kind = JobKind.PREFILL if request.kind == "prefill" else JobKind.GENERATE
        spec = JobSpec(kind=kind, document=request.text, prompt="", model=model)
        found[request.custom_id] = prompt_tokens(spec, source)
    return found


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (0 for one prompt), leaving each at least one of its own."""
    if len(prompts) < 2:
        return 0
    common = 0
    for column in zip(*prompts, strict=False):
        if any(token != column[0] for token in column):
            break
        common += 1
    return min(common, min(map(len, prompts)) - 1)


def prefill_ranges(requests: list[Request], tokens: dict[str, list[int]]) -> list[tuple[int, int]]:
    """The distinct prefill work: per document its shared prefix [0, P) once, then each request's
    rest [P, N)."""
    ranges = []
    for document in sorted({r.document for r in requests}):
        mine = [tokens[r.custom_id] for r in requests if r.document == document]
        common = shared_prefix(mine)
        ranges += [(0, common)] if common else []
        ranges += [(common, len(prompt)) for prompt in mine]
    return ranges


def default_machine() -> str:
    """'h100' / 'h200' from the first GPU's name, else 'cpu'."""
    from ring_worker.engine.devices import gpu_name, visible_gpus

    gpus = visible_gpus()
    found = re.search(r"\b([A-Z]+\d+)\b", gpu_name(gpus[0])) if gpus else None
    return found.group(1).lower() if found else "cpu"


def load_average() -> dict[str, Any]:
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"loadavg": os.getloadavg(), "uptime": uptime}


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
@click.option("--logs", type=click.Path(path_type=Path), default=None)
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    scale: str,
    seed: int,
    machine: str | None,
    peak_tflops: float | None,
    peer_grid: str | None,
    port_base: int,
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
    ringq = workload_sides.run_ringq(requests, chosen.model, port_base, logs)
    click.echo(f"ringq: makespan {ringq.get('makespan_s')}", err=True)
    peer = workload_sides.run_peer(requests, chosen.model, grid, logs)
    click.echo(f"mlx_lm.server: best {(peer.get('best') or {}).get('makespan_s')}", err=True)
    floor = workload_sides.engine_floor(requests, tokens, chosen.model)
    click.echo(f"engine floor: {floor.get('seconds')}", err=True)
    context["load_after"] = load_average()
    context["peak"] = peak(peak_tflops)
    sides = {"ringq": ringq, "mlx_lm_server": peer, "engine_floor": floor}
    report = build_report(context, requests, tokens, sides)
    path = out or RESULTS / f"workload-{report['machine']}.json"
    path.write_text(json.dumps(report, indent=1))
    shown = ("prompt_tokens", "distinct_prompt_tokens", "engine_floor_s", "ratio", "mfu")
    click.echo(json.dumps({k: report[k] for k in shown}, indent=1))
    click.echo(f"wrote {path}", err=True)


if __name__ == "__main__":
    from bench.decode_throughput import reexec_with_openblas

    reexec_with_openblas("bench.workload")  # the floor computes here, as a CPU rank does
    main()
