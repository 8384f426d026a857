"""Timing the pieces of a prefill (bench/probes/gpu_profile.py): every piece evaluated on its own.

`timed_pieces()` wraps the functions a prefill calls (the ring's K/V projection and all_gather,
SDPA, the KV cache write, each MLP) so that each call first evaluates its inputs (time charged to
"before <piece>": the glue the previous piece left lazy, such as concatenations, norms and o_proj)
and then its own outputs (charged to "<piece>"). The sum is slower than the real prefill (one
device sync per piece), so it tells shares, not the total.
"""

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models import llama

from ring_worker.engine import ring_attention


def arrays_in(tree: Any) -> list[mx.array]:
    leaves = cast(list[tuple[str, Any]], tree_flatten(tree))
    return [leaf for _, leaf in leaves if isinstance(leaf, mx.array)]


class Pieces:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            mx.eval(arrays_in([list(args), list(kwargs.values())]))
            inputs_done = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(arrays_in(out))
            self.seconds[f"before {name}"] += inputs_done - started
            self.seconds[name] += time.perf_counter() - inputs_done
            self.calls[name] += 1
            return out

        return run

    def table(self) -> dict[str, float]:
        return {name: round(seconds, 4) for name, seconds in sorted(self.seconds.items())}


@contextmanager
def timed_pieces() -> Iterator[Pieces]:
    pieces = Pieces()
    patches: list[tuple[Any, str, Any]] = [
        (ring_attention, "project_qkv", ring_attention.project_qkv),
        (ring_attention, "gather_blocks", ring_attention.gather_blocks),
        (mx.fast, "scaled_dot_product_attention", mx.fast.scaled_dot_product_attention),
        (mlx_lm_cache.KVCache, "update_and_fetch", mlx_lm_cache.KVCache.update_and_fetch),
        (llama.MLP, "__call__", llama.MLP.__call__),
    ]
    names = ["qkv projection+RoPE", "K/V all_gather", "attention (SDPA)", "KV cache write", "MLP"]
    for (owner, attribute, original), name in zip(patches, names, strict=True):
        setattr(owner, attribute, pieces.wrap(name, original))
    try:
        yield pieces
    finally:
        for owner, attribute, original in patches:
            setattr(owner, attribute, original)
