"""Pure parts of `ringq bench`: which cells to run, in what order, and what their runs add up to.

A cell is one (prompt length, strategy, ranks, exchange, KV layout). Every cell is measured in
the same invocation, so its ratios to the `single` and `mlx-lm` cells of the same prompt length
compare runs made under the same conditions."""

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from rich.table import Table

from admission import vocabulary
from admission.vocabulary import Exchange, KVLayout
from jobs.schemas import JobResult

STRATEGIES = ("single", "ring", "pipeline", "mlx-lm")
BASELINES = ("single", "mlx-lm")
EXCHANGES = vocabulary.EXCHANGES
KV_LAYOUTS = vocabulary.KV_LAYOUTS
MIB = 1024 * 1024

Strategy = vocabulary.Strategy | Literal["mlx-lm"]  # a cell: ringq's strategies or plain mlx-lm


@dataclass(frozen=True)
class Cell:
    pp_tokens: int
    strategy: Strategy
    ranks: int
    exchange: Exchange | None = None  # ring only
    kv_layout: KVLayout | None = None  # ring only

    @property
    def label(self) -> str:
        """The same for every prompt length: one line in the plot per label."""
        if self.strategy in BASELINES:
            return self.strategy
        if self.strategy == "pipeline":
            return f"pipeline-{self.ranks}"
        return f"ring-{self.ranks} {self.exchange}/{self.kv_layout}"


@dataclass
class CellOutcome:
    cell: Cell
    runs: list[JobResult] = field(default_factory=list)  # measured runs, warm-ups left out
    error: str | None = None  # why the cell failed; it is not run again once it has


def parse_positive_ints(text: str) -> list[int]:
    """'2048,4096' -> [2048, 4096]; ValueError naming the bad part."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} is not a positive integer (expected e.g. 512,1024)")
        values.append(int(part))
    return list(dict.fromkeys(values))


def parse_choices(text: str, choices: Sequence[str]) -> list[str]:
    """'ring,single' -> ['ring', 'single'], each one of `choices`; ValueError otherwise."""
    values = [part.strip() for part in text.split(",")]
    for value in values:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
    return list(dict.fromkeys(values))


def plan_cells(
    pp_list: Iterable[int],
    strategies: Iterable[str],
    ranks: int,
    exchanges: Iterable[str],
    kv_layouts: Iterable[str],
) -> list[Cell]:
    """The cartesian product, where exchange and KV layout apply only to ring cells."""
    cells = []
    for pp in pp_list:
        for strategy in strategies:
            if strategy in BASELINES:
                cells.append(Cell(pp, cast(Strategy, strategy), 1))
            elif strategy == "pipeline":
                cells.append(Cell(pp, "pipeline", ranks))
            else:
                cells.extend(
                    Cell(pp, "ring", ranks, cast(Exchange, exchange), cast(KVLayout, kv))
                    for exchange in exchanges
                    for kv in kv_layouts
                )
    return cells


class CellFailed(Exception):
    """A run of a cell failed; the message says why (the ranks' own reason)."""


def run_schedule(
    cells: list[Cell],
    warmup: int,
    repeat: int,
    run_one: Callable[[Cell], JobResult],
    on_run: Callable[[Cell, str, JobResult | None, str | None], None] | None = None,
) -> list[CellOutcome]:
    """Warm-ups of every cell first, then `repeat` rounds over all cells (interleaved, so slow
    drift of a shared machine touches every cell alike). A cell whose run raises CellFailed keeps
    the reason and is skipped from then on."""
    outcomes = [CellOutcome(cell) for cell in cells]
    rounds = [("warmup", i) for i in range(warmup)] + [("run", i) for i in range(repeat)]
    for kind, index in rounds:
        for outcome in outcomes:
            if outcome.error is not None:
                continue
            tag = f"{kind} {index + 1}/{warmup if kind == 'warmup' else repeat}"
            try:
                result = run_one(outcome.cell)
            except CellFailed as exc:
                outcome.error = f"{kind} {index + 1}: {exc}"
                if on_run:
                    on_run(outcome.cell, tag, None, outcome.error)
                continue
            if kind == "run":
                outcome.runs.append(result)
            if on_run:
                on_run(outcome.cell, tag, result, None)
    return outcomes


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(outcome: CellOutcome, baseline_tps: dict[str, float]) -> dict[str, Any]:
    """One cell of the report; metrics are null for a failed cell (its runs stay listed)."""
    cell, runs = outcome.cell, outcome.runs
    ok = outcome.error is None and bool(runs)
    prompt = spread([r.prompt_tps for r in runs]) if ok else None
    return {
        "label": cell.label,
        "pp": cell.pp_tokens,
        "strategy": cell.strategy,
        "ranks": cell.ranks,
        "exchange": cell.exchange,
        "kv_layout": cell.kv_layout,
        "decode_kv": cell.kv_layout,  # deprecated: kv_layout's old name, for older readers
        "status": "ok" if ok else "failed",
        "error": outcome.error,
        "prompt_tps": prompt,
        "generation_tps": spread([r.generation_tps for r in runs]) if ok else None,
        "generated_tokens": spread([r.generated_tokens for r in runs]) if ok else None,
        "prefill_s": spread([r.prefill_s for r in runs]) if ok else None,
        "decode_s": spread([r.decode_s for r in runs]) if ok else None,
        "load_s": spread([r.load_s for r in runs]) if ok else None,
        "peak_memory_bytes": peak_per_rank(runs) if ok else None,
        **{
            f"ratio_vs_{name.replace('-', '_')}": (
                prompt["median"] / baseline_tps[name]
                if prompt is not None and name in baseline_tps
                else None
            )
            for name in BASELINES
        },
        "runs": [r.model_dump(mode="json", exclude={"text"}) for r in runs],
    }


def peak_per_rank(runs: Sequence[JobResult]) -> list[int]:
    """Max over runs, per rank."""
    return [max(column) for column in zip(*(r.peak_memory_bytes for r in runs), strict=True)]


def summarize_all(outcomes: Sequence[CellOutcome]) -> list[dict[str, Any]]:
    """Every cell, with its prompt tok/s ratios to the baseline cells of the same prompt length."""
    baselines: dict[int, dict[str, float]] = {}
    for outcome in outcomes:
        cell = outcome.cell
        if cell.strategy in BASELINES and outcome.error is None and outcome.runs:
            median = statistics.median(r.prompt_tps for r in outcome.runs)
            baselines.setdefault(cell.pp_tokens, {})[cell.strategy] = median
    return [summarize(o, baselines.get(o.cell.pp_tokens, {})) for o in outcomes]


def tile_tokens(base: Sequence[int], count: int) -> list[int]:
    """`count` tokens: `base` repeated as often as needed, then cut."""
    if not base:
        raise ValueError("cannot build a prompt from an empty text")
    repeats = -(-count // len(base))
    return (list(base) * repeats)[:count]


def plot_series(
    cells: Sequence[dict[str, Any]],
) -> dict[str, list[tuple[int, float, float, float]]]:
    """label -> [(pp, median, min, max) prompt tok/s] over the cells that ran."""
    series: dict[str, list[tuple[int, float, float, float]]] = {}
    for cell in cells:
        tps = cell["prompt_tps"]
        if tps is not None:
            point = (cell["pp"], tps["median"], tps["min"], tps["max"])
            series.setdefault(cell["label"], []).append(point)
    return {label: sorted(points) for label, points in series.items()}


def report_table(report: dict[str, Any]) -> Table:
    config, machine = report["config"], report["machine"]
    table = Table(
        title=(
            f"ringq bench: {config['model']}, tg {config['tg']}, chunk {config['chunk_tokens']}, "
            f"{config['repeat']} runs (+{config['warmup']} warm-up) per cell"
        ),
        caption=(
            f"{report['date_utc']}  {machine['platform']}  {machine['cpu_count']} CPUs  "
            f"mlx {machine['mlx_version']} ({machine['backend']})  "
            f"{describe_load(machine)}  "
            f"{describe_source(machine.get('source'))}"
        ),
    )
    columns = ("pp", "cell", "prompt tok/s", "min-max", "x single", "x mlx-lm", "gen tok/s")
    for name in (*columns, "generated"):
        table.add_column(name, justify="left" if name == "cell" else "right")
    table.add_column("peak MiB/rank", justify="right")
    table.add_column("load s", justify="right")
    table.add_column("MFU", justify="right")
    for cell in report["cells"]:
        table.add_row(*table_row(cell))
    return table


def table_row(cell: dict[str, Any]) -> list[str]:
    head = [str(cell["pp"]), cell["label"]]
    if cell["status"] != "ok":
        return [*head, "[red]failed[/red]", "", "", "", "", "", "", "", ""]
    prompt, gen, generated = cell["prompt_tps"], cell["generation_tps"], cell["generated_tokens"]
    return [
        *head,
        f"{prompt['median']:.1f}",
        f"{prompt['min']:.1f}-{prompt['max']:.1f}",
        format_ratio(cell["ratio_vs_single"]),
        format_ratio(cell["ratio_vs_mlx_lm"]),
        f"{gen['median']:.1f}",
        format_range(generated["min"], generated["max"]),
        " / ".join(f"{b / MIB:.0f}" for b in cell["peak_memory_bytes"]),
        f"{cell['load_s']['median']:.2f}",
        f"{cell['mfu']:.1%}" if cell.get("mfu") is not None else "-",
    ]


def format_ratio(ratio: float | None) -> str:
    return f"{ratio:.2f}" if ratio is not None else "-"


def format_range(low: float, high: float) -> str:
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def describe_source(source: dict[str, Any] | None) -> str:
    if not source:
        return "source: not a git checkout"
    return f"commit {source['commit'][:10]}" + (" + uncommitted changes" if source["dirty"] else "")


def describe_load(machine: dict[str, Any]) -> str:
    during = machine.get("load_avg_1m_after_runs")
    text = f"load(1m) start {machine['load_avg_start'][0]:.2f}"
    if during:
        text += f", after runs {during['min']:.2f}-{during['max']:.2f}"
    return text + f", end {machine['load_avg_end'][0]:.2f}"
