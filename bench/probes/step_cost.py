"""Where a decode step's time goes, by batch size: host time building the graph (Python), host
time dispatching it (MLX's eval: each primitive's eval_gpu, cuBLAS, CUDA graph commits), and the
wait for the device, side by side in one process.

    python -m bench.probes.step_cost --model random:llama-3.1-8b --out step-cost.json

Run it once per MLX setting to compare (each is read once per process), for instance
`MLX_USE_CUDA_GRAPHS=0` or `MLX_MAX_OPS_PER_BUFFER=100`.

1. Decode steps (ring_worker/engine/batch_decode.py's BatchDecoder) over `--rows` rows: rows of
   different lengths (the mixed-length path) and, for comparison, rows of one length. Each cell
   runs `--warm` steps untimed, then `--steps` timed, every step evaluated before the next is
   built (so the three parts add up; the service overlaps build with the previous step's
   compute), then `--steps` more as the service runs them (`BatchDecoder.step`: each step
   queued before the previous one's tokens are read), `pipelined_ms`. Where the decoder fused
   the linears (ring_worker/engine/fused_linears.py, CUDA), every cell runs once per `--linears`
   variant, the variants alternating `--repeats` times (the host's speed drifts between runs on
   a shared machine, so only side-by-side cells compare): "fused" as the decoder runs, and
   "separate" (the calls go around the fused weights), and "+eager": steps of several rows
   built by Python op by op, not as one compiled function (ring_worker/engine/compiled_step.py, the
   decoder's default where the rows kernels run). Ablations of the mixed-length path, to
   locate what a second length costs (their numbers are wrong, their work is a uniform step's):
   "sdpa" (attention by fused SDPA over `longest + 1` columns, no kernels), "rope" (one
   int RoPE offset); join them with "+". (A third, "store", wrote every row at one column
   while rows started at column 0: at 8 rows it took a step from 12.9 to 9.3 ms on an H200,
   h200-service/step-cost-ablations-2c5d8f1.json, and rows are now aligned at their ends so that
   they do.) `--profile` adds each cell's graph build under cProfile (the top functions by own
   time, per step).
2. One linear layer's matmul, M rows x dims -> out in bf16 (224 chained at 4096 -> 4096, the 8B
   shape's matmuls per step; 64 at 4096 -> 14336, where the device is the bound): host time to
   build and dispatch it, per matmul (gemv at M = 1, cuBLASLt above), and `weight_gb_s`, how
   near it gets to the memory's bandwidth.
"""

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path
from typing import Any

MLX_SETTINGS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", default="1,2,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--linears", default="fused,separate", help="variants, first compared")
    parser.add_argument("--profile", action="store_true", help="cProfile each cell's build")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import mlx.core as mx

    from bench.decode_throughput import make_prompts
    from jobs.model_catalog import resolve_model
    from jobs.tokenizer import load_tokenizer
    from ring_worker.engine.devices import cap_device_memory
    from ring_worker.engine.engines import Engine
    from ring_worker.engine.models import load_for_this_device

    cap_device_memory()
    path = resolve_model(args.model, allowed_dirs=None)
    model = load_for_this_device(path)
    document = load_tokenizer(path).encode(files("cli").joinpath("demo/document.md").read_text())
    rows = [int(r) for r in args.rows.split(",")]
    engine = Engine(model)
    mixed = make_prompts(document, max(rows), args.prompt_tokens, equal=False)
    loaded = time.perf_counter()
    prefills = [engine.prefill(p, args.prompt_tokens) for p in mixed]
    one_length = make_prompts(document, 1, args.prompt_tokens, equal=True)[0]
    uniform = engine.prefill(one_length, args.prompt_tokens)
    print(f"prefilled in {time.perf_counter() - loaded:.1f}s", flush=True)

    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": args.model,
        "mlx": version("mlx"),
        "settings": {k: os.environ.get(k) for k in MLX_SETTINGS},
        "steps": [],
        "matmul": [],
    }
    for count in rows:
        for kind in ("mixed", "uniform"):
            if kind == "uniform" and count == 1:
                continue  # one row is uniform already
            cell = prefills[:count] if kind == "mixed" else [uniform] * count
            for repeat in range(args.repeats):
                for linears in args.linears.split(","):
                    profile = args.profile and repeat == 0
                    timed = time_steps(engine, cell, args, linears, profile)
                    if timed is None:
                        continue
                    report["steps"].append(
                        {"rows": count, "kind": kind, "linears": linears, "repeat": repeat, **timed}
                    )
                    print(json.dumps(report["steps"][-1]), flush=True)
    report["variants"] = variant_summary(report["steps"], args.linears.split(","))
    on_cuda = mx.cuda.is_available()
    print(json.dumps(report["variants"], indent=1), flush=True)
    report["ops"] = [cell for rows in (2, 8) for cell in time_ops(rows)] if on_cuda else []
    for cell in report["ops"]:
        print(json.dumps(cell), flush=True)
    for m in (1, 2, 4, 8, 16, 32) if on_cuda else ():
        for out, count in ((4096, 224), (14336, 64)):
            report["matmul"].append(time_matmuls(m, count, out=out))
            print(json.dumps(report["matmul"][-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def time_steps(
    engine: Any, prefills: list[Any], args: argparse.Namespace, linears: str, profile: bool
) -> dict[str, Any] | None:
    """One cell; None for a fused variant where the decoder fused nothing (no GPU)."""
    import mlx.core as mx

    from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest
    from ring_worker.engine.fused_linears import FusedMLP

    eager = "eager" in linears.split("+")
    decoder = BatchDecoder(engine, max_batch=len(prefills), compiled=False if eager else None)
    fused = any(isinstance(x.mlp, FusedMLP) for x in engine.model.layers)
    if "separate" not in linears.split("+") and not fused:
        return None
    total = args.warm + 3 * args.steps + 4
    for index, prefill in enumerate(prefills):
        decoder.add(DecodeRequest(str(index), total), prefill)
    mx.eval(decoder._vote)
    parts: dict[str, list[float]] = {"build": [], "dispatch": [], "wait": []}
    ends = []
    with variant(engine.model, linears):
        for step in range(args.warm + args.steps):
            began = time.perf_counter()
            vote = build_step(decoder)
            built = time.perf_counter()
            mx.async_eval(vote)
            dispatched = time.perf_counter()
            mx.eval(vote)
            waited = time.perf_counter()
            decoder._vote = vote
            if step >= args.warm:
                parts["build"].append(built - began)
                parts["dispatch"].append(dispatched - built)
                parts["wait"].append(waited - dispatched)
        for _ in range(args.steps + 1):
            decoder.step()
            ends.append(time.perf_counter())
        top = profile_build(decoder, args.steps) if profile else None
    del decoder
    mx.clear_cache()
    cell: dict[str, Any] = {
        f"{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in parts.items()
    }
    cell["step_ms"] = round(sum(cell.values()), 3)
    pipelined = statistics.median(b - a for a, b in itertools.pairwise(ends))
    cell["pipelined_ms"] = round(1e3 * pipelined, 3)
    cell["tok_s"] = round(len(prefills) * 1e3 / cell["step_ms"], 1)
    if top is not None:
        cell["profile"] = top
    return cell


def build_step(decoder: Any, profiler: Any = None) -> Any:
    """Build the decoder's next step without dispatching it (its async_eval is skipped);
    under `profiler` if given. Returns the step's vote (lazy)."""
    import mlx.core as mx

    real_async_eval = mx.async_eval
    mx.async_eval = lambda *_: None
    try:
        if profiler is not None:
            profiler.enable()
        return decoder._queue_step()
    finally:
        if profiler is not None:
            profiler.disable()
        mx.async_eval = real_async_eval


def profile_build(decoder: Any, steps: int, top: int = 30) -> list[dict[str, Any]]:
    """`steps` graph builds under cProfile (each evaluated before the next): the `top` functions
    by own time, in microseconds a step."""
    import cProfile
    import pstats

    import mlx.core as mx

    profiler = cProfile.Profile()
    for _ in range(steps):
        vote = build_step(decoder, profiler)
        mx.eval(vote)
        decoder._vote = vote
    # Stats.stats holds the raw seconds (get_stats_profile rounds them to milliseconds, and a
    # function's share of a step is microseconds); typeshed does not declare the attribute.
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    found = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}:{name}",
            "calls": calls // steps,
            "own_us": round(1e6 * own / steps, 1),
            "cumulative_us": round(1e6 * cumulative / steps, 1),
        }
        for (file, line, name), (_, calls, own, cumulative, _) in found
    ]


def variant(model: Any, linears: str) -> Any:
    """The context a `--linears` variant runs in: its "+"-joined parts, each entered."""
    from contextlib import ExitStack

    stack = ExitStack()
    for part in linears.split("+"):
        if part == "separate":
            stack.enter_context(separate_linears(model))
        elif part in ABLATIONS:
            stack.enter_context(ABLATIONS[part](model))
        elif part not in ("fused", "eager"):  # eager: BatchDecoder(compiled=False)
            raise ValueError(f"unknown --linears variant {part!r}")
    return stack


@contextmanager
def patched(owner: type, name: str, value: Any) -> Iterator[None]:
    """Within: the class attribute `name` (a property too) is `value`."""
    saved = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextmanager
def sdpa_attend(model: Any) -> Iterator[None]:
    """Mixed-length steps attend by fused SDPA over `longest` columns of every row (the first:
    the cost of the right ones, not their numbers)."""
    import mlx.core as mx

    from ring_worker.engine.rows_attention import RowsAttention

    def attend(
        q: Any, keys: Any, values: Any, _starts: Any, _lengths: Any, longest: int, scale: float
    ) -> Any:
        rows = q.shape[0]
        k, v = keys[:rows, :, :longest], values[:rows, :, :longest]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    layers = [x.self_attn for x in model.layers if isinstance(x.self_attn, RowsAttention)]
    saved = [x._attend for x in layers]
    for layer in layers:
        layer._attend = attend
    try:
        yield
    finally:
        for layer, kept in zip(layers, saved, strict=True):
            layer._attend = kept


def int_rope(_: Any) -> Any:
    """RoPE takes the first row's length as every row's offset (one int)."""
    from ring_worker.engine.batch_cache import Rows

    return patched(Rows, "offset", property(lambda self: self.lengths[0]))


ABLATIONS: dict[str, Callable[[Any], Any]] = {
    "sdpa": sdpa_attend,
    "rope": int_rope,
}


@contextmanager
def separate_linears(model: Any) -> Iterator[None]:
    """Within: every projection is its own matmul again (the fused weights stay, unused)."""
    from ring_worker.engine.fused_linears import QKV, FusedMLP, mlx_lm_attention

    saved = [(layer, layer.mlp, mlx_lm_attention(layer.self_attn)) for layer in model.layers]
    qkv = [getattr(attn, QKV, None) for _, _, attn in saved]
    for layer, mlp, attn in saved:
        setattr(attn, QKV, None)
        if isinstance(mlp, FusedMLP):
            layer.mlp = mlp.inner
    try:
        yield
    finally:
        for (layer, mlp, attn), fused in zip(saved, qkv, strict=True):
            layer.mlp = mlp
            setattr(attn, QKV, fused)


def variant_summary(steps: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    """Per (rows, kind): each variant's median step (serialized and pipelined) over repeats, and
    the first variant's over each other's."""
    cells: dict[tuple[int, str], dict[str, list[dict[str, Any]]]] = {}
    for step in steps:
        by = cells.setdefault((step["rows"], step["kind"]), {})
        by.setdefault(step["linears"], []).append(step)
    summary = []
    for (rows, kind), by in cells.items():
        row: dict[str, Any] = {"rows": rows, "kind": kind}
        for name, found in by.items():
            for part in ("step_ms", "pipelined_ms"):
                row[f"{name}_{part}"] = round(statistics.median(s[part] for s in found), 3)
        first = variants[0]
        for other in variants[1:]:
            if first in by and other in by:
                ratio = row[f"{first}_pipelined_ms"] / row[f"{other}_pipelined_ms"]
                row[f"{first}_over_{other}"] = round(ratio, 3)
        summary.append(row)
    return summary


def time_matmuls(m: int, count: int, dim: int = 4096, out: int = 4096) -> dict[str, Any]:
    """`count` (m, 1, dim) x (out, dim)^T products `x @ w.T` in one graph (gemv at m = 1, cuBLAS
    above), chained where out == dim, else each on x."""
    import mlx.core as mx

    weights = [mx.random.normal((out, dim)).astype(mx.bfloat16) * dim**-0.5 for _ in range(4)]
    x0 = mx.random.normal((m, 1, dim)).astype(mx.bfloat16)
    mx.eval(weights, x0)

    exact = (x0.astype(mx.float32) @ weights[0].astype(mx.float32).T).astype(mx.bfloat16)
    error = mx.abs(x0 @ weights[0].T - exact).max().item()

    def graph() -> mx.array:
        x, outs = x0, []
        for i in range(count):
            y = x @ weights[i % 4].T
            if out == dim:
                x = y
            else:
                outs.append(y)
        return x if out == dim else mx.stack(outs)

    build, dispatch, wait = time_graph(graph)
    total = build + dispatch + wait
    return {
        "m": m,
        "dims": [dim, out],
        "matmuls": count,
        "max_abs_diff_vs_float32": error,
        "build_us_each": round(1e6 * build / count, 2),
        "dispatch_us_each": round(1e6 * dispatch / count, 2),
        "wait_us_each": round(1e6 * wait / count, 2),
        "weight_gb_s": round(count * out * dim * 2 / total / 1e9, 1),
    }


def time_graph(graph: Callable[[], Any]) -> tuple[float, float, float]:
    """Seconds to build `graph()`, dispatch it and wait for it: medians of 5 after one untimed."""
    import mlx.core as mx

    samples = []
    for _ in range(6):
        began = time.perf_counter()
        result = graph()
        built = time.perf_counter()
        mx.async_eval(result)
        dispatched = time.perf_counter()
        mx.eval(result)
        samples.append((built - began, dispatched - built, time.perf_counter() - dispatched))
    build, dispatch, wait = (statistics.median(s[i] for s in samples[1:]) for i in range(3))
    return build, dispatch, wait


def time_ops(rows: int, layers: int = 32, length: int = 4096) -> list[dict[str, Any]]:
    """The ops where a decode step over rows of different lengths differs from one over rows of
    one length, each repeated `layers` times in one graph as a step does (8B shape, bf16, ~4K
    keys): the K/V store (a scatter at each row's length, or one slice update), the attention
    (ringq's two kernels, or fused SDPA) and RoPE (one offset per row, or one int)."""
    import mlx.core as mx

    from ring_worker.engine.rows_attention import kernel_attention

    heads, kv_heads, dim, capacity = 32, 8, 128, length + 256
    keys, values = (mx.zeros((rows, kv_heads, capacity, dim), mx.bfloat16) for _ in range(2))
    new_k = mx.random.normal((rows, kv_heads, 1, dim)).astype(mx.bfloat16)
    q0 = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    lengths = [length - 37 * row for row in range(rows)]
    index, positions = mx.arange(rows), mx.array(lengths)
    visible = mx.array([n + 1 for n in lengths], dtype=mx.int32)
    starts = mx.array([length - n for n in lengths], dtype=mx.int32)  # aligned at their ends
    mx.eval(keys, values, new_k, q0, index, positions, visible, starts)

    def store_scatter() -> list[mx.array]:
        k, v = keys, values
        for _ in range(layers):
            k[index, :, positions] = new_k[:, :, 0]
            v[index, :, positions] = new_k[:, :, 0]
        return [k, v]

    def store_slice() -> list[mx.array]:
        k, v = keys, values
        for _ in range(layers):
            k[:rows, :, length : length + 1] = new_k
            v[:rows, :, length : length + 1] = new_k
        return [k, v]

    def chained(step: Callable[[mx.array], mx.array]) -> Callable[[], mx.array]:
        def graph() -> mx.array:
            q = q0
            for _ in range(layers):
                q = step(q)
            return q

        return graph

    ops = {
        "store_scatter": store_scatter,
        "store_slice": store_slice,
        "attend_kernels": chained(
            lambda q: kernel_attention(q, keys, values, starts, visible, length + 1, dim**-0.5)
        ),
        "attend_sdpa": chained(
            lambda q: mx.fast.scaled_dot_product_attention(
                q, keys[:, :, : length + 1], values[:, :, : length + 1], scale=dim**-0.5
            )
        ),
        "rope_offsets": chained(
            lambda q: mx.fast.rope(q, dim, traditional=False, base=5e5, scale=1.0, offset=positions)
        ),
        "rope_int": chained(
            lambda q: mx.fast.rope(q, dim, traditional=False, base=5e5, scale=1.0, offset=length)
        ),
    }
    cells = []
    for name, graph in ops.items():
        build, dispatch, wait = time_graph(graph)
        cells.append(
            {
                "op": name,
                "rows": rows,
                "per_layer_us": {
                    "build": round(1e6 * build / layers, 2),
                    "dispatch": round(1e6 * dispatch / layers, 2),
                    "wait": round(1e6 * wait / layers, 2),
                },
            }
        )
    return cells


if __name__ == "__main__":
    raise SystemExit(main())
