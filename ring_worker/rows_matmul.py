"""`x @ W.T` for a decode step of 2-8 rows, as one kernel that reads each weight once, on MLX's
CUDA backend (elsewhere, and at other row counts, MLX's own matmul).

Why: at one row MLX runs its gemv (about 9 us of host time a call); at 2 or more it builds a
cuBLASLt matmul on every call (about 23-31 us), and an 8B step makes 129 of them
(ring_worker/fused_linears.py). A decode step of a few rows is host-bound on an H200
(bench.step_cost_probe: its dispatch, not the device, sets the step time), so a second row cost
+1.8 ms a step of 6.4 (bench/results/batch-decode.md, thirteenth session). A kernel called
through `mx.fast.cuda_kernel` is one lookup and a launch, like the gemv.

The kernel is the gemv's shape, widened to the rows: each warp owns ROWS_OUT consecutive outputs
(weight rows); its lanes walk K in 16-byte loads of the weight, UNROLL of them in flight, and
each weight load serves every row of x (read from L1/L2: x is at most 8 x K). One variant per
dtype (the row count is an input, not a template argument: each variant is an NVRTC compile of
seconds on first use).
"""

from functools import cache

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 8  # the kernel's register tile; more rows go to cuBLASLt (device-bound there)
ROWS_OUT = 2  # weight rows (outputs) per warp
WARPS = 4  # per block

SOURCE = """
    constexpr int PER = 16 / (int)sizeof(T);  // elements per 16-byte load
    constexpr int MAXM = 8;
    constexpr int R = 2;  // outputs per warp (ROWS_OUT)
    constexpr int UNROLL = 2;  // 16-byte weight loads in flight per output per lane
    constexpr int WARPS = 4;
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (n0 >= N) {
        return;
    }
    float acc[R][MAXM];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            acc[r][m] = 0.f;
        }
    }
    for (int base = lane * PER; base < K; base += 32 * PER * UNROLL) {
        float wv[UNROLL][R][PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = base + u * 32 * PER;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (k < K) {
                    rows_mm_load<T, PER>(w + (long long)(n0 + r) * K + k, wv[u][r]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int k = base + u * 32 * PER;
            if (k < K) {
#pragma unroll
                for (int m = 0; m < MAXM; ++m) {
                    if (m < M) {
                        float xv[PER];
                        rows_mm_load<T, PER>(x + (long long)m * K + k, xv);
#pragma unroll
                        for (int r = 0; r < R; ++r) {
#pragma unroll
                            for (int i = 0; i < PER; ++i) {
                                acc[r][m] += wv[u][r][i] * xv[i];
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < MAXM; ++m) {
            if (m < M) {
                float v = acc[r][m];
#pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1) {
                    v += __shfl_xor_sync(0xffffffff, v, offset);
                }
                if (lane == 0) {
                    y[(long long)m * N + n0 + r] = static_cast<T>(v);
                }
            }
        }
    }
"""

HEADER = """
struct alignas(16) RowsMmChunk {
    unsigned int w[4];
};

template <typename T, int N>
__device__ __forceinline__ void rows_mm_load(const T* from, float* to) {
    const RowsMmChunk raw = *reinterpret_cast<const RowsMmChunk*>(from);
    const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        to[i] = static_cast<float>(t[i]);
    }
}
"""


_routed = {"on": True}  # off only for a side-by-side (bench.compiled_step_check)


def route_to_kernel(on: bool) -> None:
    """Whether `rows_linear` may take the kernel (a bench's A/B against MLX's matmul)."""
    _routed["on"] = on


def kernels_available() -> bool:
    """Whether this process computes on MLX's CUDA backend (ringq's kernels' only home)."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="ringq_rows_matmul",
        input_names=["x", "w"],
        output_names=["y"],
        source=SOURCE,
        header=HEADER,
    )


def kernel_fits(rows: int, weight: mx.array, x_dtype: mx.Dtype) -> bool:
    """Whether the kernel takes this product: 2-8 rows, a 2-D weight of x's float dtype whose
    rows split into 16-byte loads and whose outputs split among warps."""
    if not 2 <= rows <= MAX_ROWS or weight.ndim != 2 or weight.dtype != x_dtype:
        return False
    if x_dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return False
    outputs, inputs = weight.shape
    return (inputs * x_dtype.size) % 16 == 0 and outputs % ROWS_OUT == 0


def kernel_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x (rows, K) @ weight (N, K).T through the kernel (CUDA only; `kernel_fits` must hold)."""
    outputs = weight.shape[0]
    warps = outputs // ROWS_OUT
    blocks = (warps + WARPS - 1) // WARPS
    return _kernel()(
        inputs=[x, weight],
        template=[("T", x.dtype)],
        grid=(blocks * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(x.shape[0], outputs)],
        output_dtypes=[x.dtype],
    )[0]


def rows_linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x @ weight.T (+ bias) for x of shape (rows, ..., K): the kernel where it runs and fits
    (one token per row), else MLX's matmul."""
    rows = x.shape[0]
    fits = _routed["on"] and x.size == rows * x.shape[-1] and kernel_fits(rows, weight, x.dtype)
    if fits and kernels_available():
        y = kernel_matmul(x.reshape(rows, -1), weight).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return x @ weight.T if bias is None else mx.addmm(bias, x, weight.T)


def linear(module: nn.Module, x: mx.array) -> mx.array:
    """`module(x)` for a decode step's projection: a plain nn.Linear through `rows_linear`, any
    other (quantised, say) as it is."""
    if type(module) is not nn.Linear:
        return module(x)
    return rows_linear(x, module.weight, module.get("bias"))
