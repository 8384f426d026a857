"""Where the time of a ring-2 prefill goes on CUDA (issue 7): a launcher and two rank processes.

    RINGQ_BACKEND=cuda python3 -m bench.probes.gpu_profile --model random:llama-3.1-8b \
        --pp 32768,131008 --chunks 16384,0 --out $OUT

Each rank joins the group (NCCL on CUDA, MLX's ring backend elsewhere), then in order:
1. collectives: the first all_gather / all_sum against repeats (NCCL connects lazily);
2. SDPA: the first call at a new shape against repeats (cuDNN builds a graph per shape);
3. ring-2 allgather prefills per prompt length and chunk (0 = the whole prompt): the first run
   in the process ("cold", what every `ringq bench` run pays) and a second ("warm"); then one
   run with every piece timed on its own (bench/probes/gpu_pieces.py);
4. decode: 64 tokens with the engine's loop and with the old synchronous one;
5. one GPU each, in parallel: ringq's single engine (rank 0) and mlx-lm's generate_step (rank 1).
Writes profile-rank<r>.json under --out and prints one line per measurement.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

from ring_worker.engine.group import free_loopback_ports
from ring_worker.runtime.processes import rank_environment

DECODE_TOKENS = 64
LAUNCHED = "GPU_PROFILE_LAUNCHED_AT"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--pp", default="32768,131008")
    parser.add_argument("--chunks", default="16384,0", help="0 = the whole prompt")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/profile")))
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--addresses", default=None)
    parser.add_argument("--timeout-s", type=float, default=500.0)
    parser.add_argument(
        "--single",
        action="store_true",
        help="only one GPU per rank, the whole prompt: ringq's single engine (rank 0) against "
        "mlx-lm (rank 1), as is and piece by piece",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="only the first prefill of fresh processes, timed piece by piece, then a warm one, "
        "and decode loops alternated (what every `ringq bench` run pays)",
    )
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    addresses = json.dumps([f"127.0.0.1:{p}" for p in free_loopback_ports(2)])
    launched = str(time.time())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.probes.gpu_profile", *sys.argv[1:], "--rank", str(rank)]
            + ["--addresses", addresses],
            env={**rank_environment(local_rank=rank), "PYTHONUNBUFFERED": "1", LAUNCHED: launched},
        )
        for rank in range(2)
    ]
    deadline = time.monotonic() + args.timeout_s
    exited: dict[int, float] = {}
    while len(exited) < len(procs) and time.monotonic() < deadline:
        exited.update(
            {
                r: time.time()
                for r, p in enumerate(procs)
                if r not in exited and p.poll() is not None
            }
        )
        time.sleep(0.05)
    for rank, p in enumerate(procs):
        p.kill()
        rows = json.loads((args.out / f"profile-rank{rank}.json").read_text() or "[]")
        if rows and rank in exited:
            print(
                f"rank {rank}: exit code {p.wait()}, process exit took "
                f"{exited[rank] - rows[-1]['t_unix']:.2f} s after its last row"
            )
    return max(abs(p.wait()) for p in procs)


class Recorder:
    def __init__(self, rank: int, out: Path):
        self.rank, self.out, self.rows = rank, out, list[dict[str, Any]]()

    def add(self, what: str, **values: Any) -> None:
        import mlx.core as mx

        row = {"rank": self.rank, "what": what, **values, "t_unix": round(time.time(), 3)}
        row["peak_gib"] = round(mx.get_peak_memory() / 1024**3, 1)
        mx.reset_peak_memory()
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        (self.out / f"profile-rank{self.rank}.json").write_text(json.dumps(self.rows, indent=1))


def seconds_of(fn) -> float:
    import mlx.core as mx

    started = time.perf_counter()
    mx.eval(fn())
    return round(time.perf_counter() - started, 4)


def run_rank(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from admission.vocabulary import Transport
    from jobs.model_catalog import resolve_model
    from ring_worker.engine.devices import cap_device_memory
    from ring_worker.engine.group import join_group
    from ring_worker.engine.models import load_for_this_device

    rec = Recorder(args.rank, args.out)
    rec.add(
        "process start to imports done", seconds=round(time.time() - float(os.environ[LAUNCHED]), 3)
    )
    started = time.perf_counter()
    cap_device_memory()
    mx.eval(mx.zeros(1))
    rec.add("memory cap + device init", seconds=round(time.perf_counter() - started, 3))
    backend: Transport = "nccl" if mx.cuda.is_available() else "ring"
    started = time.perf_counter()
    group = join_group(json.loads(args.addresses), args.rank, args.out, backend)
    rec.add("join group", seconds=round(time.perf_counter() - started, 3), backend=backend)
    if not (args.cold or args.single):
        profile_collectives(rec, group)
    started = time.perf_counter()
    model = load_for_this_device(resolve_model(args.model, allowed_dirs=None))
    rec.add("load model", seconds=round(time.perf_counter() - started, 3))
    pps = [int(p) for p in args.pp.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.cold:
        profile_cold(rec, model, group, pps[0], args.model)
        return
    if args.single:
        profile_single_vs_mlx_lm(rec, model, pps[0])
        return
    profile_sdpa(rec)
    profile_ring(rec, model, group, pps, chunks)
    del model
    mx.clear_cache()
    fresh = load_for_this_device(resolve_model(args.model, allowed_dirs=None))
    if args.rank == 0:
        profile_single(rec, fresh, pps, chunks)
    else:
        profile_mlx_lm(rec, fresh, pps, chunks)


def profile_cold(rec: Recorder, model: Any, group: Any, pp: int, model_name: str) -> None:
    """The first ring prefill of the process piece by piece, a second one, decode loops in
    turn; then, one GPU each: the single engine the same way (rank 0), mlx-lm (rank 1)."""
    import mlx.core as mx

    from jobs.model_catalog import resolve_model
    from ring_worker.engine.engines import Engine, RingEngine
    from ring_worker.engine.models import load_for_this_device

    pieces_and_decode(rec, RingEngine(model, group, "allgather", "replicated"), pp, "ring-2")
    del model
    mx.clear_cache()
    fresh = load_for_this_device(resolve_model(model_name, allowed_dirs=None))
    if rec.rank == 0:
        pieces_and_decode(rec, Engine(fresh), pp, "single")
    else:
        profile_mlx_lm(rec, fresh, [pp], [0])


def pieces_and_decode(rec: Recorder, engine: Any, pp: int, label: str) -> None:
    from bench.probes.gpu_pieces import timed_pieces

    for run in ("cold", "warm"):
        with timed_pieces() as pieces:
            result = engine.prefill(prompt(pp), pp)
        rec.add(
            f"{label} pieces {run}", pp=pp, total=round(result.seconds, 3), pieces=pieces.table()
        )
    for _ in range(2):
        profile_decode(rec, engine, prompt(pp), label, sync_first=True)


def profile_collectives(rec: Recorder, group: Any) -> None:
    import mlx.core as mx

    payload = mx.zeros((1024, 2048), dtype=mx.bfloat16)  # a layer's K/V, 8B shape, 1K tokens
    big = mx.zeros((16384, 2048), dtype=mx.bfloat16)  # 8K tokens per rank: 64 MiB
    mx.eval(payload, big)
    for i in range(3):
        rec.add(f"all_gather 4 MiB #{i + 1}", seconds=seconds_of(lambda: gather(payload, group)))
    for i in range(3):
        rec.add(f"all_gather 64 MiB #{i + 1}", seconds=seconds_of(lambda: gather(big, group)))
    votes = []
    for _ in range(20):
        started = time.perf_counter()
        mx.distributed.all_sum(mx.array([0, 1], dtype=mx.int32), group=group).tolist()
        votes.append(time.perf_counter() - started)
    rec.add("vote (all_sum + tolist)", first=round(votes[0], 5), median=sorted(votes)[10])


def gather(x: Any, group: Any) -> Any:
    import mlx.core as mx

    return mx.distributed.all_gather(x, group=group)


def profile_sdpa(rec: Recorder) -> None:
    import mlx.core as mx

    if not mx.cuda.is_available():
        return  # cuDNN's per-shape graphs are what this probes
    q = mx.random.normal((1, 32, 4096, 128)).astype(mx.bfloat16)
    for length in (8192, 12288, 12288, 12288, 20480, 20480):
        k = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
        v = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
        mx.eval(k, v)
        sdpa = mx.fast.scaled_dot_product_attention
        seconds = seconds_of(lambda: sdpa(q, k, v, scale=0.088, mask="causal"))  # noqa: B023
        rec.add(f"SDPA q 4096 x k {length}", seconds=seconds)


def profile_ring(rec: Recorder, model: Any, group: Any, pps: list[int], chunks: list[int]):
    from bench.probes.gpu_pieces import timed_pieces
    from ring_worker.engine.engines import RingEngine

    started = time.perf_counter()
    engine = RingEngine(model, group, "allgather", "replicated")
    rec.add("ring engine (warm-up collectives)", seconds=round(time.perf_counter() - started, 3))
    for pp in pps:
        tokens = prompt(pp)
        for chunk in chunks:
            for run in ("cold", "warm"):
                prefill_row(rec, engine, tokens, chunk, f"ring-2 prefill {run}")
    last = pps[0]
    for chunk in chunks:
        with timed_pieces() as pieces:
            result = engine.prefill(prompt(last), chunk or last)
        rec.add(
            "ring-2 pieces",
            pp=last,
            chunk=chunk or last,
            total=round(result.seconds, 3),
            pieces=pieces.table(),
        )
    profile_decode(rec, engine, prompt(last), "ring-2")


def profile_single(rec: Recorder, model: Any, pps: list[int], chunks: list[int]) -> None:
    from bench.probes.gpu_pieces import timed_pieces
    from ring_worker.engine.engines import Engine

    engine = Engine(model)
    for pp in pps:
        for chunk in chunks:
            for run in ("cold", "warm"):
                prefill_row(rec, engine, prompt(pp), chunk, f"single prefill {run}")
    with timed_pieces() as pieces:
        result = engine.prefill(prompt(pps[0]), pps[0])
    rec.add("single pieces", pp=pps[0], total=round(result.seconds, 3), pieces=pieces.table())
    profile_decode(rec, engine, prompt(pps[0]), "single")


def prefill_row(rec: Recorder, engine: Any, tokens: list[int], chunk: int, what: str) -> None:
    result = engine.prefill(tokens, chunk or len(tokens))
    rec.add(
        what,
        pp=len(tokens),
        chunk=chunk or len(tokens),
        seconds=round(result.seconds, 3),
        tok_s=round(len(tokens) / result.seconds),
    )


def profile_decode(
    rec: Recorder, engine: Any, tokens: list[int], label: str, sync_first: bool = False
) -> None:
    for loop in ("sync", "async") if sync_first else ("async", "sync"):
        prefill = engine.prefill(tokens, len(tokens))
        started = time.perf_counter()
        if loop == "async":
            count = len(engine.decode(prefill, DECODE_TOKENS).tokens)
        else:
            count = decode_synchronously(engine, prefill, DECODE_TOKENS)
        tok_s = round(count / (time.perf_counter() - started), 1)
        rec.add(f"{label} decode ({loop} loop)", context=len(tokens), tok_s=tok_s)


def decode_synchronously(engine: Any, prefill: Any, max_tokens: int) -> int:
    """The engine's decode loop before the async one: the token read on the host (`.item()`),
    voted on with one collective, then the next step built and evaluated."""
    import mlx.core as mx

    logits, count = prefill.logits, 0
    while True:
        token = cast(int, mx.argmax(logits).item()) if engine.rank == engine.last_rank else 0
        token, _ = engine._agree_flags([token, 0])
        count += 1
        if count == max_tokens:
            return count
        logits = engine._decode_step(mx.array([token]), prefill.cache)
        mx.eval(logits)


def profile_single_vs_mlx_lm(rec: Recorder, model: Any, pp: int) -> None:
    """Whole-prompt prefill on one GPU. Rank 0: ringq's engine as is, piece by piece, and with
    the last layer's MLP on the last position only (mlx-lm's prefill evaluates the caches alone,
    which skips that MLP). Rank 1: mlx-lm, as is and piece by piece."""
    from bench.probes.gpu_pieces import timed_pieces
    from ring_worker.engine.engines import Engine

    if rec.rank == 1:
        profile_mlx_lm(rec, model, [pp], [0], extra_steps=())
        with timed_pieces() as pieces:
            prefill_s, _ = mlx_lm_prefill(model, prompt(pp), pp, max_tokens=1)
        rec.add("mlx-lm pieces", pp=pp, total=round(prefill_s, 3), pieces=pieces.table())
        return
    engine = Engine(model)
    for run in ("cold", "warm"):
        prefill_row(rec, engine, prompt(pp), 0, f"single prefill {run}")
    with timed_pieces() as pieces:
        result = engine.prefill(prompt(pp), pp)
    rec.add("single pieces", pp=pp, total=round(result.seconds, 3), pieces=pieces.table())
    layer = model.model.layers[-1]
    mlp = layer.mlp
    layer.mlp = LastPositionMLP(mlp)
    for _ in range(2):
        prefill_row(rec, engine, prompt(pp), 0, "single prefill, last MLP on the last position")
    delta = (engine.prefill(prompt(pp), pp).logits - result.logits).abs().max().item()
    rec.add("max |logits - as is| with the last MLP on the last position", delta=delta)
    layer.mlp = mlp


class LastPositionMLP:
    """The last layer's MLP on the last position only; the block's residual add broadcasts it
    over every position, of which only the last one is used."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __call__(self, x: Any) -> Any:
        return self.inner(x[:, -1:])


def mlx_lm_prefill(
    model: Any, tokens: list[int], step: int, max_tokens: int = DECODE_TOKENS
) -> tuple[float, float]:
    """mlx-lm's generate_step timed as ring_worker/engine/baseline.py does: (prefill s, decode
    tok/s)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(tokens), model, max_tokens=DECODE_TOKENS, prefill_step_size=step)
    started = first = time.perf_counter()
    prefill_s, count = 0.0, 0
    for count, _ in enumerate(steps, start=1):
        if count == 1:
            first = time.perf_counter()
            prefill_s = first - started
    return prefill_s, (count - 1) / max(time.perf_counter() - first, 1e-9)


def profile_mlx_lm(
    rec: Recorder,
    model: Any,
    pps: list[int],
    chunks: list[int],
    extra_steps: tuple[int, ...] = (4096,),
) -> None:
    for pp in pps:
        for step in [*extra_steps, *chunks] if pp == pps[0] else chunks:
            for run in ("cold", "warm"):
                prefill_s, decode_tps = mlx_lm_prefill(model, prompt(pp), step or pp)
                rec.add(
                    f"mlx-lm prefill {run}",
                    pp=pp,
                    chunk=step or pp,
                    seconds=round(prefill_s, 3),
                    tok_s=round(pp / prefill_s),
                    decode_tok_s=round(decode_tps, 1),
                )


def prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 30000 + 100 for i in range(length)]


if __name__ == "__main__":
    sys.exit(main())
