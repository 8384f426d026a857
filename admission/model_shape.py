"""What admission needs to know about a model: its shape and the bytes of its weights."""

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

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.compute_dtype_bytes

    def in_dtype(self, dtype_bytes: int) -> "ModelShape":
        """The same model computing in another float width (dense bytes follow)."""
        return replace(
            self,
            dense_weight_bytes=self.parameters * dtype_bytes,
            compute_dtype_bytes=dtype_bytes,
        )
