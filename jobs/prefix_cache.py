"""Automatic prefix reuse: which kept KV prefix a job's prompt can start from.

Keys: a prompt is cut into blocks of BLOCK_TOKENS; block i's key is sha256(key of block i-1 ||
its token ids), seeded with the model's identity (`model_key`), as vLLM's automatic prefix caching
does, so a prompt's longest kept prefix is its longest run of keys in the index (one pipelined
round trip). 256 is mlx-lm's KVCache growth step and gives a 128K document 512 keys. Keys only
find an entry: the rank then reuses the exact common prefix, mid-block included
(`exact_reuse_tokens`). Prompts shorter than one block are never matched.

Entries: one job's kept prompt KV is one `CacheEntry` of `CacheShard` files, each holding some
layers at some positions (rank 0 holds everything for single and replicated rings; every rank its
zigzag blocks for a sharded ring; every stage its layers for a pipeline). Attention over a past is
order-free, so any layout is rebuilt from any other by cutting and concatenating
(ring_worker/engine/kv_reshard.py), wherever the ranks can read the files.

The index is jobs/prefix_index.py, the files ring_worker/runtime/cache_store.py, placement by a
kept or in-flight prefix jobs/admit_plan.py, the in-memory copy ring_worker/engine/memory_tier.py.

Every prompt's KV is kept in memory; on disk only where the job's wait for the write is a small
share of the prefill the file saves (`worth_a_file`: CPU nodes, not GPUs), and unless it adds
less than KEEP_MIN_NEW_FRACTION beyond the prefix it reused (eight questions on one document
keep the document once). RINGQ_PREFIX_CACHE=off turns matching and keeping off."""

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from admission.vocabulary import KVLayout, Strategy

BLOCK_TOKENS = 256
KEEP_MIN_NEW_FRACTION = 0.25
WAIT_MIN_FRACTION = 0.5  # of a prompt an in-flight prefill must stand for, for a job to wait
PENDING_TTL_S = 3600.0  # an in-flight marker's safety expiry (one of an ended job is ignored)
WRITE_BYTES_PER_S = 1e9  # a 128K prompt's 16 GiB file writes in 18 s on an H100 host
FILE_WAIT_SHARE = 0.1  # of the prefill a file saves: the most a job waits for its write
PENDING_GRACE_S = 60.0  # a finished job's marks still count this long (its KV is being kept)

Layout = Strategy  # the layout an entry was kept by: the strategy that prefilled it


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CacheShard(_Message):
    """One file of an entry: layers [layer_start, layer_stop) at the positions in `ranges`
    (half-open, in the order the file holds them)."""

    node: str
    rank: int
    file: str  # absolute path on `node`
    layer_start: int
    layer_stop: int
    ranges: list[tuple[int, int]]
    bytes: int

    def positions(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


class CacheEntry(_Message):
    """One kept prompt prefix: `tokens` positions of KV over all layers, spread over shards."""

    id: str  # the job that computed it
    model_key: str
    tokens: int
    layout: Layout
    ranks: int = Field(default=1, validation_alias=AliasChoices("ranks", "ring_size"))
    kv_layout: KVLayout = "replicated"
    kv_dtype: str
    shards: list[CacheShard]
    pinned: bool = False
    created_at: float
    last_used_at: float
    blocks: int = Field(ge=0)  # full blocks indexed (tokens // BLOCK_TOKENS)

    def nodes(self) -> list[str]:
        return sorted({s.node for s in self.shards})

    def model_name(self) -> str:
        """The model as a user named it: a preset, or a file's or folder's name."""
        kind, _, rest = self.model_key.partition(":")
        if kind in ("gguf", "hf"):
            return PurePath(rest.split(":")[0]).name
        return rest or self.model_key

    def describe(self) -> str:
        """For `ringq status` / `ringq cache list`: e.g. 'ring-2 sharded on n1,n2'."""
        shape = self.layout if self.layout == "single" else f"{self.layout}-{self.ranks}"
        if self.layout == "ring":
            shape += f" {self.kv_layout}"
        return f"{shape} on {','.join(self.nodes())}"


@dataclass(frozen=True)
class PrefixHint:
    """What the dispatcher read about a job's prompt prefix (block level): the best kept entry
    and the longest prefill of the same prefix in flight."""

    kept_tokens: int = 0
    kept_nodes: tuple[str, ...] = ()
    kept_from: str | None = None  # e.g. "job 3f2a (ring-2 sharded on n1,n2)"
    pending_job: str | None = None
    pending_tokens: int = 0


def wait_for_pending(hint: PrefixHint, prompt_tokens: int) -> str | None:
    """Why to wait for an in-flight prefill of this prompt's prefix, or None to go ahead: the
    wait costs at most that prefill, which this job would otherwise repeat."""
    gain = hint.pending_tokens - hint.kept_tokens
    if hint.pending_job is None or gain < WAIT_MIN_FRACTION * prompt_tokens:
        return None
    return (
        f"waiting for job {hint.pending_job}, which is prefilling the same "
        f"{hint.pending_tokens}-token prefix: this job then computes only the rest"
    )


def block_keys(
    model_key: str, tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS
) -> list[str]:
    """The hash chain over the prompt's full blocks (a trailing partial block has no key)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, not {block_tokens}")
    digest = hashlib.sha256(model_key.encode()).digest()
    keys = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = array("q", tokens[start : start + block_tokens]).tobytes()
        digest = hashlib.sha256(digest + block).digest()
        keys.append(digest.hex()[:32])
    return keys


def longest_present(present: Sequence[bool]) -> int:
    """How many leading blocks are present (the chain makes presence a prefix property, but a
    half-deleted entry could leave holes: stop at the first one)."""
    for index, here in enumerate(present):
        if not here:
            return index
    return len(present)


def common_prefix_tokens(kept: Sequence[int], tokens: Sequence[int]) -> int:
    same = 0
    for a, b in zip(kept, tokens, strict=False):
        if a != b:
            break
        same += 1
    return same


def exact_reuse_tokens(kept: Sequence[int], tokens: Sequence[int]) -> int:
    """Prompt tokens a kept prefix can stand for: the exact common prefix (mid-block too), less
    one when it covers the whole prompt (the last prompt token's logits start the decode)."""
    return min(common_prefix_tokens(kept, tokens), len(tokens) - 1)


def worth_keeping(prompt_tokens: int, reused_tokens: int) -> bool:
    """Keep a job's prompt KV unless it adds too little beyond the prefix it reused."""
    if prompt_tokens < BLOCK_TOKENS:
        return False
    return prompt_tokens - reused_tokens >= KEEP_MIN_NEW_FRACTION * prompt_tokens


def worth_a_file(recompute_s: float, file_bytes: int) -> bool:
    """Whether a prompt's KV is also written to disk: only where the group's wait for the
    write (it runs before the job's decode and result) is at most FILE_WAIT_SHARE of the prefill
    the file would save; reading it back then costs less than recomputing too. A CPU node
    prefills ~100x slower than a GPU and keeps its files (SmolLM2 at 4K: 0.2 s of write against
    3 s of prefill); a GPU group keeps prompts in memory only up to about 1M tokens (an H200
    prefills 128K tokens of the 8B shape in ~11 s, the file takes ~17 s to write; a 524K prompt
    of the Qwen2.5-1M shape took 47.5 s to write against its 108 s prefill on an H100; the
    prefill grows with the square of the length, the file with the length). Unknown (0) times
    keep the file."""
    return recompute_s <= 0 or file_bytes / WRITE_BYTES_PER_S <= FILE_WAIT_SHARE * recompute_s


def choose_entry(entries: Sequence[CacheEntry], node_order: Sequence[str]) -> CacheEntry | None:
    """Among entries sharing the longest matched prefix: the one on the earliest node of
    `node_order` (the caller's preference, e.g. the node it runs on), then the longest, then the
    most recently used."""
    if not entries:
        return None
    rank = {name: i for i, name in enumerate(node_order)}

    def preference(entry: CacheEntry) -> tuple[int, int, float]:
        where = min((rank.get(n, len(rank)) for n in entry.nodes()), default=len(rank))
        return where, -entry.tokens, -entry.last_used_at

    return min(entries, key=preference)
