"""Per-node memory a job needs, from the model's shape alone (pure; a later pass calibrates the
activation and overhead terms against measured mx.get_peak_memory())."""

from dataclasses import dataclass

from admission.model_shape import ModelShape

RUNTIME_OVERHEAD_BYTES = 256 * 1024**2  # interpreter, MLX runtime, tokenizer
SCORE_TILE_TOKENS = 4096  # ring_worker attends past keys in tiles of this size


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.overhead_bytes


def estimate_node_bytes(
    shape: ModelShape,
    prompt_tokens: int,
    max_new_tokens: int,
    ring_size: int,
    chunk_tokens: int,
    *,
    dense_weights: bool,
    pipeline: bool = False,
) -> MemoryEstimate:
    """Bytes one rank of a group of `ring_size` (1 = single) needs. Ring: KV replicated on every
    rank, each rank runs chunk_tokens / ring_size tokens of every chunk. Pipeline: each rank holds
    its share of the layers (weights and KV) and runs whole chunks."""
    weights = shape.dense_weight_bytes if dense_weights else shape.weight_bytes
    kv = shape.kv_bytes_per_token() * (prompt_tokens + max_new_tokens)
    if pipeline and ring_size > 1:
        share = -(-shape.layers // ring_size)  # the first ranks take the extra layers
        weights, kv = weights * share // shape.layers, kv * share // shape.layers
    return MemoryEstimate(
        weights_bytes=weights,
        kv_bytes=kv,
        activation_bytes=activation_bytes(shape, chunk_tokens, 1 if pipeline else ring_size),
        overhead_bytes=RUNTIME_OVERHEAD_BYTES,
    )


def activation_bytes(shape: ModelShape, chunk_tokens: int, ring_size: int) -> int:
    """Peak live tensors while one layer of one chunk runs (float32 scores, MLP, hidden)."""
    local = -(-chunk_tokens // ring_size)
    width = shape.compute_dtype_bytes
    hidden = 4 * local * shape.hidden_size * width
    mlp = 3 * local * shape.intermediate_size * width
    keys_seen = min(chunk_tokens + SCORE_TILE_TOKENS, 2 * SCORE_TILE_TOKENS)
    scores = 2 * shape.q_heads * local * keys_seen * 4
    logits = shape.vocab_size * 4  # the last position only
    return hidden + mlp + scores + logits
