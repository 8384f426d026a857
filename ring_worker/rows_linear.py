"""A decode batch's linear layers on MLX's CUDA backend, for a few rows, without cuBLAS.

On CUDA, MLX multiplies one row by a weight with its own gemv kernel and anything with more rows
through cuBLASLt, which sets up a matmul descriptor, queries its heuristic and captures a stream
on every call: 27-31 us of host time per matmul on an H200 against 8-9 us for gemv
(`python -m bench.step_cost_probe`). A decode step of the 8B shape runs 225 of them, so a step of
2 rows cost about twice one of 1 (7.5 -> 14.1 ms), all of it host time. That jump is what keeps
a batch from taking a second job without delaying the first (ring_worker/join_budget.py).

`rows_kernel` is one skinny-GEMM launch for 2..MAX_ROWS rows: one block of 4 warps per
COLUMNS output columns, the warps splitting the input dims, each lane reading 16 bytes of a
weight row at a time (the weight is read once for all rows: the step stays memory-bound) and
accumulating in float32 as cuBLAS does; the block's warps are summed through shared memory.
The row count is an input, not a template argument, up to a bucket (ROW_BUCKETS): each template
variant is an NVRTC compile of seconds on first use (`warm_up` compiles them all).

`RowsLinear` is an `nn.Linear` holding the same arrays (nothing is copied, the model's
parameters look the same); calls of 2..MAX_ROWS rows in 16-bit or float32 take the kernel, all
others (one row: gemv; prefill chunks: cuBLAS is faster there) the plain path.
"""

from collections.abc import Callable
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from ring_worker.rows_attention import kernels_available

MAX_ROWS = 8  # rows up to which the kernel beats cuBLAS (bench.step_cost_probe `matmul`)
ROW_BUCKETS = (4, 8, 16)  # the kernel's template variants: rows each holds at most (16: probe)
COLUMNS = 4  # output columns per block (the kernel source says the same)
WARPS = 4
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

Product = Callable[[mx.array, mx.array], mx.array]  # (rows, dims) x (out, dims) -> (rows, out)

HEADER = """
struct alignas(16) LinearChunk {
    unsigned int w[4];
};

// N consecutive elements of T as floats: one 16-byte load per chunk where `aligned`.
template <typename T, int N>
__device__ __forceinline__ void linear_load(const T* from, bool aligned, float* to) {
    constexpr int PER = 16 / sizeof(T);
    if (aligned) {
#pragma unroll
        for (int c = 0; c < N / PER; ++c) {
            const LinearChunk raw = *reinterpret_cast<const LinearChunk*>(from + c * PER);
            const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                to[c * PER + i] = static_cast<float>(t[i]);
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            to[i] = static_cast<float>(from[i]);
        }
    }
}
"""

SOURCE = """
    constexpr int WARPS = 4;
    constexpr int COLUMNS = 4;
    constexpr int PER = 16 / (int)sizeof(T);
    const int rows = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int n0 = blockIdx.x * COLUMNS;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const unsigned long long starts =
        reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w);
    const bool aligned = (starts & 15) == 0;

    float acc[R][COLUMNS];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j) {
            acc[r][j] = 0.f;
        }
    }
    for (int k = (warp * 32 + lane) * PER; k < K; k += WARPS * 32 * PER) {
        float wf[COLUMNS][PER];
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j) {
            const int n = min(n0 + j, N - 1);  // past the end: a real row, never written
            linear_load<T, PER>(w + (long long)n * K + k, aligned, wf[j]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r < rows) {
                float xf[PER];
                linear_load<T, PER>(x + (long long)r * K + k, aligned, xf);
#pragma unroll
                for (int j = 0; j < COLUMNS; ++j) {
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        acc[r][j] += xf[i] * wf[j][i];
                    }
                }
            }
        }
    }

    __shared__ float part[WARPS][R][COLUMNS];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j) {
            float v = acc[r][j];
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) {
                v += __shfl_xor_sync(0xffffffff, v, offset);
            }
            if (lane == 0) {
                part[warp][r][j] = v;
            }
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < rows * COLUMNS; t += WARPS * 32) {
        const int r = t / COLUMNS;
        const int n = n0 + t % COLUMNS;
        if (n < N) {
            float total = 0.f;
#pragma unroll
            for (int v = 0; v < WARPS; ++v) {
                total += part[v][r][t % COLUMNS];
            }
            out[(long long)r * N + n] = static_cast<T>(total);
        }
    }
"""


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="ringq_rows_linear",
        input_names=["x", "w"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
    )


def rows_kernel(x: mx.array, weight: mx.array) -> mx.array:
    """x (rows, dims) times weight (out, dims) transposed, rows <= MAX_ROWS, dims a multiple of
    16 bytes' worth of the dtype: (rows, out), in x's dtype."""
    rows = x.shape[0]
    out_dims = weight.shape[0]
    bucket = next(b for b in ROW_BUCKETS if rows <= b)
    return _kernel()(
        inputs=[x, weight],
        template=[("T", x.dtype), ("R", bucket)],
        grid=(-(-out_dims // COLUMNS) * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(rows, out_dims)],
        output_dtypes=[x.dtype],
    )[0]


def fits(x: mx.array, weight: mx.array) -> bool:
    """Whether `rows_kernel` takes this call: 2..MAX_ROWS rows of one float dtype, shared with
    the weight, and whole 16-byte chunks of dims."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    dims = x.shape[-1] if x.ndim else 0
    return (
        2 <= rows <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in DTYPES
        and weight.ndim == 2
        and dims == weight.shape[1]
        and dims * x.dtype.size % 16 == 0
    )


class RowsLinear(nn.Linear):
    """`nn.Linear`, but 2..MAX_ROWS rows go through `product` (the kernel on CUDA)."""

    def __init__(self, inner: nn.Linear, product: Product):  # shares inner's arrays
        nn.Module.__init__(self)
        self.weight = inner.weight
        if "bias" in inner:
            self.bias = inner.bias
        self._product = product

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if not fits(x, weight):
            return super().__call__(x)
        out = self._product(x.reshape(-1, x.shape[-1]), weight)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        return out + self["bias"] if "bias" in self else out


def install_rows_linear(model: nn.Module, product: Product | None = None) -> int:
    """Make every plain `nn.Linear` of the model a RowsLinear over `product` (default: the CUDA
    kernel, where it runs; the tests pass an MLX reference on the CPU). Returns how many layers
    it routes (0 where the kernel does not run)."""
    if product is None:
        if not kernels_available():
            return 0
        product = rows_kernel
    routed = 0
    for _, module in model.named_modules():
        for name, child in module.children().items():
            if type(child) is nn.Linear:
                setattr(module, name, RowsLinear(child, product))
                routed += 1
            elif isinstance(child, RowsLinear):
                child._product = product
                routed += 1
    return routed


def warm_up_kernels(dtype: mx.Dtype, dims: int = 256) -> None:
    """Compile the template variants a batch of `dtype` uses (NVRTC, seconds each on first use
    in a process), so no batch step waits for one."""
    if kernels_available() and dtype in DTYPES:
        weight = mx.zeros((COLUMNS, dims), dtype)
        used = [rows for rows in ROW_BUCKETS if rows <= MAX_ROWS]
        mx.eval([rows_kernel(mx.zeros((rows, dims), dtype), weight) for rows in used])
