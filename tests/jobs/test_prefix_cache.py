"""The hash chain, the longest-prefix match, and the Redis index of kept prefixes."""

import time

import pytest

from jobs.prefix_cache import (
    BLOCK_TOKENS,
    CacheEntry,
    CacheShard,
    PrefixHint,
    block_keys,
    choose_entry,
    exact_reuse_tokens,
    longest_present,
    wait_for_pending,
    worth_a_file,
    worth_keeping,
)
from jobs.prefix_index import PendingPrefixes, PrefixIndex

DOC = list(range(1000, 1000 + 3 * BLOCK_TOKENS + 40))  # 3 full blocks and a partial one


def entry(entry_id: str, tokens: int, node: str = "n1", used_at: float = 1.0) -> CacheEntry:
    shard = CacheShard(
        node=node, rank=0, file=f"/c/{entry_id}", layer_start=0, layer_stop=2,
        ranges=[(0, tokens)], bytes=10,
    )  # fmt: skip
    return CacheEntry(
        id=entry_id, model_key="m", tokens=tokens, layout="single", kv_dtype="float32",
        shards=[shard], created_at=used_at, last_used_at=used_at, blocks=tokens // BLOCK_TOKENS,
    )  # fmt: skip


def test_block_keys_cover_full_blocks_only_and_chain():
    keys = block_keys("m", DOC)
    assert len(keys) == 3
    assert block_keys("m", DOC[: 2 * BLOCK_TOKENS]) == keys[:2]
    assert block_keys("m", DOC[: BLOCK_TOKENS - 1]) == []
    assert block_keys("other model", DOC)[0] != keys[0]
    changed = [DOC[0] + 1, *DOC[1:]]  # a change in block 0 changes every later key
    assert all(a != b for a, b in zip(block_keys("m", changed), keys, strict=True))
    late = DOC[: 2 * BLOCK_TOKENS] + [7] * BLOCK_TOKENS
    assert block_keys("m", late)[:2] == keys[:2] and block_keys("m", late)[2] != keys[2]


@pytest.mark.parametrize(
    ("present", "expected"),
    [([], 0), ([False], 0), ([True, True, False], 2), ([True, False, True], 1), ([True] * 4, 4)],
)
def test_longest_present(present, expected):
    assert longest_present(present) == expected


@pytest.mark.parametrize(
    ("kept", "tokens", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3),  # a prefix that ends anywhere, mid-block included
        ([1, 2, 3], [1, 2, 3], 2),  # the whole prompt: its last token is computed again
        ([1, 2, 3], [1, 9, 3, 4], 1),  # diverges inside
        ([5], [1, 2], 0),
    ],
)
def test_exact_reuse_tokens(kept, tokens, expected):
    assert exact_reuse_tokens(kept, tokens) == expected


@pytest.mark.parametrize(
    ("prompt", "reused", "keep"),
    [(100, 0, False), (1000, 0, True), (1000, 900, False), (1000, 750, True)],
)
def test_worth_keeping(prompt, reused, keep):
    assert worth_keeping(prompt, reused) is keep


def test_choose_entry_prefers_the_named_node_then_longer_then_recent():
    a, b, c = entry("a", 600, "n2", 5.0), entry("b", 700, "n1", 1.0), entry("c", 700, "n1", 2.0)
    assert choose_entry([a, b, c], ["n1"]).id == "c"
    assert choose_entry([a, b, c], ["n2", "n1"]).id == "a"
    assert choose_entry([], ["n1"]) is None


def test_describe_names_layout_and_nodes():
    sharded = entry("s", 600).model_copy(update={"layout": "ring", "ranks": 2,
                                                 "kv_layout": "sharded"})  # fmt: skip
    assert sharded.describe() == "ring-2 sharded on n1"
    assert entry("x", 600).describe() == "single on n1"


def test_index_finds_the_longest_kept_prefix_and_forgets_removed_entries(redis_conn):
    index = PrefixIndex(redis_conn)
    now = time.time()
    short = entry("short", 2 * BLOCK_TOKENS, used_at=now)
    whole = entry("whole", len(DOC), used_at=now)
    index.add(short, DOC)
    index.add(whole, DOC)
    question = DOC + [1, 2, 3]
    found = index.match("m", question)
    assert found.blocks == 3 and [e.id for e in found.entries] == ["whole"]
    assert index.tokens("whole") == DOC
    assert index.match("another model", question).blocks == 0
    diverging = DOC[: BLOCK_TOKENS + 10] + [5] * 600  # diverges inside block 1
    found = index.match("m", diverging)
    assert found.blocks == 1 and {e.id for e in found.entries} == {"short", "whole"}
    index.remove("whole")
    assert index.match("m", question).blocks == 2
    assert [e.id for e in index.listing() if e.model_key == "m"] == ["short"]
    index.remove("short")
    assert index.match("m", question).blocks == 0
    assert [e for e in index.listing() if e.model_key == "m"] == []


def test_touch_moves_an_entry_to_the_front(redis_conn):
    index = PrefixIndex(redis_conn)
    index.add(entry("old", BLOCK_TOKENS, used_at=1.0), DOC)
    index.add(entry("new", BLOCK_TOKENS, used_at=2.0), DOC)
    index.touch("old", now=3.0)
    assert [e.id for e in index.listing() if e.model_key == "m"] == ["old", "new"]
    assert index.get("old").last_used_at == 3.0
    for entry_id in ("old", "new"):
        index.remove(entry_id)


def test_pending_prefixes_mark_find_and_clear(redis_conn):
    pending = PendingPrefixes(redis_conn, ttl_s=60)
    pending.mark("job-a", "pm", DOC)
    question = DOC[: 2 * BLOCK_TOKENS] + [9] * BLOCK_TOKENS
    assert pending.longest("pm", question) == ("job-a", 2)
    assert pending.longest("pm", DOC + [1]) == ("job-a", 3)
    assert pending.longest("other", DOC) is None
    pending.clear("job-b", "pm", DOC)  # not its markers
    assert pending.longest("pm", DOC) == ("job-a", 3)
    pending.clear("job-a", "pm", DOC)
    assert pending.longest("pm", DOC) is None


def test_pending_markers_expire(redis_conn):
    pending = PendingPrefixes(redis_conn, ttl_s=0.05)
    pending.mark("job-x", "px", DOC)
    time.sleep(0.2)
    assert pending.longest("px", DOC) is None


@pytest.mark.parametrize(
    ("hint", "prompt", "waits"),
    [
        (PrefixHint(), 1000, False),
        (PrefixHint(pending_job="a", pending_tokens=768), 1000, True),
        (PrefixHint(pending_job="a", pending_tokens=256), 1000, False),  # too little of it
        (PrefixHint(768, ("n1",), "b", "a", 768), 1000, False),  # already kept
    ],
)
def test_wait_for_pending(hint, prompt, waits):
    reason = wait_for_pending(hint, prompt)
    assert (reason is not None) is waits
    if waits:
        assert "job a" in reason


GIB = 1024**3


@pytest.mark.parametrize(
    ("recompute_s", "file_bytes", "keep"),
    [
        (0.11, GIB // 2, False),  # H200, 8B shape, 4K prompt
        (11.8, 16 * GIB, False),  # the same at 128K
        (3.0, 180 * 1024**2, True),  # CPU, SmolLM2 at 4K
        (30.0, 16 * GIB, False),  # a prefill three times the H200's: the job would wait 17 s
        (108.0, 30 * GIB, False),  # H100, Qwen2.5-1M shape at 524K: 32 s of wait
        (400.0, 16 * GIB, True),  # a wait of 4 % of the prefill it saves
        (12.0, 2 * GIB, False),  # a wait of 18 %
        (0.0, 16 * GIB, True),  # no timing: keep
    ],
)
def test_worth_a_file(recompute_s, file_bytes, keep):
    assert worth_a_file(recompute_s, file_bytes) is keep
