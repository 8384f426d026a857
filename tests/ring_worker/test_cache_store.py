"""The bounded on-disk KV store: budget never exceeded, LRU eviction with pinned files last,
corrupt or truncated files ignored; and rebuilding a rank's cache from shards of any layout."""

import os

import mlx.core as mx
import pytest

from ring_worker.engine.kv_reshard import (
    ShardKV,
    build_cache,
    cache_arrays,
    clip_ranges,
    even_split,
)
from ring_worker.runtime.cache_store import (
    CacheStore,
    default_budget_bytes,
    estimate_bytes,
    read_cache_file,
)

METADATA = {"entry": "e"}


def layers(tokens: int, seed: int = 0, count: int = 2) -> list[tuple[mx.array, mx.array]]:
    key = mx.random.key(seed)
    return [
        (mx.random.normal((1, 2, tokens, 8), key=key), mx.random.normal((1, 2, tokens, 8)))
        for _ in range(count)
    ]


def size_of(tokens: int) -> int:
    return estimate_bytes(layers(tokens), METADATA)


def age(store: CacheStore, name: str, seconds_ago: float, pinned: bool = False) -> None:
    path = store.path_for(name, pinned)
    stamp = path.stat().st_mtime - seconds_ago
    os.utime(path, (stamp, stamp))


def test_a_saved_cache_loads_back_equal(tmp_path):
    store = CacheStore(tmp_path, 10**7)
    saved = layers(37)
    path = store.save("job.r0", saved, METADATA).path
    cache, metadata = store.load(path)
    assert metadata == METADATA
    for (k, v), layer in zip(saved, cache, strict=True):
        assert layer.offset == 37
        assert mx.array_equal(layer.keys[..., :37, :], k) and mx.array_equal(layer.values, v)


def test_the_disk_never_exceeds_the_budget_and_lru_goes_first(tmp_path):
    budget = 3 * size_of(100) + 10
    store = CacheStore(tmp_path, budget)
    for i in range(3):
        store.save(f"e{i}.r0", layers(100, i), METADATA)
        age(store, f"e{i}.r0", 100 - i)  # e0 oldest
    store.load(store.path_for("e0.r0"))  # used now: e1 becomes the oldest
    for i in range(3, 8):
        saved = store.save(f"e{i}.r0", layers(100, i), METADATA)
        assert saved.path is not None
        assert store.used_bytes() <= budget
    names = {f.name for f in store.files()}
    assert "e1.r0" not in names and len(names) == 3
    assert "e7.r0" in names


def test_pinned_files_are_evicted_last(tmp_path):
    budget = 2 * size_of(100) + 10
    store = CacheStore(tmp_path, budget)
    store.save("pin.r0", layers(100), METADATA, pinned=True)
    age(store, "pin.r0", 1000, pinned=True)  # the oldest of all, yet it stays
    for i in range(3):
        store.save(f"e{i}.r0", layers(100, i), METADATA)
        assert store.used_bytes() <= budget
    assert {f.name for f in store.files()} == {"pin.r0", "e2.r0"}
    store.save("big.r0", layers(150), METADATA)  # only fits once the pinned one goes too
    assert {f.name for f in store.files()} == {"big.r0"}
    assert store.used_bytes() <= budget


def test_a_file_larger_than_the_budget_is_not_kept_and_evicts_nothing(tmp_path):
    store = CacheStore(tmp_path, size_of(10) + 10)
    assert store.save("small.r0", layers(10), METADATA).path is not None
    saved = store.save("huge.r0", layers(500), METADATA)
    assert saved.path is None and saved.evicted == []
    assert [f.name for f in store.files()] == ["small.r0"]
    assert store.used_bytes() <= store.budget_bytes


def test_the_default_budget_counts_the_stores_own_files(tmp_path):
    root = tmp_path / "caches" / "n0"
    empty = default_budget_bytes(root)
    (root / "kept.safetensors").write_bytes(b"x" * 5 * 10**7)
    # without counting its own file the budget would be 25 MB less
    assert abs(default_budget_bytes(root) - empty) < 5 * 10**6


@pytest.mark.parametrize("damage", ["truncate", "header", "empty"])
def test_a_corrupt_file_reads_as_absent_with_a_warning(tmp_path, caplog, damage):
    store = CacheStore(tmp_path, 10**7)
    path = store.save("bad.r0", layers(64), METADATA).path
    data = path.read_bytes()
    broken = {"truncate": data[: len(data) // 2], "header": b"\xff" * 8 + data[8:], "empty": b""}
    path.write_bytes(broken[damage])
    assert store.load(path) is None
    assert "unreadable" in caplog.text
    assert not path.exists()  # deleted, so it never fails again


def test_drop_deletes_by_name(tmp_path):
    store = CacheStore(tmp_path, 10**7)
    store.save("a.r0", layers(8), METADATA, pinned=True)
    assert store.drop("a.r0") and not store.drop("a.r0")
    assert store.files() == []


def test_invalid_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="invalid cache file name"):
        CacheStore(tmp_path, 10).path_for("../x")


# -- resharding -------------------------------------------------------------------------------


def reference(tokens: int) -> list[tuple[mx.array, mx.array]]:
    """K/V whose values are their positions, so any cut can be checked."""
    position = mx.arange(tokens, dtype=mx.float32)[None, None, :, None]
    return [(position + 1000 * layer, -position) for layer in range(3)]


def shard_of(full, ranges, layer_start=0, layer_stop=3) -> ShardKV:
    picked = []
    for k, v in full[layer_start:layer_stop]:
        picked.append(
            (
                mx.concatenate([k[..., a:b, :] for a, b in ranges], axis=2),
                mx.concatenate([v[..., a:b, :] for a, b in ranges], axis=2),
            )
        )
    return ShardKV(layer_start, tuple(ranges), picked)


def positions(cache) -> list[list[int]]:
    return [layer.keys[0, 0, : layer.offset, 0].astype(mx.int32).tolist() for layer in cache]


def test_zigzag_shards_rebuild_a_whole_prefix_cut_anywhere():
    full = reference(40)
    ring = [shard_of(full, [(0, 5), (15, 20), (20, 25)]), shard_of(full, [(5, 15), (25, 40)])]
    cache = build_cache(ring, range(3), [(0, 33)])  # ends inside rank 1's last range
    assert positions(cache) == [[p + 1000 * layer for p in range(33)] for layer in range(3)]


def test_a_whole_cache_splits_into_pipeline_stages_and_ring_shares():
    full = [shard_of(reference(30), [(0, 30)])]
    stage = build_cache(full, range(1, 3), [(0, 30)])
    assert [p[0] for p in positions(stage)] == [1000, 2000]
    shares = [build_cache(full, range(3), even_split(30, r, 4)) for r in range(4)]
    assert [len(positions(s)[0]) for s in shares] == [8, 8, 7, 7]
    assert build_cache(full, range(3), [(0, 31)]) is None  # a position nobody holds


def test_pipeline_stages_join_into_one_cache():
    stages = [shard_of(reference(20), [(0, 20)], 0, 2), shard_of(reference(20), [(0, 20)], 2, 3)]
    cache = build_cache(stages, range(3), [(0, 20)])
    assert [p[0] for p in positions(cache)] == [0, 1000, 2000]


def test_a_cache_is_built_on_the_loaded_arrays_not_a_copy():
    # 4,000 positions: not a multiple of mlx-lm's 256-step buffers (a 4,096-long copy into a
    # fresh buffer is elided by MLX: the update covers it whole), like a 130,008-token prefix
    loaded = [(mx.random.normal((1, 8, 4000, 64)), mx.random.normal((1, 8, 4000, 64)))]
    mx.eval(loaded)
    shard = ShardKV(0, ((0, 4000),), loaded * 3)
    before = mx.get_active_memory()
    cache = build_cache([shard], range(3), [(0, 4000)])
    mx.eval([[c.keys, c.values] for c in cache])
    assert mx.get_active_memory() - before < loaded[0][0].nbytes  # a copy adds 6 of them
    assert cache[0].offset == 4000 and mx.array_equal(cache[2].values, loaded[0][1])


def test_running_out_of_memory_while_loading_keeps_the_file(tmp_path, monkeypatch):
    store = CacheStore(tmp_path, 10**7)
    path = store.save("job.r0", layers(16), METADATA).path

    def oom(*args, **kwargs):  # what MLX's CUDA allocator raised on the H200
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr("ring_worker.runtime.cache_store.load_prompt_cache", oom)
    with pytest.raises(RuntimeError, match="out of memory"):
        read_cache_file(path)
    assert path.is_file()


def test_cache_arrays_keep_the_prompt_of_a_live_cache():
    shard = shard_of(reference(40), [(10, 20), (0, 10), (30, 40)])
    live = build_cache([shard], range(3), shard.ranges)
    kept = cache_arrays(live, shard.ranges, clip_ranges(shard.ranges, 15))
    assert kept[0][0][0, 0, :, 0].astype(mx.int32).tolist() == [*range(10, 15), *range(10)]


@pytest.mark.parametrize(
    ("ranges", "end", "expected"),
    [([(0, 10), (20, 30)], 25, [(0, 10), (20, 25)]), ([(20, 30), (0, 10)], 5, [(0, 5)])],
)
def test_clip_ranges(ranges, end, expected):
    assert clip_ranges(ranges, end) == expected


def live_cache(prompt: int, answer: int, count: int = 8) -> list:
    """mlx-lm KVCaches as a prefill and decode leave them: the prompt, then `answer` more
    entries one at a time, in buffers with spare room (they grow in steps of 256)."""
    from mlx_lm.models.cache import KVCache

    caches = []
    for layer in range(count):
        cache = KVCache()
        keys = mx.random.normal((1, 4, prompt, 64), key=mx.random.key(layer))
        cache.update_and_fetch(keys, keys + 1)
        for step in range(answer):
            one = mx.full((1, 4, 1, 64), float(step))
            cache.update_and_fetch(one, one)
        caches.append(cache)
    mx.eval([(c.keys, c.values) for c in caches])
    return caches


def test_a_kept_prompt_is_written_from_whole_buffers_not_a_copy_of_them(tmp_path):
    """What a job keeps (prefix_reuse.prompt_only, then keep_shard) is the prompt's KV of a
    cache that also holds the answer: trimmed a layer at a time, it is written as it is. Views
    of the larger buffers made MLX copy every layer before writing (a second KV at the peak)."""
    from ring_worker.runtime.prefix_reuse import prompt_only

    prompt, answer = 1000, 5
    caches = live_cache(prompt, answer)
    expected = [(c.keys[..., :prompt, :], c.values[..., :prompt, :]) for c in caches]
    mx.eval(expected)  # views of the buffers the trim replaces: they keep the old ones
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in expected)

    positions = prompt_only(caches, [(0, prompt + answer)], prompt)

    assert positions == [(0, prompt)]
    assert all(c.offset == prompt and c.keys.shape[2] == prompt for c in caches)
    store = CacheStore(tmp_path, 10**9)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    saved = store.save("job.r0", cache_arrays(caches, positions, positions), METADATA)
    assert mx.get_peak_memory() - before < kv_bytes / 4  # a copy would be the whole kv_bytes
    loaded, _ = store.load(saved.path)
    for (k, v), layer in zip(expected, loaded, strict=True):
        assert mx.array_equal(layer.keys[..., :prompt, :], k)
        assert mx.array_equal(layer.values[..., :prompt, :], v)


def test_views_of_larger_buffers_are_copied_by_the_write(tmp_path):
    """The reason for the trim, checked on this MLX: a write of views costs a copy of them."""
    caches = live_cache(1000, 5)
    views = [(c.keys[..., :1000, :], c.values[..., :1000, :]) for c in caches]
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in views)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    CacheStore(tmp_path, 10**9).save("job.r0", views, METADATA)
    assert mx.get_peak_memory() - before >= kv_bytes * 0.9
