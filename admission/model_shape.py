"""What admission needs to know about a model: its shape, the bytes of its weights, and the
FLOPs of a prefill."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # "llama" | "qwen3"
    layers: int
    hidden_size: int
    intermediate_size: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    weight_bytes: int  # as stored on disk (quantized where the file is)
    dense_weight_bytes: int  # after dequantization to the compute dtype
    compute_dtype_bytes: int  # 2 for float16/bfloat16, 4 for float32
    tied_embeddings: bool = True  # the LM head reuses the token embedding

    @property
    def parameters(self) -> int:
        return self.dense_weight_bytes // self.compute_dtype_bytes

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def non_embedding_parameters(self) -> int:
        embeddings = self.embedding_parameters * (1 if self.tied_embeddings else 2)
        return self.parameters - embeddings

    def prefill_flops(self, start_tokens: int, end_tokens: int) -> float:
        return prefill_flops(
            self.non_embedding_parameters, self.layers, self.hidden_size, start_tokens, end_tokens
        )

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.compute_dtype_bytes

    def in_dtype(self, dtype_bytes: int) -> "ModelShape":
        """The same model computing in another float width (dense bytes follow)."""
        return replace(
            self,
            dense_weight_bytes=self.parameters * dtype_bytes,
            compute_dtype_bytes=dtype_bytes,
        )


def layer_parameters(
    hidden_size: int, intermediate_size: int, q_heads: int, kv_heads: int, head_dim: int
) -> int:
    """Weights of one transformer block: the q/k/v/o projections and a gated MLP."""
    attention = 2 * hidden_size * q_heads * head_dim + 2 * hidden_size * kv_heads * head_dim
    return attention + 3 * hidden_size * intermediate_size


def prefill_flops(
    non_embedding_parameters: int, layers: int, d_model: int, start_tokens: int, end_tokens: int
) -> float:
    """FLOPs to prefill prompt tokens [start, end) of a causal prompt: each token at position n
    costs 2 x the non-embedding weights (its matmuls) plus 4 x layers x d_model x n (its
    attention's QK^T and AV over n keys). Over a whole prompt of N tokens that is, per token,
    2 P + 2 layers d_model N: attention averaged over the causal triangle."""
    if not 0 <= start_tokens <= end_tokens:
        raise ValueError(f"bad token range [{start_tokens}, {end_tokens})")
    linear = 2.0 * non_embedding_parameters * (end_tokens - start_tokens)
    attention = 2.0 * layers * d_model * (end_tokens**2 - start_tokens**2)
    return linear + attention
