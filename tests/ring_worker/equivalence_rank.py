"""One rank of the strategy-vs-single equivalence test (run as a fresh process by the test)."""

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from ring_worker.engine.engines import Engine
from ring_worker.engine.group import join_group
from ring_worker.engine.pacing import paced_layers
from ring_worker.engine.ring_attention import Exchange, KVLayout
from ring_worker.engine.strategies import make_engine
from tests.ring_worker.tiny import load_tiny

DECODE_TOKENS = 12


def main() -> None:
    model_dir, rank, addresses, lengths, chunk, out_dir, strategy, exchange, kv_layout = sys.argv[
        1:10
    ]
    paced = sys.argv[10:] == ["paced"]  # prefill paced layer by layer, as on GPUs
    group = join_group(json.loads(addresses), int(rank), Path(out_dir))
    assert strategy in ("single", "ring", "pipeline")
    assert exchange in ("rotate", "allgather") and kv_layout in ("replicated", "sharded")
    model = load_tiny(Path(model_dir))
    engine = make_engine(
        model, group, strategy, cast(Exchange, exchange), cast(KVLayout, kv_layout)
    )
    results = {}
    for length in json.loads(lengths):
        progress: list[tuple[int, int]] = []
        with paced_layers(model, force=True) if paced else nullcontext():
            prefill = engine.prefill(
                prompt_tokens(length), int(chunk), on_progress=recorder(progress)
            )
        kv_tokens = prefill.cache[0].offset  # this rank's KV after prefill
        steps = [prefill.logits]
        with recording_decode_logits(engine, steps):
            decoded = engine.decode(prefill, DECODE_TOKENS)
        results[str(length)] = {
            "tokens": decoded.tokens,
            "kv_tokens": kv_tokens,
            "kv_layers": len(prefill.cache),
            "progress": progress,
        }
        # Prefill's last-position logits (every rank), then each decode step's (the ranks that
        # compute them: every ring rank, a pipeline's last).
        mx.save(str(Path(out_dir) / f"logits-{length}-rank{rank}.npy"), mx.stack(steps))
    (Path(out_dir) / f"tokens-rank{rank}.json").write_text(json.dumps(results))


@contextmanager
def recording_decode_logits(engine: Engine, steps: list[mx.array]) -> Iterator[None]:
    """Within: every decode step's logits are appended to `steps`, evaluated along with the
    step (async, so the engine's overlap of steps and votes is kept)."""
    step = engine._decode_step

    def recorded(token: mx.array, cache: list[Any]) -> mx.array | None:
        logits = step(token, cache)
        if logits is not None:
            mx.async_eval(logits)
            steps.append(logits)
        return logits

    engine.__dict__["_decode_step"] = recorded  # shadows the method on this instance only
    try:
        yield
    finally:
        del engine.__dict__["_decode_step"]
    mx.eval(steps)


def recorder(seen: list[tuple[int, int]]):
    return lambda _, done, total: seen.append((done, total))


def prompt_tokens(length: int) -> list[int]:
    return cast(
        list[int], mx.random.randint(0, 1000, (length,), key=mx.random.key(length)).tolist()
    )


if __name__ == "__main__":
    main()
