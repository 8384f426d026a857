"""Prefill checkpoints: storage (per rank a chain of segments, each the KV added since the last,
written atomically, a disk budget, deleted with the job) and resume, which must give exactly the
uninterrupted run's logits and greedy tokens (float32, CPU): on one device in-process, and on a
real 2-rank ring."""

import json
import threading
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from ring_worker.engine import checkpoint
from ring_worker.engine.checkpoint import (
    Checkpointer,
    Resume,
    agree_on_resume,
    checkpoint_bytes,
    checkpoint_dir,
    delete_checkpoints,
    disk_room,
    end_checkpoints,
    read_checkpoint,
    read_segment,
    saved_tokens,
    segment_chain,
    snapshot,
    start_checkpoints,
    unflatten,
)
from ring_worker.engine.engines import Engine
from ring_worker.engine.group import free_loopback_ports
from ring_worker.runtime.processes import rank_environment, spawn_rank, wait_all
from tests.helpers import wait_for
from tests.ring_worker.checkpoint_rank import run
from tests.ring_worker.equivalence_rank import prompt_tokens
from tests.ring_worker.tiny import load_tiny, save_tiny


def filled_cache(tokens: int, layers: int = 2) -> list[KVCache]:
    cache = [KVCache() for _ in range(layers)]
    for i, layer in enumerate(cache):
        keys = mx.random.normal((1, 2, tokens, 16), key=mx.random.key(i))
        layer.update_and_fetch(keys, keys * 2)
    return cache


@pytest.mark.parametrize(
    ("saved", "done", "due"), [(0, 63, False), (0, 64, True), (64, 127, False), (64, 192, True)]
)
def test_a_checkpoint_is_due_each_time_the_prompt_passes_a_multiple(
    short_tmp_path, saved, done, due
):
    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, every_tokens=64, budget_bytes=1 << 30)
    saver.saved_tokens = saved
    assert saver.due(done) is due
    saver.close()


def grow(cache: list[KVCache], tokens: int) -> None:
    for i, layer in enumerate(cache):
        keys = mx.random.normal((1, 2, tokens, 16), key=mx.random.key(100 + i))
        layer.update_and_fetch(keys, keys * 3)


def test_each_checkpoint_writes_what_was_added_and_the_chain_reads_back(short_tmp_path):
    saver = Checkpointer(short_tmp_path, "j", "ring-2", 1, every_tokens=64, budget_bytes=1 << 30)
    cache = filled_cache(40)  # a ring rank holds a share of the prompt's tokens
    saver.save(cache, 64, {"ring_position": "64"})
    grow(cache, 24)
    saver.save(cache, 128, {"ring_position": "128"})
    saver.close()
    assert sorted(p.name for p in checkpoint_dir(short_tmp_path, "j").iterdir()) == [
        "ring-2-rank1-0-64.safetensors",
        "ring-2-rank1-64-128.safetensors",
    ]
    resume = read_checkpoint(short_tmp_path, "j", "ring-2", 1)
    assert resume is not None and resume.tokens == 128
    assert resume.state == {"ring_position": "128"}
    for got, want in zip(resume.cache, cache, strict=True):
        assert got.offset == 64
        assert mx.array_equal(got.keys, want.keys[..., :64, :])
        assert mx.array_equal(got.values, want.values[..., :64, :])
    earlier = read_checkpoint(short_tmp_path, "j", "ring-2", 1, upto_tokens=100)
    assert earlier is not None and earlier.tokens == 64 and earlier.cache[0].offset == 40
    assert earlier.state == {"ring_position": "64"}
    assert saved_tokens(short_tmp_path, "j", "ring-2", 2) == 0  # rank 0 has none
    assert read_checkpoint(short_tmp_path, "j", "ring-2", 0) is None


def test_no_checkpoint_is_due_while_the_writer_is_busy(short_tmp_path):
    """The service's prefill never waits for the disk: while a segment is being written (its
    writer held here in on_change), boundaries are passed over; the next segment starts where
    the last one ended."""
    writing, release = threading.Event(), threading.Event()

    def hold(tokens: int) -> None:
        writing.set()
        release.wait(30)

    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, 64, 1 << 30, hold, True)
    cache = filled_cache(64)
    saver.save(cache, 64, {})
    assert writing.wait(30)
    grow(cache, 64)
    assert not saver.due(128)  # skipped: still writing the first
    grow(cache, 64)
    release.set()
    wait_for(lambda: saver.due(192), "the writer to be idle", 30)
    saver.save(cache, 192, {})
    saver.close()
    assert sorted(p.name for p in checkpoint_dir(short_tmp_path, "j").iterdir()) == [
        "single-1-rank0-0-64.safetensors",
        "single-1-rank0-64-192.safetensors",
    ]
    resume = read_checkpoint(short_tmp_path, "j", "single-1", 0)
    assert resume is not None and resume.tokens == 192 and resume.cache[0].offset == 192


def test_checkpoints_over_the_disk_budget_are_skipped(short_tmp_path):
    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, every_tokens=64, budget_bytes=1000)
    saver.save(filled_cache(64), 64, {})
    saver.close()
    assert saver.skipped == 1 and checkpoint_bytes(short_tmp_path) == 0


@pytest.mark.parametrize(("reserve", "written"), [(0.0, True), (1.0, False)])
def test_without_a_budget_checkpoints_keep_the_disk_reserve_free(
    short_tmp_path, monkeypatch, reserve, written
):
    monkeypatch.setattr(checkpoint, "DISK_RESERVE", reserve)
    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, every_tokens=64, budget_bytes=None)
    saver.save(filled_cache(64), 64, {})
    saver.close()
    assert (saver.skipped == 0) is written
    assert (checkpoint_bytes(short_tmp_path) > 0) is written


@pytest.mark.parametrize(
    ("used", "free", "size", "room"),
    [
        (17e9, 64e9, 50e9, True),  # a 252 GB disk with 64 GB free: 8.1 GB stays free
        (17e9, 64e9, 57e9, False),
        (0.0, 100e9, 90e9, True),
        (0.0, 100e9, 91e9, False),
    ],
)
def test_the_disk_reserve_is_a_tenth_of_the_space_within_reach(used, free, size, room):
    usage = SimpleNamespace(total=252e9, used=used, free=free)  # as shutil.disk_usage
    assert disk_room(usage, int(size)) is room


@pytest.mark.parametrize(
    ("counts", "agreed"),
    [([128, 128], True), ([128, 0], False), ([0, 0], False), ([128, 256], False)],
)
def test_ranks_resume_only_when_every_part_holds_the_same_tokens(counts, agreed):
    resume = Resume([], counts[0], {})
    assert (agree_on_resume(resume, lambda mine: counts) is resume) is agreed


def test_checkpoints_are_off_at_zero_tokens(short_tmp_path):
    off = start_checkpoints(short_tmp_path, 0, 1 << 30, "j", "single-1", 0, lambda m: [m], 64, 99)
    assert off == (None, None)


def test_ranks_whose_writers_lagged_resume_from_the_furthest_common_point(short_tmp_path):
    """Rank 0 wrote segments up to 128 tokens, rank 1 (killed) only up to 64: both go on from 64,
    rank 0 from the first of its segments."""
    saver = Checkpointer(short_tmp_path, "j", "ring-2", 0, every_tokens=64, budget_bytes=1 << 30)
    cache = filled_cache(32)
    saver.save(cache, 64, {})
    grow(cache, 32)
    saver.save(cache, 128, {})
    saver.close()
    started = start_checkpoints(
        short_tmp_path, 64, 1 << 30, "j", "ring-2", 0, lambda m: [m, 64], 64, 999
    )
    assert started[1] is not None and started[1].tokens == 64
    assert started[1].cache[0].offset == 32
    assert started[0] is not None and started[0].saved_offset == 32
    end_checkpoints(started[0], keep=True)


def test_a_rank_deletes_its_part_when_its_prefill_is_done(short_tmp_path):
    savers = [
        start_checkpoints(
            short_tmp_path, 64, 1 << 30, "j", "ring-2", rank, lambda m: [m, m], 64, 1000
        )[0]
        for rank in range(2)
    ]
    for saver in savers:
        assert saver is not None
        saver.save(filled_cache(64), 64, {})
    end_checkpoints(savers[0], keep=True)
    end_checkpoints(savers[1], keep=False)
    assert savers[1].join(30)
    assert [p.name for p in checkpoint_dir(short_tmp_path, "j").iterdir()] == [
        "ring-2-rank0-0-64.safetensors"
    ]
    both = start_checkpoints(
        short_tmp_path, 64, 1 << 30, "j", "ring-2", 0, lambda m: [m, m], 64, 99
    )
    assert both[1] is not None and both[1].tokens == 64
    end_checkpoints(both[0], keep=True)
    other_chunks = start_checkpoints(
        short_tmp_path, 64, 1 << 30, "j", "ring-2", 0, lambda m: [m, m], 48, 99
    )
    assert other_chunks[1] is None  # 64 tokens is no boundary of 48-token chunks
    end_checkpoints(other_chunks[0], keep=True)
    resumed = start_checkpoints(
        short_tmp_path, 64, 1 << 30, "j", "ring-2", 0, lambda m: [m, 0], 64, 99
    )
    assert resumed[1] is None  # rank 1's part is gone: both start from 0
    end_checkpoints(resumed[0], keep=False)
    assert resumed[0] is not None and resumed[0].join(30)
    assert not checkpoint_dir(short_tmp_path, "j").exists()


@pytest.mark.parametrize("keep", [False, True])
def test_a_finished_prefill_waits_for_no_disk_write(short_tmp_path, keep):
    """A finished prefill (keep=False) returns at once, while the writer still writes: the
    queued segment is dropped unwritten, and the writer deletes the chain once it is done. A
    failed one (keep=True) waits for both segments, for the retry."""
    writing, release = threading.Event(), threading.Event()
    written: list[int] = []

    def hold(tokens: int) -> None:
        written.append(tokens)
        writing.set()
        release.wait(30)

    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, 64, 1 << 30, hold, True)
    cache = filled_cache(64)
    saver.save(cache, 64, {})  # being written, held in `hold`
    assert writing.wait(30)
    grow(cache, 64)
    saver.save(cache, 128, {})  # queued behind it
    if keep:
        threading.Timer(0.2, release.set).start()
    end_checkpoints(saver, keep=keep)
    assert keep or not release.is_set()  # returned while the writer was still held
    release.set()
    assert saver.join(30)
    assert written == ([64, 0] if not keep else [64, 128])
    names = sorted(p.name for p in saver.folder.glob("*")) if saver.folder.is_dir() else []
    want = ["single-1-rank0-0-64.safetensors", "single-1-rank0-64-128.safetensors"]
    assert names == ([] if not keep else want)


@pytest.mark.parametrize(
    ("after_s", "projected_s", "taken"), [(60, 59.9, False), (60, 60, True), (0, 0, True)]
)
def test_only_a_prefill_projected_past_the_line_takes_checkpoints(
    short_tmp_path, after_s, projected_s, taken
):
    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, 64, 1 << 30, after_s=after_s)
    assert saver.due(64) is (after_s == 0)  # undecided: only a zero line takes them at once
    saver.decide(projected_s)
    assert saver.due(64) is taken
    saver.close()


def test_deleting_a_jobs_checkpoints_frees_their_bytes(short_tmp_path):
    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, every_tokens=64, budget_bytes=1 << 30)
    saver.save(filled_cache(64), 64, {})
    saver.close()
    held = checkpoint_bytes(short_tmp_path)
    assert held > 2 * 2 * 2 * 64 * 16 * 4  # layers * (K, V) * heads * tokens * dim * 4 bytes
    assert delete_checkpoints(short_tmp_path, "j") == held
    assert not checkpoint_dir(short_tmp_path, "j").exists()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-ckpt"), "llama")


def test_a_resumed_prefill_equals_an_uninterrupted_one_on_one_device(tiny_dir, short_tmp_path):
    result = run(Engine(load_tiny(tiny_dir)), short_tmp_path, "single-1", 0)
    assert result["resumed_from"] == 512
    assert result["resumed"] == result["expected"]


def test_a_resumed_ring_prefill_equals_an_uninterrupted_one(tiny_dir, short_tmp_path):
    addresses = [f"127.0.0.1:{port}" for port in free_loopback_ports(2)]
    argv = ["-m", "tests.ring_worker.checkpoint_rank", str(tiny_dir)]
    procs = [
        spawn_rank(
            [*argv, str(rank), json.dumps(addresses), "ring", str(short_tmp_path)],
            rank_environment(threads=1),
        )
        for rank in range(2)
    ]
    assert wait_all(procs, timeout_s=300) == [0, 0]
    for rank in range(2):
        result = json.loads((short_tmp_path / f"result-rank{rank}.json").read_text())
        assert result["resumed_from"] == 512
        assert result["resumed"] == result["expected"]
    assert saved_tokens(short_tmp_path / "home", "job-1", "ring-2", 2) == 512


def test_a_lagging_writer_holds_at_most_two_segments_then_the_prefill_waits(short_tmp_path):
    """Skipping while the writer is busy must not let one segment grow without bound (its copy
    is memory, on a GPU device memory): past max_segment_tokens a checkpoint is due anyway, and
    a third segment waits until one of the two held is written."""
    writing, release = threading.Event(), threading.Event()

    def hold(tokens: int) -> None:
        writing.set()
        release.wait(30)

    saver = Checkpointer(
        short_tmp_path, "j", "single-1", 0, 64, 1 << 30, hold, True, max_segment_tokens=128
    )
    cache = filled_cache(64)
    saver.save(cache, 64, {})  # being written, held in `hold`
    assert writing.wait(30)
    grow(cache, 64)
    assert not saver.due(128)  # 64 unsaved tokens: skipped
    grow(cache, 64)
    assert saver.due(192)  # 128 unsaved: due although the writer is busy
    saver.save(cache, 192, {})  # queued: two segments held
    grow(cache, 128)
    assert saver.due(320)
    segment_bytes = sum(2 * layer.keys[..., 192:320, :].nbytes for layer in cache)
    before = mx.get_active_memory()
    held_then: list[int] = []

    def disk_catches_up() -> None:
        held_then.append(mx.get_active_memory() - before)
        release.set()

    threading.Timer(0.5, disk_catches_up).start()
    # on the compute thread, as in a prefill (MLX streams are per thread)
    saver.save(cache, 320, {})
    assert release.is_set()  # it returned only once the first segment was written
    assert held_then[0] < segment_bytes / 2, (held_then, segment_bytes)  # no third copy meanwhile
    saver.close()
    assert sorted(p.name for p in checkpoint_dir(short_tmp_path, "j").iterdir()) == [
        "single-1-rank0-0-64.safetensors",
        "single-1-rank0-192-320.safetensors",
        "single-1-rank0-64-192.safetensors",
    ]


def test_a_snapshot_keeps_its_own_copy_not_the_cache_buffer():
    """Held until written, a snapshot must not keep the cache's buffer alive (a view did: on a
    GPU that held a second copy of the KV while prefill went on)."""
    cache = KVCache()
    keys = mx.random.normal((1, 2, 1000, 16))
    cache.update_and_fetch(keys, keys + 1)
    mx.eval(cache.state)
    buffer_bytes = cache.keys.nbytes + cache.values.nbytes  # capacity 1024 positions
    segment = snapshot([cache], 900)
    (copy,) = unflatten(segment.flat, segment.shapes)
    assert copy.offset == 100
    assert mx.array_equal(copy.keys, keys[..., 900:, :])
    assert mx.array_equal(copy.values, keys[..., 900:, :] + 1)
    before = mx.get_active_memory()
    del cache, keys
    assert mx.get_active_memory() <= before - buffer_bytes * 0.9


@pytest.mark.parametrize("head_dims", [(16, 16), (16, 8)])
def test_a_segment_is_one_array_that_reads_back_as_the_layers(short_tmp_path, head_dims):
    """Layers alike are stacked into one array, layers of different shapes flattened into one;
    both read back from the file as each layer's keys and values, in their dtype."""
    caches, expected = [], []
    for dim in head_dims:
        cache = KVCache()
        keys = mx.random.normal((1, 2, 300, dim)).astype(mx.bfloat16)
        cache.update_and_fetch(keys, keys * 2)
        caches.append(cache)
        expected.append(keys[..., 100:, :])
    segment = snapshot(caches, 100)
    assert segment.flat.ndim == (5 if len(set(head_dims)) == 1 else 1)
    path = short_tmp_path / "segment.safetensors"
    segment.save(path, {"tokens": "300"})
    layers, metadata = read_segment(path)
    assert metadata == {"tokens": "300"}
    for layer, keys in zip(layers, expected, strict=True):
        assert layer.offset == 200 and layer.keys.dtype == mx.bfloat16
        assert mx.array_equal(layer.keys, keys) and mx.array_equal(layer.values, keys * 2)


@pytest.mark.parametrize(("after_s", "taken"), [(3600.0, False), (1e-6, True)])
def test_a_prefill_decides_after_its_first_chunk_whether_to_take_checkpoints(
    tiny_dir, short_tmp_path, after_s, taken
):
    """The engine projects the seconds a prefill still needs from its first chunk (by the
    prompt's FLOPs) and takes checkpoints only past RINGQ_CHECKPOINT_AFTER_S."""
    saver = Checkpointer(short_tmp_path, "j", "single-1", 0, 64, 1 << 30, after_s=after_s)
    Engine(load_tiny(tiny_dir)).prefill(prompt_tokens(512), 64, checkpoints=saver)
    saver.close()
    assert saver.taking is taken
    assert bool(segment_chain(short_tmp_path, "j", "single-1", 0)) is taken
