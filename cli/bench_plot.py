"""The PNG of `ringq bench --plot`: prompt tok/s against prompt length, one line per cell label."""

from pathlib import Path
from typing import Any

from cli.bench_report import plot_series


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Prompt tok/s against prompt length, one line per cell label, min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = report["config"]
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, points in plot_series(report["cells"]).items():
        pp = [p[0] for p in points]
        median = [p[1] for p in points]
        below = [p[1] - p[2] for p in points]
        above = [p[3] - p[1] for p in points]
        axes.errorbar(pp, median, yerr=[below, above], marker="o", capsize=3, label=label)
    axes.set_xscale("log", base=2)
    axes.set_xticks(config["pp"], [str(pp) for pp in config["pp"]])
    axes.set_xlabel("prompt tokens (pp)")
    axes.set_ylabel("prompt tokens/s (median of runs)")
    axes.set_title(
        f"ringq bench: {Path(config['model']).name}, tg {config['tg']}, "
        f"{report['machine']['cpu_count']} CPUs, {report['date_utc']}",
        fontsize=10,
    )
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
