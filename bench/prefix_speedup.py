"""One document, many questions: automatic prefix reuse vs RINGQ_PREFIX_CACHE=off, side by side
in one run, with the answers checked to be identical.

    python -m bench.prefix_speedup                     # engine level: SmolLM2, CPU, demo doc x 8
    python -m bench.prefix_speedup --service           # the same as jobs through a local service
    python -m bench.prefix_speedup --service --model random:llama-3.1-8b --doc-tokens 130000 \
        --cache-bytes 40000000000 --out bench/results/prefix-reuse-service-h200.json
                                                     # one H200: a 128K document x 8 questions
    python -m bench.prefix_speedup --service --nodes 2 --first-ring 2 --kv-layout sharded
                                                     # the first on ring-2, the rest single
    python -m bench.prefix_speedup --service --nodes 2 --ranks 2   # every question on ring-2

Engine level runs the rank's own code path (jobs/prefix_index.py,
ring_worker/runtime/prefix_reuse.py,
a real Redis and real files), without the queue. Goal (issue 15): total with reuse <= 1.3 x (one
prefill + the 8 decodes), both measured with the cache off. Writes --out, by default
bench/results/prefix-reuse-<engine|service>-<model>[-ring<N>|-first-ring<N>].json, and never
over an existing file unless --out names it (the committed results and their commands:
bench/results/prefix-reuse.md).
"""

import json
import os
import platform
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import click

from bench.decode_throughput import git_commit
from bench.prefix_service import service_level
from jobs.model_catalog import resolve_model
from jobs.prefix_index import PrefixIndex, model_key
from jobs.redis_server import connect, ensure_redis
from jobs.settings import Settings
from jobs.tokenizer import load_tokenizer
from ring_worker.engine.engines import Engine
from ring_worker.engine.models import load_for_this_device
from ring_worker.runtime.cache_store import node_store
from ring_worker.runtime.prefix_reuse import RankPrefixCache, view_of
from ring_worker.runtime.processes import rank_environment

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    (files("cli") / "demo/question.txt").read_text().strip(),
    "Who built the first lighthouse on the Eddystone Rocks?",
    "How far is the reef from Plymouth?",
    "What material did John Smeaton use for his tower?",
    "Why was the reef so dangerous to ships?",
    "How many towers have stood on the Eddystone Rocks?",
    "What happened to Henry Winstanley?",
    "Which tower stands on the rock today?",
]


def prompts(tokenizer: Any, document: str, questions: list[str]) -> list[list[int]]:
    """As jobs/prompts.py builds a generate job's prompt: the document, then the question."""
    return [
        tokenizer.chat_tokens([{"role": "user", "content": f"{document.rstrip()}\n\n{q}"}])
        for q in questions
    ]


def answer_all(engine: Engine, cache: RankPrefixCache | None, all_tokens, max_tokens, chunk):
    rows = []
    started = time.perf_counter()
    for number, tokens in enumerate(all_tokens):
        if cache is None:
            prefill, reused = engine.prefill(tokens, chunk), None
        else:
            prefill, reused = cache.prefill(engine, tokens, chunk)
        decoded = engine.decode(prefill, max_tokens)
        kept_at = time.perf_counter()
        if cache is not None:
            cache.keep(engine, f"bench-{time.time_ns()}-{number}", tokens, prefill, reused)
        rows.append(
            {
                "prompt_tokens": len(tokens),
                "cached_tokens": reused.tokens if reused else 0,
                "prefill_s": prefill.seconds,
                "decode_s": decoded.seconds,
                "keep_s": time.perf_counter() - kept_at,
                "tokens": decoded.tokens,
            }
        )
    return rows, time.perf_counter() - started


def summary(off: list[dict], off_total_s: float, on: list[dict], on_total_s: float) -> dict:
    ideal_s = off[0]["prefill_s"] + sum(r["decode_s"] for r in off)
    return {
        "off_total_s": round(off_total_s, 3),
        "on_total_s": round(on_total_s, 3),
        "speedup": round(off_total_s / on_total_s, 2),
        "one_prefill_plus_decodes_s": round(ideal_s, 3),
        "on_over_ideal": round(on_total_s / ideal_s, 3),
        "goal_met": on_total_s <= 1.3 * ideal_s,
        "later_prefill_fraction": round(
            max(r["prefill_s"] for r in on[1:]) / on[0]["prefill_s"], 4
        ),
        "answers_identical": [answer_of(r) for r in on] == [answer_of(r) for r in off],
    }


def summary_on(on: list[dict], on_total_s: float) -> dict:
    """The reuse-on run alone: its makespan and its later questions' prefill share."""
    later = max(r["prefill_s"] for r in on[1:]) / on[0]["prefill_s"]
    return {"on_total_s": round(on_total_s, 3), "later_prefill_fraction": round(later, 4)}


def answer_of(row: dict) -> object:
    return row["tokens"] if "tokens" in row else row["text"]


def document_of(tokens: int) -> str:
    """The demo document; with `tokens`, repeated and cut to that many UTF-8 bytes (the random
    models' tokenizer is byte-level: one token a byte)."""
    text = (files("cli") / "demo/document.md").read_text()
    if not tokens:
        return text
    data = (text.encode() * (tokens // len(text.encode()) + 1))[:tokens]
    return data.decode(errors="ignore")


def engine_level(model: str, questions: int, max_tokens: int, chunk: int) -> dict:
    source = resolve_model(model, allowed_dirs=None)
    tokenizer = load_tokenizer(source)
    document = document_of(0)
    all_tokens = prompts(tokenizer, document, QUESTIONS[:questions])
    engine = Engine(load_for_this_device(source))
    with tempfile.TemporaryDirectory(prefix="ringq-bench-") as home:
        handle = ensure_redis(Settings(home=Path(home), redis_url=None))
        try:
            view = view_of(engine, "bench", "single", "replicated")
            store = node_store(Path(home), "bench", 10 * 1024**3)
            cache = RankPrefixCache(PrefixIndex(connect(handle.url)), store, view, model_key(model))
            engine.decode(engine.prefill(all_tokens[0][:64], chunk), 2)  # warm the kernels
            off, off_s = answer_all(engine, None, all_tokens, max_tokens, chunk)
            on, on_s = answer_all(engine, cache, all_tokens, max_tokens, chunk)
        finally:
            handle.stop()
    setup = {"mode": "engine", "model": model, "questions": questions, "max_tokens": max_tokens,
             "chunk_tokens": chunk}  # fmt: skip
    return {**setup, **summary(off, off_s, on, on_s), "off": off, "on": on}


def out_path(out: Path | None, mode: str, model: str, ranks: int, first_ring: int) -> Path:
    """--out as given; else a name of its own per mode, model and layout, never an existing
    file (a committed result is overwritten only when --out names it)."""
    if out is not None:
        return out
    name = f"prefix-reuse-{mode}-{model.replace('/', '_').replace(':', '_')}"
    name += f"-ring{ranks}" if ranks > 1 else f"-first-ring{first_ring}" if first_ring > 1 else ""
    path = RESULTS / f"{name}.json"
    if path.exists():
        raise click.BadParameter(f"{path} exists: pass --out to replace it or to write elsewhere")
    return path


def with_rank_environment() -> None:
    """Run as a rank runs (OpenBLAS preloaded on CPU-only Linux: fp32 matmul 25-35x faster):
    start this command again in that environment unless it already is."""
    env = rank_environment()
    if env.get("LD_PRELOAD", "") != os.environ.get("LD_PRELOAD", ""):
        os.execve(
            sys.executable, [sys.executable, "-m", "bench.prefix_speedup", *sys.argv[1:]], env
        )


def service_env(cache_bytes: int | None, kv_layout: str | None) -> dict[str, str]:
    env = {} if cache_bytes is None else {"RINGQ_CACHE_BYTES": str(cache_bytes)}
    return env if kv_layout is None else {**env, "RINGQ_KV_LAYOUT": kv_layout}


@click.command()
@click.option("--model", default="smollm2", show_default=True)
@click.option("--questions", default=8, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--chunk-tokens", default=512, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None)
@click.option("--service", is_flag=True, help="Jobs through a local cluster, not the engine.")
@click.option("--nodes", default=1, show_default=True, help="Service: node agents.")
@click.option("--doc-tokens", default=0, help="Service: a document of this many bytes (0: demo).")
@click.option("--cache-bytes", default=None, type=int, help="Service: RINGQ_CACHE_BYTES.")
@click.option(
    "--first-ring",
    default=1,
    show_default=True,
    help="Service: the first question on a ring of this many nodes, the rest single.",
)
@click.option(
    "--ranks",
    default=1,
    show_default=True,
    help="Service: every question on a ring of this many nodes (1: single).",
)
@click.option("--kv-layout", default=None, help="Service: RINGQ_KV_LAYOUT (e.g. sharded).")
@click.option("--timeout-s", default=1800.0, show_default=True)
@click.option(
    "--logs", type=click.Path(path_type=Path), default=None, help="Service: copy logs here."
)
@click.option(
    "--modes",
    type=click.Choice(["both", "on"]),
    default="both",
    show_default=True,
    help="Service: both runs, or only the one with reuse on (no comparison then).",
)
def main(
    model: str,
    questions: int,
    max_tokens: int,
    chunk_tokens: int,
    out: Path | None,
    service: bool,
    nodes: int,
    doc_tokens: int,
    cache_bytes: int | None,
    first_ring: int,
    ranks: int,
    kv_layout: str | None,
    timeout_s: float,
    logs: Path | None,
    modes: str,
) -> None:
    if max(first_ring, ranks) > nodes:
        ring = max(first_ring, ranks)
        raise click.BadParameter(f"a ring of {ring} needs --nodes {ring} or more")
    if ranks > 1 and first_ring > 1:
        raise click.BadParameter("--ranks puts every question on a ring: drop --first-ring")
    if (ranks > 1 or first_ring > 1) and not service:
        raise click.BadParameter("--ranks and --first-ring need --service")
    out = out_path(out, "service" if service else "engine", model, ranks, first_ring)
    started = {"command": " ".join(["python -m bench.prefix_speedup", *sys.argv[1:]]),
               "commit": git_commit(), "host": platform.node(),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "load_before": os.getloadavg()}  # fmt: skip
    if not service:
        with_rank_environment()
        result = engine_level(model, questions, max_tokens, chunk_tokens)
    else:
        env = service_env(cache_bytes, kv_layout)
        run_modes = ("off", "on") if modes == "both" else ("on",)
        runs = service_level(model, document_of(doc_tokens), QUESTIONS[:questions], max_tokens,
                             nodes, timeout_s, env, first_ring, ranks, logs, run_modes)  # fmt: skip
        setup = {"mode": "service", "model": model, "questions": questions, "nodes": nodes,
                 "first_ring": first_ring, "ranks": ranks, "env": env, "doc_tokens": doc_tokens,
                 "max_tokens": max_tokens}  # fmt: skip
        if modes == "both":
            summed = summary(runs["off"], runs["off_total_s"], runs["on"], runs["on_total_s"])
            result = {**setup, **summed, "off": runs["off"], "on": runs["on"]}
        else:
            result = {**setup, **summary_on(runs["on"], runs["on_total_s"]), "on": runs["on"]}
    result = {**started, "load_after": os.getloadavg(), **result}
    out.write_text(json.dumps(result, indent=1) + "\n")
    keys = ("off_total_s", "on_total_s", "speedup", "one_prefill_plus_decodes_s",
            "on_over_ideal", "goal_met", "later_prefill_fraction", "answers_identical")  # fmt: skip
    shown = [key for key in keys if key in result]
    for key in shown:
        click.echo(f"{key}: {result[key]}")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
