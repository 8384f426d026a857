"""A prefill's ETA replayed from its rank's log: the chunk ends a rank logs when a prefill ends
("prefill chunks ended (tokens:s) ..."), fed through the rank's own estimator
(ring_worker/engine/eta.py) one chunk at a time, and each estimate held against the real time
left, from the 10 % mark on (bench.long_document's rule). The ETA is a function of those chunk
times alone, so a replay gives what the rank reported at each chunk's end; an estimator change
can be tried on a GPU run's logs without the GPU.

    python -m bench.probes.eta_replay --model random:qwen2.5-7b-1m LOG [LOG ...]
"""

import re
import statistics
from pathlib import Path

import click

from bench.long_document import ETA_FROM_SHARE, ETA_LAST_S
from jobs.model_catalog import read_model_shape, resolve_model
from ring_worker.engine.eta import Cost, PrefillPace

CHUNKS = re.compile(r"job (\w+): prefill chunks ended \(tokens:s\) ([\d.: ]+)")


def chunk_ends(text: str) -> list[tuple[str, list[tuple[int, float]]]]:
    """Each logged prefill: its job and its (tokens done, seconds) points, the first (start, 0)."""
    found = []
    for job, points in CHUNKS.findall(text):
        pairs = [p.split(":") for p in points.split()]
        found.append((job, [(int(t), float(s)) for t, s in pairs]))
    return found


def replay(cost: Cost, points: list[tuple[int, float]]) -> list[float]:
    """|estimate - real time left| / real time left at each chunk end, counted by
    bench.long_document's rule (from ETA_FROM_SHARE of the prompt on, not in its last
    ETA_LAST_S)."""
    (start, _), (total, end_s) = points[0], points[-1]
    pace = PrefillPace(cost, start)
    errors = []
    for done, seconds in points[1:]:
        pace.add(done, seconds)
        left, estimate = end_s - seconds, pace.seconds_left(total)
        if estimate is None or left < ETA_LAST_S or done - start < ETA_FROM_SHARE * (total - start):
            continue
        errors.append(abs(estimate - left) / left)
    return errors


@click.command()
@click.option("--model", required=True, help="The model whose FLOPs the estimator weighs.")
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
def main(model: str, logs: tuple[Path, ...]) -> None:
    shape = read_model_shape(resolve_model(model, allowed_dirs=None))
    for log in logs:
        for job, points in chunk_ends(log.read_text()):
            errors = replay(shape.prefill_flops, points)
            if not errors:
                continue
            click.echo(
                f"{log.name} job {job}: {points[-1][0]} tokens in {points[-1][1]:.1f} s, "
                f"{len(errors)} estimates: error median {statistics.median(errors):.1%}, "
                f"max {max(errors):.1%}"
            )


if __name__ == "__main__":
    main()
