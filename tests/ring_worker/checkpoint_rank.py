"""One rank of the checkpoint/resume equivalence test (a fresh process per rank): prefill and
decode uninterrupted; then prefill again with checkpoints, stopped after STOP_AFTER chunks (every
rank agrees, as on a cancel); then a new engine continues from this rank's checkpoint."""

import json
import sys
from pathlib import Path
from typing import cast

from ring_worker.engine.checkpoint import Checkpointer, read_checkpoint
from ring_worker.engine.engines import Cancelled, Engine
from ring_worker.engine.group import join_group
from ring_worker.engine.strategies import make_engine
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny

CHUNK_TOKENS = 64
LENGTH = 600  # 10 chunks
EVERY_TOKENS = 128  # a checkpoint every second chunk
STOP_AFTER = 9  # chunks: the run is stopped at 90 %, its last checkpoint holds 512 tokens


def run(engine: Engine, home: Path, layout: str, rank: int) -> dict:
    tokens = prompt_tokens(LENGTH)
    whole = engine.prefill(tokens, CHUNK_TOKENS)
    expected = {"logits": whole.logits.tolist(), "tokens": engine.decode(whole, 16).tokens}
    saver = Checkpointer(home, "job-1", layout, rank, EVERY_TOKENS, budget_bytes=1 << 30)
    chunks_done: list[int] = []
    try:
        engine.prefill(
            tokens,
            CHUNK_TOKENS,
            on_progress=lambda _, done, total: chunks_done.append(done),
            should_stop=lambda: len(chunks_done) > STOP_AFTER,
            checkpoints=saver,
        )
        raise AssertionError("the prefill was not stopped")
    except Cancelled:
        pass
    saver.close()
    resume = read_checkpoint(home, "job-1", layout, rank)
    assert resume is not None
    resumed = engine.prefill(tokens, CHUNK_TOKENS, resume=resume)
    return {
        "expected": expected,
        "resumed_from": resume.tokens,
        "resumed": {"logits": resumed.logits.tolist(), "tokens": engine.decode(resumed, 16).tokens},
    }


def main() -> None:
    model_dir, rank, addresses, strategy, out_dir = sys.argv[1:6]
    group = join_group(json.loads(addresses), int(rank), Path(out_dir))
    engine = make_engine(load_tiny(Path(model_dir)), group, strategy, "rotate", "replicated")
    layout = f"{strategy}-{group.size()}"
    result = run(engine, Path(out_dir) / "home", layout, int(rank))
    (Path(out_dir) / f"result-rank{rank}.json").write_text(json.dumps(cast(dict, result)))


if __name__ == "__main__":
    main()
