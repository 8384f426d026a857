"""A decode batch's linear layers on MLX's CUDA backend, without cuBLAS's per-call host cost.

On CUDA, MLX multiplies one row by a weight with its own gemv kernel, and anything with more
rows through cuBLASLt: a new matmul descriptor, a heuristic query and a stream capture on every
call. On an H200 that was 27-30 us of host time per matmul against 8 us for gemv
(`python -m bench.step_cost_probe`), so a batched step of the 8B shape (225 matmuls) spent ~6 ms
of host time in cuBLAS alone, and a step of 2 rows cost twice one of 1.

`mx.gather_mm` with every row gathering the one weight (sorted indices, one row per batch entry)
takes MLX's grouped-GEMM path instead, a single kernel launch. `RowsLinear` routes a layer's
decode-step calls ((rows, 1, dims), 2..MAX_ROWS rows) there; one row (gemv) and prefill
((1, tokens, dims): cuBLAS does better) stay on the plain `nn.Linear` path. It is an
`nn.Linear` holding the same arrays, so the model's parameters, its weights and whatever looks
for `nn.Linear` see no difference.
"""

from functools import cache

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 64  # a decode batch's rows; prefill chunks are longer and stay with cuBLAS
HALF_DTYPES = (mx.bfloat16, mx.float16)


class RowsLinear(nn.Linear):
    """`nn.Linear`, but 2..MAX_ROWS rows go through one gather_mm launch."""

    def __init__(self, inner: nn.Linear):  # shares inner's arrays: nothing is allocated
        nn.Module.__init__(self)
        self.weight = inner.weight
        if "bias" in inner:
            self.bias = inner.bias

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.shape[0]
        if x.ndim != 3 or x.shape[1] != 1 or not 2 <= rows <= MAX_ROWS:
            return super().__call__(x)  # one row, or a prefill (1, tokens, dims)
        weights = self.weight.T[None]  # (1, dims, out): one "expert", as mlx-lm's MoE layers
        out = mx.gather_mm(x, weights, rhs_indices=_zeros(rows), sorted_indices=True)
        return out + self.bias if "bias" in self else out


@cache
def _zeros(rows: int) -> mx.array:
    return mx.zeros((rows,), dtype=mx.uint32)


def install_rows_linear(model: nn.Module, force: bool = False) -> int:
    """Make every plain `nn.Linear` of the model a RowsLinear: on CUDA, for 16-bit weights (what
    the GPU ranks compute in, and what MLX's grouped GEMM is built for), or anywhere and for any
    dtype with `force` (the tests, on the CPU). Returns how many layers are routed."""
    if not force and not (mx.cuda.is_available() and mx.default_device() == mx.gpu):
        return 0
    routed = 0
    for _, module in model.named_modules():
        for name, child in module.children().items():
            if type(child) is nn.Linear and (force or child.weight.dtype in HALF_DTYPES):
                setattr(module, name, RowsLinear(child))
            routed += isinstance(getattr(module, name, None), RowsLinear)
    return routed
