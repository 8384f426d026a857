"""Per-rank memory a job needs, from the model's shape alone (pure).

For each layout (single; ring of N with replicated or sharded KV; pipeline of N), the busiest
rank's MLX peak is the larger of two phases, times a small margin:
- loading: its weights, plus (CPU nodes, which dequantize) the stored tensors and scales being
  converted, plus a dequantization transient for the embedding;
- prefill: its weights + its KV + the live tensors of one layer of one chunk.
Process overhead (interpreter, MLX runtime) comes on top. The constants were fitted against
`mx.get_peak_memory()` per rank over a grid of models, lengths and layouts on CPU
(bench/calibrate_admission.py; the table is in bench/results/admission-calibration.md).
On GPUs (fused attention, weights kept as stored, the model's dtype) the CPU terms drop out and
measured GPU transients come in instead (`gpu_transient_bytes`), fitted on one H200 for single
ranks (bench/results/h200-service/README.md); ring and pipeline GPU cells need two GPUs.
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
# Fitted on one H200 (MLX CUDA 0.32.4, bf16, 8B and 1B shapes, 8K-128K tokens, chunks 4K-16K):
# mx.get_peak_memory() exceeded weights + KV + one layer's tensors by 0.8-12 GiB, about as much
# again as the weights for the 8B shape and growing with the context for the 1B one. Why is not
# known yet (MLX's CUDA allocator keeps freed buffers, and the peak may count them); these
# bound every measured cell from above (predicted / measured 1.00-1.69).
GPU_WEIGHT_TRANSIENT = 0.95  # of the rank's weights
GPU_KV_TRANSIENT = 0.5  # of its KV
GPU_ACTIVATION_COPIES = 6  # of one layer's hidden and MLP tensors for one chunk
GPU_CHUNK_LOGIT_COPIES = 0.5  # of vocab x chunk in the compute dtype


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

    @property
    def mlx_peak_bytes(self) -> int:
        """What mx.get_peak_memory() should report on this rank (calibrated)."""
        loading = self.weights_bytes + self.load_extra_bytes
        prefill = self.weights_bytes + self.kv_bytes + self.activation_bytes
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
) -> MemoryEstimate:
    """Bytes the busiest rank of `layout` needs. `dense_weights`: a CPU node (it dequantizes to
    float32 and its attention materialises scores)."""
    context = prompt_tokens + max_new_tokens
    per_rank = [
        _rank_estimate(shape, context, prompt_tokens, layout, chunk_tokens, rank, dense_weights)
        for rank in range(layout.size if layout.strategy == "pipeline" else 1)
    ]
    return max(per_rank, key=lambda e: e.total_bytes)


def _rank_estimate(
    shape: ModelShape,
    context: int,
    prompt_tokens: int,
    layout: Layout,
    chunk_tokens: int,
    rank: int,
    cpu: bool,
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
    weights = int(params * resident)
    activations = activation_bytes(shape, layout, prompt_tokens, chunk_tokens, cpu)
    if not cpu:
        activations = gpu_transient_bytes(shape, weights, kv, activations, chunk_tokens)
    return MemoryEstimate(
        weights_bytes=weights,
        kv_bytes=kv,
        activation_bytes=activations,
        load_extra_bytes=load_extra,
    )


def gpu_transient_bytes(
    shape: ModelShape, weights: int, kv: int, activations: int, chunk_tokens: int
) -> int:
    """What a GPU rank's MLX peak holds beyond its weights and KV during prefill (fitted)."""
    logits = shape.vocab_size * chunk_tokens * shape.compute_dtype_bytes
    return int(
        GPU_WEIGHT_TRANSIENT * weights
        + GPU_KV_TRANSIENT * kv
        + GPU_ACTIVATION_COPIES * activations
        + GPU_CHUNK_LOGIT_COPIES * logits
    )


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


def _cache_tokens(tokens: int, step: int = 256) -> int:
    """mlx-lm's KVCache grows in steps of 256 tokens."""
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


def batch_row_tokens(prompt_tokens: int, max_new_tokens: int) -> int:
    """Positions one sequence's row of a decode batch holds (ring_worker/batch_cache.py): its
    prompt and answer, in the buffer's 256-token steps."""
    return _cache_tokens(prompt_tokens + max_new_tokens)


def batch_row_bytes(
    shape: ModelShape, prompt_tokens: int, max_new_tokens: int, layout: Layout
) -> int:
    """One sequence's own row of a decode batch on the busiest rank (replicated on every rank;
    single). What its joining adds is more (jobs/warm_groups.py): every row of the batch's
    buffer is as long as its longest row, and rows grow by doubling."""
    if layout.strategy == "pipeline" or layout.kv_layout == "sharded":
        raise ValueError(f"{layout.label} does not decode in batches")
    tokens = batch_row_tokens(prompt_tokens, max_new_tokens)
    return int(shape.kv_bytes_per_token() * tokens * MARGIN)
