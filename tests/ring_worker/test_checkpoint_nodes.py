"""Checkpoints per node: the local nodes of `ringq up` share one RINGQ_HOME, yet each node's ranks
keep their parts in its own folder and count only those against their disk budget."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from ring_worker.engine.checkpoint import (
    Checkpointer,
    checkpoint_bytes,
    checkpoint_dir,
    end_checkpoints,
    start_checkpoints,
)
from ring_worker.runtime.checkpoint_sweep import sweep_checkpoints


def filled_cache(tokens: int) -> list[KVCache]:
    layer = KVCache()
    keys = mx.random.normal((1, 2, tokens, 16), key=mx.random.key(0))
    layer.update_and_fetch(keys, keys * 2)
    return [layer]


def one_segment(home, node: str, budget_bytes: int) -> Checkpointer:
    rank = int(node[-1])
    saver = Checkpointer(home, "j", "ring-2", rank, 64, budget_bytes, node=node)
    saver.save(filled_cache(64), 64, {})
    saver.close()
    return saver


def test_each_node_counts_only_its_own_parts_against_its_budget(short_tmp_path):
    segment_bytes = 2 * 2 * 64 * 16 * 4  # (K, V) * heads * tokens * dim * float32
    budget = segment_bytes + segment_bytes // 2  # one segment fits, two do not
    first = one_segment(short_tmp_path, "node-0", budget)
    second = one_segment(short_tmp_path, "node-1", budget)  # the shared home holds two now
    assert (first.skipped, second.skipped) == (0, 0)
    folder = checkpoint_dir(short_tmp_path, "j")
    parts = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors"))
    assert parts == ["node-0/ring-2-rank0-0-64.safetensors", "node-1/ring-2-rank1-0-64.safetensors"]
    node_0 = checkpoint_bytes(short_tmp_path, "node-0")
    assert node_0 > segment_bytes and checkpoint_bytes(short_tmp_path) == 2 * node_0

    over = Checkpointer(short_tmp_path, "k", "single-1", 0, 64, budget, node="node-0")
    over.save(filled_cache(64), 64, {})
    over.close()
    assert over.skipped == 1  # node-0's budget holds its part of job j already


def test_a_rank_resumes_from_and_deletes_its_nodes_part(short_tmp_path, redis_conn):
    one_segment(short_tmp_path, "node-0", 1 << 30)
    one_segment(short_tmp_path, "node-1", 1 << 30)

    def start(rank: int, node: str):
        return start_checkpoints(
            short_tmp_path, 64, 1 << 30, "j", "ring-2", rank, both_ranks_hold, 64, 999, node=node
        )

    saver, resume = start(0, "node-0")
    assert resume is not None and resume.tokens == 64
    end_checkpoints(saver, keep=False)
    assert saver is not None and saver.join(30)
    assert not (checkpoint_dir(short_tmp_path, "j") / "node-0").exists()
    elsewhere, none = start(0, "node-1")
    assert none is None  # rank 0's part was on node-0 only
    end_checkpoints(elsewhere, keep=True)

    store = JobStore(redis_conn)
    store.create("j", JobSpec(kind=JobKind.PREFILL, document="x", model="random:tiny-llama"))
    assert store.fail("j", "no more retries")
    assert sweep_checkpoints(store, short_tmp_path) == ["j"]  # node-1's part with the job
    assert checkpoint_bytes(short_tmp_path) == 0


def both_ranks_hold(mine: int) -> list[int]:
    """The ranks' agreement on a resume point, in one process: the other rank holds as much."""
    return [mine, mine]
