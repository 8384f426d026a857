"""Does a decode step's K/V store copy the whole buffer? One column written into each of
`--layers` x 2 buffers of (rows, 8, columns, 128) and that column read back, step after step,
pipelined as the decoder runs (each step queued before the previous one is waited on); ms a
step for each way of writing it:

- eager_static: `buffer[..., c:c+1, :] = update` (the eager decoder's store);
- eager_dynamic: `mx.slice_update(buffer, update, mx.array([c]), axes=(2,))`;
- compiled_dynamic: the same inside one `mx.compile`d function of every buffer (the compiled
  decode step's store, ring_worker/engine/compiled_step.py);
- compiled_static: `mx.slice_update` at a fixed column inside the compiled function.

A way that copies takes about the buffers' bytes over the copy's bandwidth a step (GBs at 32
rows of 4K); one that writes in place takes microseconds.

    python -m bench.probes.store --rows 32
"""

import json
import statistics
import time
from collections.abc import Callable

import click
import mlx.core as mx

Store = Callable[[list[mx.array], mx.array, int], list[mx.array]]


def eager_static(buffers: list[mx.array], update: mx.array, column: int) -> list[mx.array]:
    for buffer in buffers:
        buffer[:, :, column : column + 1] = update
    return buffers


def eager_dynamic(buffers: list[mx.array], update: mx.array, column: int) -> list[mx.array]:
    at = mx.array([column])
    return [mx.slice_update(b, update, at, axes=(2,)) for b in buffers]


_dynamic = mx.compile(
    lambda buffers, update, at: [mx.slice_update(b, update, at, axes=(2,)) for b in buffers]
)
_static = mx.compile(
    lambda buffers, update: [mx.slice_update(b, update, mx.array([7]), axes=(2,)) for b in buffers]
)


def compiled_dynamic(buffers: list[mx.array], update: mx.array, column: int) -> list[mx.array]:
    return _dynamic(buffers, update, mx.array([column]))


def compiled_static(buffers: list[mx.array], update: mx.array, column: int) -> list[mx.array]:
    return _static(buffers, update)


WAYS: dict[str, Store] = {
    "eager_static": eager_static,
    "eager_dynamic": eager_dynamic,
    "compiled_dynamic": compiled_dynamic,
    "compiled_static": compiled_static,
}


def time_way(store: Store, rows: int, layers: int, columns: int, steps: int) -> float:
    """Median seconds a step."""
    buffers = [mx.zeros((rows, 8, columns, 128), mx.bfloat16) for _ in range(2 * layers)]
    mx.eval(buffers)
    update = mx.ones((rows, 8, 1, 128), mx.bfloat16)
    ends, pending = [], None
    for step in range(steps):
        buffers = store(buffers, update, 8 + step)
        read = mx.stack([b[:, :, 8 + step].sum() for b in buffers])  # as attention reads them
        mx.async_eval(read, buffers)
        if pending is not None:
            mx.eval(pending)
        pending = read
        ends.append(time.perf_counter())
    mx.eval(pending)
    del buffers
    mx.clear_cache()
    return statistics.median(b - a for a, b in zip(ends[3:], ends[4:], strict=False))


@click.command()
@click.option("--rows", default=32, show_default=True)
@click.option("--layers", default=8, show_default=True)
@click.option("--columns", default=4608, show_default=True)
@click.option("--steps", default=24, show_default=True)
@click.option("--rounds", default=2, show_default=True)
def main(rows: int, layers: int, columns: int, steps: int, rounds: int) -> None:
    found: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(rounds):
        for way, store in WAYS.items():
            found[way].append(round(1e3 * time_way(store, rows, layers, columns, steps), 3))
    gb = 2 * layers * rows * 8 * columns * 128 * 2 / 1e9
    print(json.dumps({"rows": rows, "layers": layers, "buffers_gb": round(gb, 2), "ms": found}))


if __name__ == "__main__":
    main()
