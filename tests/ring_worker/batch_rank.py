"""The batch-decode schedule the fidelity tests run, and one rank of its ring run (started as a
fresh process by tests/ring_worker/test_batch_decode.py)."""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from ring_worker.engine.batch_decode import BatchDecoder, DecodeRequest, SequenceResult
from ring_worker.engine.engines import Engine, RingEngine
from ring_worker.engine.fused_linears import fuse_layers
from ring_worker.engine.group import join_group
from ring_worker.engine.rows_attention import install_rows_attention, reference_attention
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny

CHUNK_TOKENS = 96


@dataclass(frozen=True)
class Entry:
    key: str
    prompt_tokens: int
    max_tokens: int
    join_step: int


# A long job decodes throughout; "mid" leaves after 12 tokens and "short" (3 prompt tokens) then
# joins the long one mid-decode in the row "mid" left, over 257+ stale positions its mask must
# hide; "seven" and "one" join together at step 5, at lengths unlike every other row; "longer"
# joins at step 8, longer than the buffers' capacity (they grow mid-decode).
SCHEDULE = (
    Entry("long", 1001, 40, 0),
    Entry("mid", 257, 12, 0),
    Entry("seven", 7, 25, 5),
    Entry("one", 1, 8, 5),
    Entry("longer", 1500, 6, 8),
    Entry("short", 3, 20, 15),
)


def run_schedule(
    engine: Engine, compiled: bool | None = None
) -> tuple[dict[str, list[mx.array]], list[SequenceResult]]:
    """Every sequence's logits at each of its decode steps (evaluated), and the results;
    `compiled` as BatchDecoder takes it."""
    seen: dict[str, list[mx.array]] = {}

    def record(keys: list[str], logits: mx.array) -> None:
        mx.eval(logits)
        for row, key in enumerate(keys):
            seen.setdefault(key, []).append(logits[row])

    decoder = BatchDecoder(engine, on_logits=record, compiled=compiled)
    results: list[SequenceResult] = []
    step = 0
    while step <= max(e.join_step for e in SCHEDULE) or decoder.busy:
        for entry in SCHEDULE:
            if entry.join_step == step:
                prefill = engine.prefill(prompt_tokens(entry.prompt_tokens), CHUNK_TOKENS)
                decoder.add(DecodeRequest(entry.key, entry.max_tokens), prefill)
        results.extend(decoder.step())
        step += 1
    return seen, results


def main() -> None:
    """argv: model dir, rank, addresses (JSON), out dir, and "compiled" to step through the
    compiled step (rows attention on MLX ops, linears fused, as on CUDA)."""
    model_dir, rank, addresses, out_dir = sys.argv[1:5]
    compiled = sys.argv[5:6] == ["compiled"]
    group = join_group(json.loads(addresses), int(rank), Path(out_dir))
    engine = RingEngine(load_tiny(Path(model_dir)), group, exchange="rotate")
    if compiled:
        install_rows_attention(engine.model, attend=reference_attention)
        fuse_layers(engine.model)
    seen, results = run_schedule(engine, compiled=compiled or None)
    mx.savez(
        str(Path(out_dir) / f"logits-rank{rank}.npz"), **{k: mx.stack(v) for k, v in seen.items()}
    )
    tokens = {r.key: r.tokens for r in results}
    (Path(out_dir) / f"tokens-rank{rank}.json").write_text(json.dumps(tokens))


if __name__ == "__main__":
    main()
