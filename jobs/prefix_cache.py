"""Automatic prefix reuse: which kept KV prefix a job's prompt can start from.

Design
------
Keys. A prompt is cut into fixed blocks of BLOCK_TOKENS = 256 tokens; block i's key is
sha256(key of block i-1 || token ids of block i), seeded with the model's identity
(`model_key`: the model name, plus size and mtime for a file on disk), as vLLM's automatic prefix
caching does. Equal keys mean equal prefixes, so the longest kept prefix of a prompt is its
longest run of keys present in the index (one pipelined round trip). 256 because:
- it is mlx-lm's KVCache growth step and LMCache's chunk size;
- a 128K document has 512 keys (cheap to hash and to look up);
- a question that diverges inside a document loses at most 255 tokens of reuse at block level,
  and none in practice: keys only *find* an entry; the rank then compares the entry's own tokens
  with the prompt and reuses the exact common prefix, mid-block included (`exact_reuse_tokens`).
  Prompts shorter than one block are never matched (nothing worth reusing).

Entries. One job's kept prompt KV is one `CacheEntry` (named by the job that computed it), made
of one or more `CacheShard` files, each holding some layers (all but for a pipeline stage) at
some token positions (all but for a sharded ring rank: its zigzag blocks, in cache order):
- single / ring-N replicated: rank 0 keeps one shard with everything;
- ring-N sharded: every rank keeps its own shard (its positions recorded as ranges);
- pipeline-N: every stage keeps its layers at every position.
Attention over a past is order-free (keys carry RoPE at absolute positions; the past is wholly
visible), so any layout can be rebuilt from any other by cutting and concatenating
(ring_worker/engine/kv_reshard.py): a ring-2 sharded cache answers on one node, a single cache
seeds a
ring-3 sharded one, etc., as long as the shard files can be read where the ranks run.

Index (Redis, jobs/prefix_index.py, names in jobs/keys.py): block key -> set of entry ids;
entry id -> JSON CacheEntry; entry id -> its prompt tokens (for the exact, mid-block match);
a sorted set of entries by last use for `ringq cache list`. Nothing is pickled.

Store (ring_worker/runtime/cache_store.py): per node agent, RINGQ_HOME/caches/<node>/, mlx-lm's
prompt
cache format (save_prompt_cache / load_prompt_cache, safetensors with string metadata), a byte
budget RINGQ_CACHE_BYTES (default: half of the disk's free space plus the store's own files, when
the store opens). Before a file is written, least-recently-used files are deleted until the new
one fits, unpinned first, pinned (--keep-cache) last; a file larger than the whole budget is not
kept and evicts nothing. Writes go to a
temporary name in the same directory (counted by the estimate) and are renamed. A file that does
not load (corrupt, truncated, wrong shapes) is logged, deleted and treated as absent: the job
recomputes.

Placement (jobs/admit_plan.py, from a `PrefixHint` the dispatcher reads per job):
- a job whose prefix another job is prefilling right now, standing for at least half its prompt
  beyond what is kept, waits for it (`wait_for_pending`): the wait is at most that prefill, which
  it would otherwise repeat. So `--prompt Q1 --prompt Q2 ...` and batch lines sharing a document
  give one prefill; the others then start from its KV (in the warm group's memory, or on disk);
- a job with a kept prefix prefers the nodes (and idle warm groups) that hold it, among those that
  can take it now; it never waits for them: if they are busy it runs elsewhere and reshards the
  files there if it can read them, else recomputes (a wait for busy nodes is unbounded, a
  recompute is bounded by one prefill);
- the ring-or-single choice counts only the tokens left to compute (a question on a kept 128K
  document runs on one node).

Memory tier: a rank holds the previous job's prompt KV (one, in memory); a warm group's next job
on the same document starts from it without reading a file. It counts against the group's
reservation (ring_worker/engine/memory_tier.py): beside a job it holds at most (the group's reserved
bytes per node - that job's own estimate, both on the placement); a larger copy leaves memory
before the prefill (its file, where one was kept, stays on disk), and a job that starts from the
copy takes it over. A job that joins a decoding batch can also start from a member's row: the
longest shared prompt prefix, copied out of the batch's KV only where it is longer than the
memory copy (ring_worker/batch_serve.member_row_prefix); the copy is that job's own KV.

When is a prompt kept: every job's prompt KV in memory; on disk unless writing the file and
reading it back would be slower than recomputing the prompt (`worth_a_file`: a GPU's), or it adds
less than KEEP_MIN_NEW_FRACTION of its prompt beyond the prefix it reused (the eight questions of
one document keep the document once, not eight times; a conversation that grows by a few turns
reuses the older entry and recomputes a little more). RINGQ_PREFIX_CACHE=off turns matching and
keeping off.
"""

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
# Reading a kept file back: 16 GiB in 6-9 s on an H200 (the 128K prefix cell of
# docs/prefix-reuse.md), page cache aside; CPU nodes read as fast and prefill far slower.
READ_BYTES_PER_S = 2e9
# Writing one, on the group's compute path after its job: 17.2 GB in 18.0 s on an H100 host
# (a 128K prompt of the 8B shape); the same file held its group for 29 s on an H200.
WRITE_BYTES_PER_S = 1e9
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
    """Why to wait for an in-flight prefill of this prompt's prefix, or None to go ahead.
    Waiting when it stands for at least half the prompt beyond what is kept costs at most that
    job's remaining prefill: about what this job would spend computing the same tokens, while
    the waiting leaves the nodes to other work."""
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
    """Whether a disk copy of a prompt's KV pays for itself at its first reuse: writing it (the
    group waits for that) and reading it back must beat recomputing the prompt. On a GPU it
    does not: an H200 prefills a 4K prompt of the 8B shape in ~0.1 s (its 0.5 GB file reads in
    ~0.25 s), and a 128K one in ~11 s, while its 16 GiB file takes ~17 s to write and 6-9 s to
    read; a GPU group keeps the prompt in memory only, for its next job. A CPU node prefills
    ~100x slower and keeps its files. Unknown (0) times keep the file."""
    seconds = file_bytes / READ_BYTES_PER_S + file_bytes / WRITE_BYTES_PER_S
    return recompute_s <= 0 or seconds < recompute_s


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
