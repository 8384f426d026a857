"""Admission's per-rank memory estimate against measured `mx.get_peak_memory()` per rank.

Runs every (model, prompt length, layout) of the grid as a real local group (the same path as
`ringq run`), prefill only, and prints predicted / measured for the busiest rank. The goal is a
ratio in [1.00, 1.25] on every cell: never under (over-admission), not much over (waste).

    uv run python -m bench.calibrate_admission --json-out bench/results/admission-calibration.json
    uv run python -m bench.calibrate_admission --table bench/results/admission-calibration.json

`--table` prints the table again from stored measurements with the current estimator (for fitting
its constants without re-measuring).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

from admission.estimate import KVLayout, Layout, Strategy, estimate_node_bytes
from admission.group_plan import default_chunk_tokens
from cli.bench import build_prompts
from jobs.model_catalog import default_dtype, read_model_shape, resolve_model
from jobs.schemas import JobKind, JobSpec
from jobs.settings import get_settings
from ring_worker.runtime.local_group import run_local

MIB = 1024**2
LAYOUTS = [
    Layout("single"),
    Layout("ring", 2),
    Layout("ring", 2, "sharded"),
    Layout("pipeline", 2),
    Layout("ring", 3),
    Layout("ring", 3, "sharded"),
    Layout("pipeline", 3),
]


def measure(model: str, pp: int, layout: Layout, chunk_tokens: int, scratch: Path) -> list[int]:
    tokens = build_prompts(model, [pp], 0, None)[pp]
    spec = JobSpec(
        kind=JobKind.PREFILL,
        document=f"calibration prompt of {pp} tokens",
        model=model,
        ranks=layout.size,
        strategy=layout.strategy,
    )
    result = run_local(
        f"calibrate-{layout.strategy}-{layout.size}",
        spec,
        tokens,
        layout.size,
        chunk_tokens,
        scratch_root=scratch,
        strategy=layout.strategy,
        kv_layout=layout.kv_layout,
        blas=get_settings().blas,
        timeout_s=900,
    )
    return result.peak_memory_bytes


def parse_layout(label: str) -> Layout:
    if label == "single":
        return Layout("single")
    strategy, size = label.split()[0].split("-")
    kv_layout = "sharded" if "sharded" in label else "replicated"
    return Layout(cast(Strategy, strategy), int(size), cast(KVLayout, kv_layout))


def predict(
    model: str,
    pp: int,
    layout: Layout,
    chunk_tokens: int,
    gpu: bool = False,
    checkpoint_tokens: int = 0,
) -> int:
    """CPU ranks compute in float32 on dense weights; GPU ranks in the model's own dtype.
    `checkpoint_tokens`: the interval the cells ran with (the CPU table predates checkpoints)."""
    source = resolve_model(model, allowed_dirs=None)
    shape = read_model_shape(source, dtype=default_dtype(source) if gpu else "float32")
    return estimate_node_bytes(
        shape, pp, 0, layout, chunk_tokens, dense_weights=not gpu,
        checkpoint_tokens=checkpoint_tokens,
    ).mlx_peak_bytes  # fmt: skip


def print_row(model: str, pp: int, label: str, predicted: int, peaks: list[int]) -> float:
    ratio = predicted / max(peaks)
    measured = " / ".join(f"{p / MIB:.1f}" for p in peaks)
    row = f"| {model} | {pp} | {label} | {predicted / MIB:.1f} | {measured} | {ratio:.2f} |"
    print(row, flush=True)
    return ratio


def print_table(path: Path) -> int:
    report = json.loads(path.read_text())
    print(HEADER)
    ratios = [
        print_row(
            cell["model"],
            cell["pp"],
            cell["layout"],
            predict(
                cell["model"],
                cell["pp"],
                parse_layout(cell["layout"]),
                report["chunk_tokens"],
                report.get("gpu", False),
                report.get("checkpoint_tokens", 0),
            ),
            cell["measured_bytes"],
        )
        for cell in report["cells"]
    ]
    inside = sum(1.0 <= r <= 1.25 for r in ratios)
    print(
        f"\n{inside} of {len(ratios)} cells inside [1.00, 1.25]; "
        f"ratios {min(ratios):.2f}-{max(ratios):.2f}"
    )
    return 0


HEADER = (
    "| model | pp | layout | predicted MiB | measured MiB per rank | predicted / measured |\n"
    "|---|---:|---|---:|---:|---:|"
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table", type=Path, help="reprint a stored calibration and stop")
    parser.add_argument("--models", default="random:tiny-llama,smollm2")
    parser.add_argument("--pp", default="512,1024,2048,4096")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: the device's")
    parser.add_argument("--layouts", default=None, help="labels to run, e.g. single,ring-2")
    parser.add_argument("--gpu", action="store_true", help="GPU ranks (model dtype, fused SDPA)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.table:
        return print_table(args.table)
    args.chunk_tokens = args.chunk_tokens or default_chunk_tokens("cuda" if args.gpu else "cpu")
    layouts = [
        layout
        for layout in LAYOUTS
        if args.layouts is None or layout.label.split()[0] in args.layouts.split(",")
    ]
    checkpoint_tokens = get_settings().checkpoint_tokens  # what the ranks run with
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="calibrate-"))
    print(HEADER, flush=True)
    for model in args.models.split(","):
        for pp in (int(p) for p in args.pp.split(",")):
            for layout in layouts:
                started = time.perf_counter()
                peaks = measure(model, pp, layout, args.chunk_tokens, scratch)
                rows.append(
                    {
                        "model": model,
                        "pp": pp,
                        "layout": layout.label,
                        "measured_bytes": peaks,
                        "seconds": time.perf_counter() - started,
                    }
                )
                predicted = predict(
                    model, pp, layout, args.chunk_tokens, args.gpu, checkpoint_tokens
                )
                print_row(model, pp, layout.label, predicted, peaks)
    if args.json_out:
        config = {
            "chunk_tokens": args.chunk_tokens,
            "gpu": args.gpu,
            "checkpoint_tokens": checkpoint_tokens,
            "command": " ".join(sys.argv),
        }
        args.json_out.write_text(json.dumps({**config, "cells": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
