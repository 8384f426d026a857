"""Decode attention over rows of different lengths, fused, on MLX's CUDA backend.

MLX's fused SDPA takes no boolean mask on CUDA: with one it falls back to matmul + softmax over
the sliced cache, and a 32-row step of the 8B shape took 51 ms on an H200 against 17 ms when
every row had one length.

Here two kernels do it (flash-decoding):
- `rows_partial`: one block of 4 warps per (row, KV head, key split), its GQA group's queries in
  registers. A key is read by a group of lanes, each holding 16 bytes of consecutive head dims,
  each lane with two loads in flight and an online softmax per lane group; groups, then warps,
  are merged at the end. Each row reads only its own keys, [start, start + length), straight
  from the batch's KV buffers (no slice, no copy, no mask).
- `rows_combine`: merges the splits of each (row, query head).

`RowsAttention` wraps a layer's attention module. On a SlotCache of two or more rows it computes
Q/K/V itself (`project_qkv`), stores K/V in the rows, and calls `attend` when the rows differ in
length (fused SDPA when they do not). On one row, or any other cache, it is the plain module
(faster to build a step's graph). `attend` is this file's kernels on CUDA; the tests pass
`reference_attention` (MLX ops) on the CPU to check the wrapper."""

from collections.abc import Callable
from functools import cache

import mlx.core as mx
import mlx.nn as nn

from ring_worker.engine.batch_cache import SlotCache
from ring_worker.engine.fused_linears import mlx_lm_attention, runs_fused
from ring_worker.engine.ring_attention import project_qkv

Attend = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array, int, float], mx.array]

WARPS = 4  # per block of rows_partial (the kernel source says the same)
TARGET_BLOCKS = 512  # enough blocks to fill an H200's 132 SMs a few times over
MIN_SPLIT_KEYS = 256  # a split's keys: fewer leaves each warp too little to amortise its start

PARTIAL_HEADER = """
struct alignas(16) RowsChunk {
    unsigned int w[4];
};

// N consecutive elements of T (16-byte aligned, N * sizeof(T) a multiple of 16) as floats.
template <typename T, int N>
__device__ __forceinline__ void rows_load(const T* from, float* to) {
    constexpr int PER = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < N / PER; ++c) {
        const RowsChunk raw = *reinterpret_cast<const RowsChunk*>(from + c * PER);
        const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            to[c * PER + i] = static_cast<float>(t[i]);
        }
    }
}
"""

PARTIAL_SOURCE = """
    const float NEG_INF = -__int_as_float(0x7f800000);
    constexpr int WARPS = 4;
    constexpr int EPL = (D / 32 > 16 / (int)sizeof(T)) ? D / 32 : 16 / (int)sizeof(T);
    constexpr int LANES = D / EPL;  // lanes per key: each holds EPL consecutive dims
    constexpr int KPI = 32 / LANES;  // keys a warp reads at once
    constexpr int UNROLL = 2;  // key groups in flight per lane
    const int HKV = keys_shape[1];
    const int C = keys_shape[2];
    const int NSPLIT = splits[0];
    const int split = blockIdx.x % NSPLIT;
    const int bh = blockIdx.x / NSPLIT;
    const int kvh = bh % HKV;
    const int b = bh / HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int sub = lane / LANES;
    const int dim0 = (lane % LANES) * EPL;
    const int len = lengths[b];
    const int first = starts[b];
    const int per = (len + NSPLIT - 1) / NSPLIT;
    const int start = split * per;
    const int end = min(len, start + per);
    const long long base = ((long long)(b * HKV + kvh) * C + first) * D + dim0;
    const float sc = scale[0];

    float qr[G][EPL];
    float m[G], l[G], acc[G][EPL];
    for (int g = 0; g < G; ++g) {
        rows_load<T, EPL>(queries + ((long long)(b * HKV + kvh) * G + g) * D + dim0, qr[g]);
        for (int i = 0; i < EPL; ++i) {
            qr[g][i] *= sc;
            acc[g][i] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    constexpr int STRIDE = WARPS * KPI;
    for (int t = start + warp * KPI; t < end; t += STRIDE * UNROLL) {  // t: warp-uniform
        float kf[UNROLL][EPL], vf[UNROLL][EPL];
        bool valid[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int j = t + u * STRIDE + sub;
            valid[u] = j < end;
            if (valid[u]) {
                rows_load<T, EPL>(keys + base + (long long)j * D, kf[u]);
                rows_load<T, EPL>(values + base + (long long)j * D, vf[u]);
            } else {
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    kf[u][i] = 0.f;
                    vf[u][i] = 0.f;
                }
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float s[UNROLL];
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < EPL; ++i) {
                    d += qr[g][i] * kf[u][i];
                }
#pragma unroll
                for (int o = LANES / 2; o > 0; o >>= 1) {
                    d += __shfl_xor_sync(0xffffffff, d, o);
                }
                s[u] = valid[u] ? d : NEG_INF;
                mn = fmaxf(mn, s[u]);
            }
            if (mn == NEG_INF) {
                continue;  // no key of this lane's group yet
            }
            const float a = __expf(m[g] - mn);
            float e[UNROLL];
            float total = 0.f;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                e[u] = __expf(s[u] - mn);
                total += e[u];
            }
            l[g] = l[g] * a + total;
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                float add = 0.f;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    add += e[u] * vf[u][i];
                }
                acc[g][i] = acc[g][i] * a + add;
            }
            m[g] = mn;
        }
    }

    // The warp's KPI key groups hold the same dims: merge them (lanes LANES apart).
#pragma unroll
    for (int o = LANES; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffff, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffff, l[g], o);
            const float mn = fmaxf(m[g], mo);
            const float a = mn == NEG_INF ? 0.f : __expf(m[g] - mn);
            const float bo = mn == NEG_INF ? 0.f : __expf(mo - mn);
            l[g] = l[g] * a + lo * bo;
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                acc[g][i] = acc[g][i] * a + __shfl_xor_sync(0xffffffff, acc[g][i], o) * bo;
            }
            m[g] = mn;
        }
    }

    __shared__ float stats[WARPS][G][2];
    __shared__ float sums[WARPS][G][D];
    if (sub == 0) {
        for (int g = 0; g < G; ++g) {
            if (dim0 == 0) {
                stats[warp][g][0] = m[g];
                stats[warp][g][1] = l[g];
            }
            for (int i = 0; i < EPL; ++i) {
                sums[warp][g][dim0 + i] = acc[g][i];
            }
        }
    }
    __syncthreads();
    const int H = HKV * G;
    for (int idx = threadIdx.x; idx < G * D; idx += WARPS * 32) {
        const int g = idx / D;
        const int d = idx % D;
        float M = NEG_INF;
        for (int w = 0; w < WARPS; ++w) {
            M = fmaxf(M, stats[w][g][0]);
        }
        float L = 0.f, A = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            const float mw = stats[w][g][0];
            if (mw != NEG_INF) {
                const float f = __expf(mw - M);
                L += stats[w][g][1] * f;
                A += sums[w][g][d] * f;
            }
        }
        const long long at = (long long)(b * H + kvh * G + g) * NSPLIT + split;
        part_acc[at * D + d] = A;
        if (d == 0) {
            part_max[at] = M;
            part_sum[at] = L;
        }
    }
"""

COMBINE_SOURCE = """
    const float NEG_INF = -__int_as_float(0x7f800000);
    const long long bh = blockIdx.x;
    const int d = threadIdx.x;
    const int NSPLIT = splits[0];
    float M = NEG_INF;
    for (int s = 0; s < NSPLIT; ++s) {
        M = fmaxf(M, part_max[bh * NSPLIT + s]);
    }
    float L = 0.f, A = 0.f;
    for (int s = 0; s < NSPLIT; ++s) {
        const float ms = part_max[bh * NSPLIT + s];
        if (ms != NEG_INF) {
            const float f = __expf(ms - M);
            L += part_sum[bh * NSPLIT + s] * f;
            A += part_acc[(bh * NSPLIT + s) * D + d] * f;
        }
    }
    out[bh * D + d] = static_cast<T>(L > 0.f ? A / L : 0.f);
"""


def kernels_available() -> bool:
    """Whether this process computes on MLX's CUDA backend (the kernels' only home)."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


@cache
def _partial_kernel():
    return mx.fast.cuda_kernel(
        name="ringq_rows_partial_grouped",
        input_names=["queries", "keys", "values", "starts", "lengths", "scale", "splits"],
        output_names=["part_acc", "part_max", "part_sum"],
        source=PARTIAL_SOURCE,
        header=PARTIAL_HEADER,
    )


@cache
def _combine_kernel():
    return mx.fast.cuda_kernel(
        name="ringq_rows_combine",
        input_names=["part_acc", "part_max", "part_sum", "splits"],
        output_names=["out"],
        source=COMBINE_SOURCE,
    )


@cache
def _scale_array(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


@cache
def _splits_array(splits: int) -> mx.array:
    return mx.array([splits], dtype=mx.int32)


def split_count(blocks: int, longest: int) -> int:
    """Key splits per (row, KV head): a power of two, enough to reach TARGET_BLOCKS blocks, none
    shorter than MIN_SPLIT_KEYS keys. The kernels read it from an input, not a template
    argument: each template variant is an NVRTC compile of 3.4-4.4 s on first use."""
    splits = 1
    while blocks * splits < TARGET_BLOCKS and longest // (2 * splits) >= MIN_SPLIT_KEYS:
        splits *= 2
    return splits


def split_bucket(longest: int) -> int:
    """The largest power of two at most `longest` (at least 1): `split_count` gives it the same
    split count as `longest`, so a compiled step traces once per bucket, not once per length."""
    return 1 << (max(longest, 1).bit_length() - 1)


def kernel_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    starts: mx.array,
    lengths: mx.array,
    longest: int,
    scale: float,
) -> mx.array:
    """softmax(q k^T * scale) v for row b over keys[b, :, starts[b]:starts[b] + lengths[b]].
    queries (rows, heads, 1, dim); keys/values the batch's whole buffers (slots >= rows,
    kv_heads, capacity, dim); starts and lengths int32 (rows,), lengths at most `longest`.
    Returns (rows, heads, 1, dim)."""
    rows, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    splits = split_count(rows * kv_heads, longest)
    parts = rows * heads * splits
    acc, top, total = _partial_kernel()(
        inputs=[queries, keys, values, starts, lengths, _scale_array(scale), _splits_array(splits)],
        template=[("T", queries.dtype), ("D", dim), ("G", heads // kv_heads)],
        grid=(rows * kv_heads * splits * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(parts * dim,), (parts,), (parts,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return _combine_kernel()(
        inputs=[acc, top, total, _splits_array(splits)],
        template=[("T", queries.dtype), ("D", dim)],
        grid=(rows * heads * dim, 1, 1),
        threadgroup=(dim, 1, 1),
        output_shapes=[(rows, heads, 1, dim)],
        output_dtypes=[queries.dtype],
    )[0]


def reference_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    starts: mx.array,
    lengths: mx.array,
    longest: int,
    scale: float,
) -> mx.array:
    """What kernel_attention computes, in MLX ops (SDPA over every column, masked)."""
    rows, capacity = queries.shape[0], keys.shape[2]
    columns = mx.arange(capacity)[None]
    visible = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    k, v = keys[:rows], values[:rows]
    mask = visible.reshape(rows, 1, 1, capacity)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def supported(module: nn.Module) -> bool:
    """Head dims the kernels take: 32, 64, 128 or 256 (a key's lanes must divide a warp)."""
    dim = module.q_proj.weight.shape[0] // module.n_heads
    return dim in (32, 64, 128, 256)


class RowsAttention(nn.Module):
    """Wraps one attention module (mlx-lm's, or the ring's wrapper of it): a decode batch's step
    runs here (q/k/v fused where `fused_linears` fused them), its rows of different lengths
    through `attend`; everything else goes through the module."""

    def __init__(self, inner: nn.Module, attend: Attend):
        super().__init__()
        self.inner = inner
        self._attend = attend

    def __call__(self, x: mx.array, mask: object = None, cache: object = None) -> mx.array:
        if not isinstance(cache, SlotCache) or not runs_fused(x):
            return self.inner(x, mask, cache)  # one row (runs_fused: no): mlx-lm's own step
        attn = mlx_lm_attention(self.inner)
        q, k, v = project_qkv(attn, x, cache.offset)
        rows = cache.rows
        if rows.uniform:  # one length: nothing to hide, mlx-lm's attention as it runs it
            keys, values = cache.update_and_fetch(k, v)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale)
        else:
            cache.store(k, v)
            assert cache.keys is not None and cache.values is not None
            out = self._attend(
                q,
                cache.keys,
                cache.values,
                rows.starts(),
                rows.visible(),
                rows.longest + 1,
                attn.scale,
            )
        out = out.astype(x.dtype).transpose(0, 2, 1, 3)
        return attn.o_proj(out.reshape(x.shape[0], x.shape[1], -1))


def install_rows_attention(model: nn.Module, attend: Attend | None = None) -> bool:
    """Route every layer's mixed-length decode steps through `attend` (default: the CUDA kernels,
    where they run and the head dim suits them). Returns whether anything is routed."""
    layers = model.layers
    if attend is None:
        if not kernels_available():
            return False
        if not all(supported(mlx_lm_attention(layer.self_attn)) for layer in layers):
            return False
        attend = kernel_attention
    for layer in layers:
        if isinstance(layer.self_attn, RowsAttention):
            layer.self_attn._attend = attend
        else:
            layer.self_attn = RowsAttention(layer.self_attn, attend)
    return True
