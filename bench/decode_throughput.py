"""Batched decode (ring_worker/engine/batch_decode.py) against one sequence at a time and mlx-lm,
at the
engine level (one process, one device), side by side in one run.

    python -m bench.decode_throughput                      # CPU: SmolLM2, 8 x ~500 tokens x 64
    python -m bench.decode_throughput --model random:llama-3.1-8b --sequences 32 \
        --prompt-tokens 4096 --max-tokens 256 --chunk-tokens 4096   # one H200

1. Single sequence, same model and prompt, rounds alternated: mlx-lm's `generate_step`, the
   engine's `Engine.decode`, and a `BatchDecoder` holding one sequence. Decode tok/s counts the
   tokens after the first over the time from the first to the last (what every variant shares:
   prefill excluded). Our step is profiled: host time building a step's graph vs waiting for it.
2. N documents (lengths differ by a few tokens, so the batch runs the masked path), every one
   generating exactly max_tokens (no stop tokens), all queued at t = 0:
   - one at a time: prefill then `Engine.decode`, job after job;
   - batched: each job prefilled alone as it comes, then all decode together (`BatchDecoder`);
   - mlx-lm `batch_generate` (its `BatchGenerator`: batched prefill, then batched decode).
   Decode tok/s = generated tokens / decode seconds; end to end = all prefills + decodes;
   per-job latency percentiles (queued at 0 -> finished) and the worst ratio of a job's batched
   latency to its one-at-a-time latency in the same queue order.

Writes bench/results/batch-decode-<backend>.json (--out to change).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path
from typing import Any

from bench.paired_decode import paired_batch_blocks, paired_blocks
from ring_worker.runtime.processes import find_openblas, rank_environment

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    args = parse_args()
    reexec_with_openblas()

    from jobs.model_catalog import resolve_model
    from jobs.tokenizer import load_tokenizer
    from ring_worker.engine.devices import cap_device_memory
    from ring_worker.engine.models import load_for_this_device

    cap_device_memory()
    backend = backend_name()
    model = load_for_this_device(resolve_model(args.model, allowed_dirs=None))
    document = load_tokenizer(resolve_model(args.model, allowed_dirs=None)).encode(
        files("cli").joinpath("demo/document.md").read_text()
    )
    prompts = make_prompts(document, args.sequences, args.prompt_tokens, args.equal_lengths)
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m bench.decode_throughput", *sys.argv[1:]]),
        "machine": {
            "backend": backend,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "commit": git_commit(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    if args.part in ("all", "single"):
        report["single"] = bench_single(model, prompts[0], args)
        print(json.dumps(report["single"]["summary"], indent=1), flush=True)
    if args.part == "paired-batch":
        report["paired_batch"] = paired_batch_blocks(model, prompts, args)
        print(json.dumps(report["paired_batch"], indent=1), flush=True)
    if args.part in ("all", "batch"):
        report["batch"] = bench_batch(model, prompts, args)
        print(json.dumps(report["batch"]["summary"], indent=1), flush=True)
    out = args.out or RESULTS / f"batch-decode-{backend}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


def git_commit() -> str:
    """The commit that ran (cli.bench_machine.source_revision), "+dirty" when the tree differs."""
    from cli.bench_machine import source_revision

    revision = source_revision() or {"commit": "unknown", "dirty": False}
    commit = revision["commit"]
    return (commit[:7] if len(commit) == 40 else commit) + ("+dirty" if revision["dirty"] else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=512, help="prefill chunk (ours)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="single-sequence rounds (0: the paired blocks only)"
    )
    parser.add_argument("--part", choices=["all", "single", "batch", "paired-batch"], default="all")
    parser.add_argument("--skip-mlx-lm-batch", action="store_true")
    parser.add_argument(
        "--equal-lengths", action="store_true", help="all prompts alike long: no attention mask"
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def backend_name() -> str:
    """The MLX backend this process computes on: cuda, metal or cpu."""
    import mlx.core as mx

    return "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "cpu"


def reexec_with_openblas(module: str = "bench.decode_throughput") -> None:
    """On a CPU-only Linux node the ranks preload OpenBLAS (25-35x fp32 matmul); so does this
    (`module`: the bench to run again)."""
    import mlx.core as mx

    if mx.cuda.is_available() or mx.metal.is_available() or not find_openblas():
        return
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return
    argv = [sys.executable, "-m", module, *sys.argv[1:]]
    os.execve(sys.executable, argv, rank_environment())


def make_prompts(document: list[int], count: int, length: int, equal: bool) -> list[list[int]]:
    """`count` prompts of about `length` tokens, windows of the document (tiled) at different
    offsets; prompt i is 3 * i tokens shorter (unless `equal`), so rows differ in length and
    attention runs with a mask (without one when all rows have the same length)."""
    tiled = document * (2 + (length + count * 97) // len(document))
    return [tiled[i * 97 : i * 97 + length - (0 if equal else 3 * i)] for i in range(count)]


# -- 1. one sequence -----------------------------------------------------------------------


def bench_single(model: Any, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    if not args.rounds:  # the paired comparison only
        return {"summary": {"paired_blocks": paired_blocks(model, prompt, args)}}
    runs: dict[str, list[dict[str, float]]] = {"mlx_lm": [], "engine": [], "batch_of_1": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is dropped
        for name, fn in (
            ("mlx_lm", single_mlx_lm),
            ("engine", single_engine),
            ("batch_of_1", single_batch),
        ):
            run, tokens[name] = fn(model, prompt, args)
            runs[name].append(run)
            print(f"single {name}: {run}", file=sys.stderr, flush=True)
    kept = {name: rows[1:] for name, rows in runs.items()}
    tps = {name: statistics.median(r["decode_tps"] for r in rows) for name, rows in kept.items()}
    summary = {
        "decode_tps_median": tps,
        "engine_vs_mlx_lm": tps["engine"] / tps["mlx_lm"],
        "batch_of_1_vs_mlx_lm": tps["batch_of_1"] / tps["mlx_lm"],
        "same_tokens": tokens["mlx_lm"] == tokens["engine"] == tokens["batch_of_1"],
        "batch_of_1_profile_ms_per_step": {
            key: statistics.median(r[key] for r in kept["batch_of_1"])
            for key in ("build_ms", "dispatch_ms", "wait_ms", "read_ms")
        },
    }
    summary["paired_blocks"] = paired_blocks(model, prompt, args)
    return {"summary": summary, "runs": runs}


def rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def single_mlx_lm(model: Any, prompt: list[int], args: argparse.Namespace):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    stamps, tokens = [], []
    steps = generate_step(
        mx.array(prompt), model, max_tokens=args.max_tokens, prefill_step_size=args.chunk_tokens
    )
    for token, _ in steps:
        stamps.append(time.perf_counter())
        tokens.append(token)
    return {"decode_tps": rate(stamps)}, tokens


def single_engine(model: Any, prompt: list[int], args: argparse.Namespace):
    from ring_worker.engine.engines import Engine

    engine, stamps = Engine(model), []
    prefill = engine.prefill(prompt, args.chunk_tokens)
    decoded = engine.decode(
        prefill, args.max_tokens, on_progress=lambda *_: stamps.append(time.perf_counter())
    )
    return {"decode_tps": rate(stamps)}, decoded.tokens


def single_batch(model: Any, prompt: list[int], args: argparse.Namespace):
    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.engines import Engine

    engine, stamps = Engine(model), []
    prefill = engine.prefill(prompt, args.chunk_tokens)
    decoder = BatchDecoder(engine, max_batch=1)
    profile = profile_steps(decoder)
    request = DecodeRequest(
        "one", args.max_tokens, on_progress=lambda *_: stamps.append(time.perf_counter())
    )
    decoder.add(request, prefill)
    del prefill
    (result,) = decoder.run()
    steps = max(profile["steps"], 1)
    run = {"decode_tps": rate(stamps)}
    keys = ("build", "dispatch", "wait", "read")
    run.update({f"{key}_ms": 1e3 * profile[key] / steps for key in keys})
    return run, result.tokens


def profile_steps(decoder: Any) -> dict[str, float]:
    """Per step, host time: building the step's graph (Python and MLX graph construction, with
    async_eval held back), dispatching it (async_eval: on MLX's CPU backend this blocks while
    earlier work runs, so there it holds most of the step), waiting for the previous step's
    vote, and the rest (reading the vote, bookkeeping, callbacks)."""
    import mlx.core as mx

    totals = {"build": 0.0, "dispatch": 0.0, "wait": 0.0, "read": 0.0, "steps": 0.0}
    queue, step, run = decoder._queue_step, decoder.step, decoder.run

    def timed_queue() -> Any:
        real_async_eval = mx.async_eval
        mx.async_eval = lambda *_: None
        started = time.perf_counter()
        try:
            vote = queue()
        finally:
            mx.async_eval = real_async_eval
        built = time.perf_counter()
        mx.async_eval(vote)
        dispatched = time.perf_counter()
        mx.eval(decoder._vote)  # what step() would wait for in tolist()
        totals["build"] += built - started
        totals["dispatch"] += dispatched - built
        totals["wait"] += time.perf_counter() - dispatched
        return vote

    def timed_step() -> Any:
        started = time.perf_counter()
        done = step()
        totals["steps"] += 1
        totals["read"] += time.perf_counter() - started
        return done

    def timed_run() -> Any:
        out = run()
        totals["read"] -= totals["build"] + totals["dispatch"] + totals["wait"]
        return out

    decoder._queue_step, decoder.step, decoder.run = timed_queue, timed_step, timed_run
    return totals


# -- 2. many sequences ---------------------------------------------------------------------


def bench_batch(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    one = one_at_a_time(model, prompts, args)
    print(f"one at a time: decode {one['decode_s']:.1f} s", file=sys.stderr, flush=True)
    batched = batched_decode(model, prompts, args)
    print(f"batched: decode {batched['decode_s']:.1f} s", file=sys.stderr, flush=True)
    generated = args.max_tokens * len(prompts)
    summary: dict[str, Any] = {
        "sequences": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "decode_tps": {
            "one_at_a_time": generated / one["decode_s"],
            "batched": generated / batched["decode_s"],
        },
        "end_to_end_s": {"one_at_a_time": one["end_s"][-1], "batched": max(batched["end_s"])},
        "same_tokens": sum(a == b for a, b in zip(one["tokens"], batched["tokens"], strict=True)),
        "latency_s": {
            "one_at_a_time": percentiles(one["end_s"]),
            "batched": percentiles(batched["end_s"]),
        },
        "worst_latency_ratio": max(
            b / a for a, b in zip(one["end_s"], batched["end_s"], strict=True)
        ),
    }
    summary["decode_speedup"] = (
        summary["decode_tps"]["batched"] / summary["decode_tps"]["one_at_a_time"]
    )
    if not args.skip_mlx_lm_batch:
        summary["paired_blocks_vs_batch_generator"] = paired_batch_blocks(model, prompts, args)
        print(json.dumps(summary["paired_blocks_vs_batch_generator"]), file=sys.stderr, flush=True)
        mlx_lm = mlx_lm_batch(model, prompts, args.max_tokens, args.chunk_tokens)
        summary["mlx_lm_batch_generate"] = {k: v for k, v in mlx_lm.items() if k != "tokens"}
        summary["mlx_lm_same_tokens"] = sum(
            a == b for a, b in zip(one["tokens"], mlx_lm["tokens"], strict=True)
        )
        summary["batched_decode_vs_mlx_lm"] = (
            summary["decode_tps"]["batched"] / mlx_lm["decode_tps"]
        )
        summary["batched_end_to_end_vs_mlx_lm"] = (
            mlx_lm["wall_s"] / summary["end_to_end_s"]["batched"]
        )
    return {"summary": summary, "one_at_a_time": one, "batched": batched}


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": at(0.5), "p90": at(0.9), "max": ordered[-1]}


def one_at_a_time(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    from ring_worker.engine.engines import Engine

    engine = Engine(model)
    started = time.perf_counter()
    prefill_s = decode_s = 0.0
    end_s, tokens = [], []
    for prompt in prompts:
        prefill = engine.prefill(prompt, args.chunk_tokens)
        prefill_s += prefill.seconds
        decoded = engine.decode(prefill, args.max_tokens)
        del prefill
        decode_s += decoded.seconds
        end_s.append(time.perf_counter() - started)
        tokens.append(decoded.tokens)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "end_s": end_s, "tokens": tokens}


def batched_decode(
    model: Any, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """Every job is queued at 0; each is prefilled as it comes and joins at the next step (all
    are waiting, so all are prefilled before the first step: prefill first, as the service's
    warm group does while jobs wait)."""
    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.engines import Engine

    engine = Engine(model)
    decoder = BatchDecoder(engine, max_batch=len(prompts))
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        decoder.add(
            DecodeRequest(str(index), args.max_tokens), engine.prefill(prompt, args.chunk_tokens)
        )
    decode_started = time.perf_counter()
    end_s: dict[str, float] = {}
    results = {}
    while decoder.busy:
        for result in decoder.step():
            end_s[result.key] = time.perf_counter() - started
            results[result.key] = result
    keys = [str(i) for i in range(len(prompts))]
    return {
        "prefill_s": decode_started - started,
        "decode_s": time.perf_counter() - decode_started,
        "end_s": [end_s[k] for k in keys],
        "tokens": [results[k].tokens for k in keys],
        "batch_size": [results[k].batch_size for k in keys],
    }


class _NoTextTokenizer:
    """What mlx-lm's batch_generate needs of a tokenizer when no sequence may stop early."""

    eos_token_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return ""


def mlx_lm_batch(
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    chunk_tokens: int | None = None,
    tokenizer: Any = None,
    prefill_batch: int | None = None,
) -> dict[str, Any]:
    """mlx-lm's batch_generate, all prompts in one batch; `chunk_tokens` its prefill step (its
    default if None); `tokenizer` its stop tokens (default: none, every sequence runs to
    max_tokens); `prefill_batch` the prompts it prefills together (its default if None)."""
    from mlx_lm.generate import batch_generate

    options: dict[str, Any] = {}
    if chunk_tokens is not None:
        options["prefill_step_size"] = chunk_tokens
    if prefill_batch is not None:
        options["prefill_batch_size"] = prefill_batch
    started = time.perf_counter()
    response = batch_generate(
        model,
        tokenizer or _NoTextTokenizer(),
        prompts,
        max_tokens=max_tokens,
        completion_batch_size=len(prompts),
        return_token_ids=True,
        **options,
    )
    stats = response.stats
    return {
        "wall_s": time.perf_counter() - started,
        "prompt_tps": stats.prompt_tokens / stats.prompt_time if stats.prompt_time else 0.0,
        "decode_tps": stats.generation_tokens / stats.decode_time if stats.decode_time else 0.0,
        "decode_s": stats.decode_time,
        "prompt_s": stats.prompt_time,
        "peak_memory_gb": stats.peak_memory,
        "tokens": response.token_ids,
    }


if __name__ == "__main__":
    sys.exit(main())
