"""Per-rank memory a job needs, from the model's shape alone (pure).

For each layout (single; ring of N with replicated or sharded KV; pipeline of N), the busiest
rank's MLX peak is the larger of two phases, times a small margin:
- loading: its weights, plus (CPU nodes, which dequantize) the stored tensors and scales being
  converted, plus a dequantization transient for the embedding;
- prefill: its weights + its KV + the live tensors of one layer of one chunk.
Process overhead (interpreter, MLX runtime) comes on top. The constants are fitted against
`mx.get_peak_memory()` per rank on CPU (bench/calibrate_admission.py, docs/performance.md). On
GPUs (fused attention, weights kept as stored) the CPU terms drop out and measured GPU transients
come in instead (`gpu_transient_bytes`).
"""

from dataclasses import dataclass

from admission.model_shape import ModelShape
from admission.partition import PAST_TILE_TOKENS, split_layers
from admission.vocabulary import KVLayout, Strategy

PROCESS_OVERHEAD_BYTES = 256 * 1024**2  # interpreter, MLX runtime, tokenizer: outside MLX's count
MARGIN = 1.05  # on the MLX peak: measured peaks vary by a few MiB between runs
# Fitted on CPU (float32, OpenBLAS): live score-sized tensors per attention call.
SDPA_SCORE_COPIES = 1.3  # mlx-lm's attention (single, pipeline): MLX's CPU SDPA materialises scores
RING_SCORE_COPIES = 2.4  # ring partial attention: scores and their exp
SHARDED_SCORE_COPIES = 2.2  # sharded ring: partials over every rank's past, merged per layer
STORED_COPIES = 1.5  # dequantizing: packed weights plus float32 scales and biases
EMBEDDING_TRANSIENT = 0.6  # of the dense embedding, while it is dequantized
# Fitted on one H200 (bf16, 8B and 1B shapes, 8K-128K tokens, 16K chunks), prefill paced layer
# by layer (ring_worker/engine/pacing.py): about three layers' tensors are alive, and while
# mlx-lm's KVCache grows, about three layers' KV are copied at once.
GPU_ACTIVATION_COPIES = 3  # of one layer's hidden and MLP tensors for one chunk
GPU_KV_LAYER_COPIES = 3  # of one layer's KV (the cache's growth copies)
# Checkpoints (ring_worker/engine/checkpoint.py) hold at most HELD_SEGMENTS copies of at most
# max_segment_tokens each.
HELD_SEGMENTS = 2  # one being written, one queued


@dataclass(frozen=True)
class Layout:
    """How a job's model and KV are spread over its group's ranks."""

    strategy: Strategy
    size: int = 1
    kv_layout: KVLayout = "replicated"  # ring only: sharded keeps 1/N of the KV on each rank

    @property
    def label(self) -> str:
        if self.strategy == "single":
            return "single"
        suffix = f" ({self.kv_layout} KV)" if self.strategy == "ring" else ""
        return f"{self.strategy}-{self.size}{suffix}"


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    load_extra_bytes: int  # only while loading
    overhead_bytes: int = PROCESS_OVERHEAD_BYTES
    checkpoint_bytes: int = 0  # KV copies held for checkpoints during prefill

    @property
    def mlx_peak_bytes(self) -> int:
        """What mx.get_peak_memory() should report on this rank (calibrated)."""
        loading = self.weights_bytes + self.load_extra_bytes
        prefill = self.weights_bytes + self.kv_bytes + self.activation_bytes
        prefill += self.checkpoint_bytes
        return int(max(loading, prefill) * MARGIN)

    @property
    def total_bytes(self) -> int:
        return self.mlx_peak_bytes + self.overhead_bytes


def estimate_node_bytes(
    shape: ModelShape,
    prompt_tokens: int,
    max_new_tokens: int,
    layout: Layout,
    chunk_tokens: int,
    *,
    dense_weights: bool,
    checkpoint_tokens: int = 0,
) -> MemoryEstimate:
    """Bytes the busiest rank of `layout` needs. `dense_weights`: a CPU node (it dequantizes to
    float32 and its attention materialises scores). `checkpoint_tokens`: the prefill checkpoint
    interval (RINGQ_CHECKPOINT_TOKENS; 0: off)."""
    context = prompt_tokens + max_new_tokens
    held = checkpoint_held_tokens(prompt_tokens, chunk_tokens, checkpoint_tokens)
    per_rank = [
        _rank_estimate(
            shape, context, prompt_tokens, layout, chunk_tokens, rank, dense_weights, held
        )
        for rank in range(layout.size if layout.strategy == "pipeline" else 1)
    ]
    return max(per_rank, key=lambda e: e.total_bytes)


def max_segment_tokens(checkpoint_tokens: int, chunk_tokens: int) -> int:
    """The most prompt tokens one checkpoint segment covers when the writer lags: two intervals
    (or two chunks, when chunks are longer: checkpoints fall on chunk boundaries)."""
    return 2 * max(checkpoint_tokens, chunk_tokens)


def checkpoint_held_tokens(prompt_tokens: int, chunk_tokens: int, checkpoint_tokens: int) -> int:
    """Prompt tokens whose KV a rank's checkpoints may hold in memory at once during prefill:
    HELD_SEGMENTS segments, never more than the prompt before its last chunk; 0 when they are
    off or none is due (a prompt within one interval or one chunk)."""
    if checkpoint_tokens <= 0 or prompt_tokens <= max(checkpoint_tokens, chunk_tokens):
        return 0
    held = HELD_SEGMENTS * max_segment_tokens(checkpoint_tokens, chunk_tokens)
    return min(prompt_tokens - chunk_tokens, held)


def _rank_estimate(
    shape: ModelShape,
    context: int,
    prompt_tokens: int,
    layout: Layout,
    chunk_tokens: int,
    rank: int,
    cpu: bool,
    checkpoint_held: int = 0,
) -> MemoryEstimate:
    layers, params, embedding = _rank_parameters(shape, layout, rank)
    stored_per_param = shape.weight_bytes / shape.parameters
    resident = shape.compute_dtype_bytes if cpu else stored_per_param
    load_extra = 0
    if cpu and shape.weight_bytes < shape.dense_weight_bytes:
        load_extra = int(STORED_COPIES * params * stored_per_param)
        load_extra += int(EMBEDDING_TRANSIENT * embedding * shape.compute_dtype_bytes)
    kv_per_token_layer = shape.kv_bytes_per_token() // shape.layers
    kv_tokens = context
    if layout.strategy == "ring" and layout.kv_layout == "sharded":
        kv_tokens = -(-context // layout.size) + -(-chunk_tokens // layout.size)
    kv = kv_per_token_layer * layers * _cache_tokens(kv_tokens)
    held = kv_per_token_layer * layers * checkpoint_held
    if layout.strategy == "ring" and layout.kv_layout == "sharded":
        held = -(-held // layout.size)  # each rank checkpoints its own share
    weights = int(params * resident)
    activations = activation_bytes(shape, layout, prompt_tokens, chunk_tokens, cpu)
    if not cpu:
        activations = gpu_transient_bytes(kv // layers, activations)
    return MemoryEstimate(
        weights_bytes=weights,
        kv_bytes=kv,
        activation_bytes=activations,
        load_extra_bytes=load_extra,
        checkpoint_bytes=held,
    )


def gpu_transient_bytes(layer_kv: int, activations: int) -> int:
    """What a GPU rank's MLX peak holds beyond its weights and KV during prefill (fitted):
    `activations` is one layer's tensors for one chunk, `layer_kv` one layer's KV."""
    return int(GPU_ACTIVATION_COPIES * activations + GPU_KV_LAYER_COPIES * layer_kv)


def _rank_parameters(shape: ModelShape, layout: Layout, rank: int) -> tuple[int, int, int]:
    """(layers, parameters, embedding parameters) held by `rank`: all of them except in a
    pipeline, whose ranks hold contiguous layers; rank 0 also embeds, the last one also holds
    the LM head (the embedding again when they are tied)."""
    embedding = shape.embedding_parameters
    head = 0 if shape.tied_embeddings else embedding
    if layout.strategy != "pipeline" or layout.size == 1:
        return shape.layers, shape.parameters, embedding
    layers = len(split_layers(shape.layers, layout.size)[rank])
    per_layer = (shape.parameters - embedding - head - shape.hidden_size) / shape.layers
    first, last = rank == 0, rank == layout.size - 1
    embedding_here = embedding if first or (last and shape.tied_embeddings) else 0
    head_here = head if last else 0
    params = int(per_layer * layers) + embedding_here + head_here
    return layers, params, embedding_here


CACHE_STEP_TOKENS = 256  # mlx-lm's KVCache, and a decode batch's buffer, grow by this many


def _cache_tokens(tokens: int, step: int = CACHE_STEP_TOKENS) -> int:
    return -(-tokens // step) * step


def activation_bytes(
    shape: ModelShape, layout: Layout, prompt_tokens: int, chunk_tokens: int, cpu: bool
) -> int:
    """Live tensors while one layer of one chunk runs: hidden states, MLP, attention scores
    (CPU only; GPU attention is fused) and the last position's logits."""
    local = chunk_tokens
    keys, copies = prompt_tokens, SDPA_SCORE_COPIES
    if layout.strategy == "ring":
        local = -(-chunk_tokens // layout.size)
        past = max(prompt_tokens - chunk_tokens, 0)
        if layout.kv_layout == "sharded":  # every rank's share of the past, then this chunk's
            keys, copies = -(-past // layout.size) + local, SHARDED_SCORE_COPIES
        else:  # a tile of earlier chunks or a block pair of this one, whichever is larger
            keys, copies = max(min(past, PAST_TILE_TOKENS), local), RING_SCORE_COPIES
    local = min(local, prompt_tokens)
    width = shape.compute_dtype_bytes
    hidden = 4 * local * shape.hidden_size * width
    mlp = 3 * local * shape.intermediate_size * width
    scores = int(copies * shape.q_heads * local * keys * 4) if cpu else 0
    logits = shape.vocab_size * 4
    return hidden + mlp + scores + logits


@dataclass(frozen=True)
class BatchRow:
    """One sequence's row of a decode batch: the positions of its prompt and of its answer."""

    prompt_tokens: int
    answer_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.answer_tokens


def batch_buffer_tokens(longest_row: int, longest_answer: int) -> int:
    """Positions each row of a decode batch's buffer may need, in its 256-token steps: the rows
    are aligned at their ends, so a row joins at the column the longest row has reached and
    needs its own answer's room past it: the longest row plus the longest answer."""
    return _cache_tokens(longest_row + longest_answer)


def batch_row_bytes(
    shape: ModelShape, prompt_tokens: int, max_new_tokens: int, layout: Layout
) -> int:
    """One sequence's own row of a decode batch on the busiest rank (replicated on every rank;
    single). What its joining adds is more (jobs/warm_groups.py): every row of the batch's
    buffer is `batch_buffer_tokens` long, and rows grow by doubling."""
    if layout.strategy == "pipeline" or layout.kv_layout == "sharded":
        raise ValueError(f"{layout.label} does not decode in batches")
    tokens = _cache_tokens(prompt_tokens + max_new_tokens)
    return int(shape.kv_bytes_per_token() * tokens * MARGIN)
