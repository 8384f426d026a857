"""Where a checkpoint segment's write time goes: one segment of `--tokens` of the model's KV
(each layer's keys and values, fresh GPU arrays as `snapshot` leaves them), written the ways a
writer could, each timed apart, GB/s:

- host_copy: the arrays read into host memory (`np.array`), no file;
- save_<dir>: `save_prompt_cache` (the checkpoint writer's call) into `dir`;
- numpy_<dir>: host arrays already read, written with `ndarray.tofile` (the disk alone);
- threads4_<dir>: `save_prompt_cache` of a quarter of the layers each, four threads at once;
- snapshot: the compute thread's share, `checkpoint.snapshot` (the slices copied into one array);
- busy_layers_disk / busy_flat_disk: from another thread while this one keeps the GPU busy (as
  the checkpoint writer runs beside a prefill), `save_prompt_cache` of the per-layer arrays /
  the checkpoint's own write of one array (`Snapshot.save`). The busy work is matmuls, or with
  `--busy-keys K` attention of a 16K-token chunk over K keys, a late prefill's longest kernels.

`dir` is the checkpoint home's disk (`--home`) and /dev/shm (host memory).

    python -m bench.probes.checkpoint_write --model random:qwen2.5-7b-1m --tokens 16384
"""

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, save_prompt_cache

from jobs.model_catalog import read_model_shape, resolve_model
from ring_worker.engine.checkpoint import snapshot


def segment(layers: int, kv_heads: int, head_dim: int, tokens: int) -> list[KVCache]:
    caches = []
    for _ in range(layers):
        keys = mx.random.normal((1, kv_heads, tokens, head_dim)).astype(mx.bfloat16)
        values = mx.random.normal((1, kv_heads, tokens, head_dim)).astype(mx.bfloat16)
        mx.eval(keys, values)
        cache = KVCache()
        cache.state = (keys, values, tokens)
        caches.append(cache)
    return caches


def host_arrays(caches: list[KVCache]) -> list[np.ndarray]:
    return [np.array(a.view(mx.uint16)) for c in caches for a in (c.keys, c.values)]


BUSY_SIZE = 8192  # the busy loop's matmuls: (BUSY_SIZE, BUSY_SIZE) bf16, 8 at a time
BUSY_QUERIES = 16384  # with busy keys: a GPU prefill chunk's queries


def busy_work(keys: int, q_heads: int, kv_heads: int, head_dim: int) -> Callable[[], mx.array]:
    """One round of the busy loop: 8 matmuls, or (`keys` > 0) one attention call of a chunk."""
    if keys <= 0:
        a = mx.random.normal((BUSY_SIZE, BUSY_SIZE)).astype(mx.bfloat16)
        mx.eval(a)

        def matmuls() -> mx.array:
            b = a
            for _ in range(8):
                b = (b @ a) * 1e-4
            return b

        return matmuls
    q = mx.random.normal((1, q_heads, BUSY_QUERIES, head_dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, keys, head_dim)).astype(mx.bfloat16)
    mx.eval(q, k)
    return lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=head_dim**-0.5)


def busy_while(write: Callable[[], object], work: Callable[[], mx.array]) -> None:
    """`write()` on another thread while this one keeps the GPU queue full of `work`."""
    done = threading.Event()

    def run() -> None:
        write()
        done.set()

    writer = threading.Thread(target=run)
    writer.start()
    while not done.is_set():
        mx.eval(work())
    writer.join()


def timed(fresh: Callable[[], list[KVCache]], write: Callable[[list[KVCache]], object]) -> float:
    caches = fresh()
    start = time.perf_counter()
    write(caches)
    return time.perf_counter() - start


@click.command()
@click.option("--model", default="random:qwen2.5-7b-1m")
@click.option("--tokens", default=16384, help="tokens in the segment")
@click.option("--home", default=None, help="the checkpoints' disk (default: the temp dir)")
@click.option("--repeat", default=3)
@click.option("--busy-size", default=BUSY_SIZE, help="the busy loop's matrix side")
@click.option("--busy-keys", default=0, help="busy with attention over this many keys (0: matmuls)")
@click.option("--out", default=None, help="also write the JSON here")
def main(
    model: str,
    tokens: int,
    home: str | None,
    repeat: int,
    busy_size: int,
    busy_keys: int,
    out: str | None,
) -> None:
    global BUSY_SIZE
    BUSY_SIZE = busy_size
    shape = read_model_shape(resolve_model(model, allowed_dirs=None))
    head_dim = shape.head_dim
    fresh = partial(segment, shape.layers, shape.kv_heads, head_dim, tokens)
    gb = sum(c.keys.nbytes + c.values.nbytes for c in fresh()) / 1e9
    dirs = {"disk": Path(tempfile.mkdtemp(dir=home)), "shm": Path(tempfile.mkdtemp(dir="/dev/shm"))}
    ways: dict[str, Callable[[list[KVCache]], object]] = {"host_copy": host_arrays}
    file_s: dict[str, float] = {}  # numpy_<dir>: the file write alone, host arrays already read
    for name, folder in dirs.items():
        file = folder / "segment.safetensors"

        def save(c: list[KVCache], f: Path = file) -> None:
            save_prompt_cache(str(f), c)

        ways[f"save_{name}"] = save

        def numpy_write(c: list[KVCache], f: Path = file, key: str = f"numpy_{name}") -> None:
            arrays = host_arrays(c)
            start = time.perf_counter()
            with open(f, "wb") as handle:
                for a in arrays:
                    a.tofile(handle)
            file_s[key] = time.perf_counter() - start

        ways[f"numpy_{name}"] = numpy_write

        def threads4(c: list[KVCache], f: Path = file) -> None:
            parts = [c[i::4] for i in range(4)]
            workers = [
                threading.Thread(target=save_prompt_cache, args=(f"{f}.{i}", part))
                for i, part in enumerate(parts)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()

        ways[f"threads4_{name}"] = threads4
    disk_file = str(dirs["disk"] / "busy.safetensors")
    ways["snapshot"] = snapshot
    work = busy_work(busy_keys, shape.q_heads, shape.kv_heads, head_dim)
    ways["busy_layers_disk"] = lambda c: busy_while(lambda: save_prompt_cache(disk_file, c), work)

    def busy_flat_disk(c: list[KVCache]) -> None:
        flat = snapshot(c)
        busy_while(lambda: flat.save(Path(disk_file), {}), work)

    ways["busy_flat_disk"] = busy_flat_disk

    result: dict[str, object] = {"model": model, "tokens": tokens, "segment_gb": round(gb, 3),
                                 "busy": f"attention over {busy_keys} keys" if busy_keys > 0
                                 else f"matmuls of {BUSY_SIZE}",
                                 "dirs": {k: str(v) for k, v in dirs.items()}}  # fmt: skip
    for name, way in ways.items():
        try:
            seconds = [timed(fresh, way) for _ in range(repeat)]
        except OSError as exc:  # /dev/shm may be too small for a segment
            result[name] = {"error": str(exc)}
            print(name, exc, flush=True)
            continue
        best = min(seconds)
        row: dict[str, float] = {"best_s": round(best, 3), "gb_per_s": round(gb / best, 2)}
        if name in file_s:
            row["file_only_gb_per_s"] = round(gb / file_s[name], 2)
        result[name] = row
        print(name, row, flush=True)
    for folder in dirs.values():
        shutil.rmtree(folder, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
