"""`ringq bench`: prompt and generation speed of every strategy cell, measured in one invocation.

Each run is a fresh `run_local` group (the same path as `ringq run`): rank processes start, load
the model, prefill exactly `pp` tokens (a real text tiled to length), then decode up to `tg`.
"""

import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from admission.group_plan import default_chunk_tokens
from cli.bench_machine import machine_info, mfu, probe_matmul_tflops
from cli.bench_plot import write_plot
from cli.bench_report import (
    STRATEGIES,
    Cell,
    CellFailed,
    parse_positive_ints,
    plan_cells,
    report_table,
    run_schedule,
    spread,
    summarize_all,
    tile_tokens,
)
from cli.common import echo_json, interrupt_on_sigterm
from cli.options import chunk_tokens_option, comma_list, layout_options
from jobs.errors import InvalidJobError, RingqError
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.schemas import JobKind, JobResult, JobSpec
from jobs.settings import Settings, get_settings
from jobs.tokenizer import ChatTokenizer, load_tokenizer
from ring_worker.engine.devices import node_backend
from ring_worker.runtime.local_group import LocalRunError, run_local
from ring_worker.runtime.processes import rank_environment, spawn_rank, wait_all

PROMPT_TEXT = Path(__file__).parent / "demo" / "document.md"
WIDE_COLUMNS = 160  # a table written to a file or pipe is not cut to 80 columns


@click.command()
@click.option("--model", default=None, help="Model name (smollm2), GGUF file or HF/MLX dir.")
@click.option(
    "--pp",
    "pp_list",
    default="512,1024,2048",
    show_default=True,
    callback=comma_list(parse_positive_ints),
    help="Prompt lengths in tokens, comma-separated.",
)
@click.option(
    "--tg", type=click.IntRange(0, 32768), default=16, show_default=True, help="Tokens to decode."
)
@layout_options(many=True, strategies=STRATEGIES)
@click.option(
    "--warmup",
    type=click.IntRange(0),
    default=1,
    show_default=True,
    help="Unmeasured runs per cell.",
)
@click.option(
    "--repeat", type=click.IntRange(1), default=3, show_default=True, help="Measured runs per cell."
)
@chunk_tokens_option
@click.option(
    "--timeout-s",
    type=click.FloatRange(min=1),
    default=1800.0,
    show_default=True,
    help="Limit per run; a run past it fails its cell.",
)
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON report here.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a PNG of prompt tok/s against pp here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report instead of a table.")
def bench(
    model,
    pp_list,
    tg,
    strategies,
    ranks,
    exchanges,
    kv_layouts,
    warmup,
    repeat,
    chunk_tokens,
    timeout_s,
    json_out,
    plot,
    as_json,
):
    """Prompt (pp) and generation (tg) tok/s of every strategy cell, with ratios to `single`.

    Cells are pp x strategy (x exchange x kv-layout for ring); each runs --warmup + --repeat
    times on local rank processes. A cell that fails is reported with its reason; the exit code
    is 1 only when every cell failed.
    """
    interrupt_on_sigterm()
    settings = get_settings()
    config = {
        "model": model or settings.default_model,
        "pp": pp_list,
        "tg": tg,
        "strategy": strategies,
        "ranks": ranks,
        "exchange": exchanges,
        "kv_layout": kv_layouts,
        "decode_kv": kv_layouts,  # deprecated: kv_layout's old name, for older readers
        "warmup": warmup,
        "repeat": repeat,
        "chunk_tokens": chunk_tokens
        or settings.prefill_chunk_tokens
        or default_chunk_tokens(node_backend(settings.backend)),
        "timeout_s": timeout_s,
    }
    prompts = build_prompts(config["model"], pp_list, tg, settings.allowed_dirs)
    report = measure(config, prompts, settings)
    write_outputs(report, json_out, plot)
    if as_json:
        echo_json(report)
    else:
        print_report(Console(width=None if sys.stdout.isatty() else WIDE_COLUMNS), report)
    if not any(cell["status"] == "ok" for cell in report["cells"]):
        raise RingqError("every cell failed (reasons above / in the report)")


def measure(
    config: dict[str, Any], prompts: dict[int, list[int]], settings: Settings
) -> dict[str, Any]:
    """Run every cell of `config`; the report (command, date, machine, config, cells)."""
    cells = plan_cells(
        config["pp"],
        config["strategy"],
        config["ranks"],
        config["exchange"],
        config["kv_layout"],
    )
    report: dict[str, Any] = {
        "command": shlex.join(["ringq", *sys.argv[1:]]),
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {**machine_info(settings), "matmul_peak": probe_matmul_tflops(settings.blas)},
        "config": config,
    }
    started_s = time.perf_counter()
    scratch = settings.home / "bench" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    counter = iter(range(1, 1 << 30))

    def run_one(cell: Cell) -> JobResult:
        return run_cell(
            cell,
            config["model"],
            prompts[cell.pp_tokens],
            config,
            scratch / f"{next(counter):04d}",
            settings.blas,
        )

    total_runs = len(cells) * (config["warmup"] + config["repeat"])
    printer = progress_printer(Console(stderr=True, highlight=False), total_runs)
    load_samples: list[float] = []  # 1-minute load after each run: was the machine shared?

    def on_run(cell: Cell, tag: str, result: JobResult | None, error: str | None) -> None:
        load_samples.append(os.getloadavg()[0])
        printer(cell, tag, result, error)

    outcomes = run_schedule(cells, config["warmup"], config["repeat"], run_one, on_run)
    report["machine"]["load_avg_end"] = os.getloadavg()
    report["machine"]["load_avg_1m_after_runs"] = spread(load_samples) if load_samples else None
    report["wall_s"] = round(time.perf_counter() - started_s, 2)
    report["cells"] = summarize_all(outcomes)
    add_mfu(report, config["model"])
    if scratch.is_dir() and not any(scratch.iterdir()):
        scratch.rmdir()  # every run succeeded; failed runs keep their rank logs there
    return report


def add_mfu(report: dict[str, Any], model: str) -> None:
    """Model FLOPs utilisation of each cell's median prefill against the measured matmul peak."""
    peak = report["machine"].get("matmul_peak")
    shape = read_model_shape(resolve_model(model, allowed_dirs=None))  # build_prompts checked it
    for cell in report["cells"]:
        prefill = cell["prefill_s"]
        cell["mfu"] = (
            mfu(shape, cell["pp"], prefill["median"], cell["ranks"], peak["tflops"])
            if prefill and peak
            else None
        )


def build_prompts(
    model: str, pp_list: list[int], tg: int, allowed_dirs: Sequence[Path] | None
) -> dict[int, list[int]]:
    """Exactly pp tokens per prompt length: the demo document tiled, after the tokenizer's BOS."""
    source = resolve_model(model, allowed_dirs=allowed_dirs)
    context_tokens = read_model_shape(source).context_length
    if max(pp_list) + tg > context_tokens:
        raise InvalidJobError(
            f"--pp {max(pp_list)} + --tg {tg} tokens exceeds {model}'s context of "
            f"{context_tokens} tokens"
        )
    tokenizer: ChatTokenizer = load_tokenizer(source)
    prefix = tokenizer.encode("")  # the BOS, where the tokenizer adds one
    body = tokenizer.encode(PROMPT_TEXT.read_text().rstrip() + "\n\n", add_special_tokens=False)
    return {pp: (prefix + tile_tokens(body, pp))[:pp] for pp in pp_list}


def run_cell(
    cell: Cell, model: str, tokens: list[int], config: dict[str, Any], scratch: Path, blas: str
) -> JobResult:
    """One run of a cell on fresh local ranks; its scratch dir (rank logs) stays if it fails."""
    tg = config["tg"]
    if cell.strategy == "mlx-lm":
        return run_baseline(model, tokens, config, scratch, blas)
    spec = JobSpec(
        kind=JobKind.GENERATE if tg else JobKind.PREFILL,
        document=f"{PROMPT_TEXT.name} tiled to {len(tokens)} tokens",  # ranks read `tokens`
        model=model,
        max_tokens=max(tg, 1),
        temperature=0.0,
        ranks=cell.ranks,
        strategy=cell.strategy,
    )
    try:
        result = run_local(
            f"bench-{scratch.name}",
            spec,
            tokens,
            cell.ranks,
            config["chunk_tokens"],
            scratch_root=scratch,
            strategy=cell.strategy,
            exchange=cell.exchange,
            kv_layout=cell.kv_layout or "replicated",
            blas=blas,
            timeout_s=config["timeout_s"],
        )
    except LocalRunError as exc:
        raise CellFailed(str(exc)) from None
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def run_baseline(
    model: str, tokens: list[int], config: dict[str, Any], scratch: Path, blas: str
) -> JobResult:
    """Plain mlx-lm in one fresh process (ring_worker/engine/baseline.py), as a rank would run."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "tokens.json").write_text(json.dumps(tokens))
    out, log_path = scratch / "result.json", scratch / "baseline.log"
    argv = ["-m", "ring_worker.engine.baseline", "--model", model, "--tokens-file"]
    argv += [str(scratch / "tokens.json"), "--max-tokens", str(config["tg"])]
    argv += ["--chunk-tokens", str(config["chunk_tokens"]), "--out", str(out)]
    process = spawn_rank(argv, rank_environment(blas), log_path)
    codes = wait_all([process], timeout_s=config["timeout_s"])
    if codes != [0] or not out.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise CellFailed(f"mlx-lm baseline exited with {codes[0]}: {tail[0]} (log {log_path})")
    result = JobResult.model_validate_json(out.read_text())
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def progress_printer(console: Console, total_runs: int):
    done = iter(range(1, total_runs + 1))

    def on_run(cell: Cell, tag: str, result: JobResult | None, error: str | None) -> None:
        where = f"[{next(done, total_runs)}/{total_runs}] pp={cell.pp_tokens} {cell.label} {tag}"
        if result is None:
            console.print(f"{where}: [red]failed[/red]: {error}", soft_wrap=True)
        else:
            console.print(
                f"{where}: {result.prompt_tps:.1f} prompt tok/s, "
                f"{result.generation_tps:.1f} gen tok/s ({result.generated_tokens} tokens), "
                f"load {result.load_s:.2f} s",
                soft_wrap=True,
            )

    return on_run


def write_outputs(report: dict[str, Any], json_out: Path | None, plot: Path | None) -> None:
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
    if plot is not None:
        plot.parent.mkdir(parents=True, exist_ok=True)
        write_plot(report, plot)


def print_report(console: Console, report: dict[str, Any]) -> None:
    console.print(report_table(report))
    for cell in report["cells"]:
        if cell["error"]:
            console.print(
                f"[red]failed[/red] pp={cell['pp']} {cell['label']}: {cell['error']}",
                highlight=False,
            )
