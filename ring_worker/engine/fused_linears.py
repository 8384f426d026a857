"""One matmul for a layer's q/k/v projections and one for its gate/up, on decode steps of
several rows.

On CUDA, MLX builds a cuBLASLt matmul on every call: about 23 us of host time at 2 or more rows,
against 9 us for its gemv at one row, and a decode step's matmuls are small enough that this host
time is most of a step. Fusing takes an 8B Llama step from 225 matmuls to 129 (on an H200,
0.75-0.98x as long at 2-8 rows).

The fused weight is one array, and each projection's weight becomes a row slice of it (a view,
no copy): the parameters' values and memory stay as they were (names gain an `inner.` under each
wrapped MLP), and the unfused calls (prefill, one row) read the same numbers. Only plain
`nn.Linear` projections of one dtype and the same bias presence are fused."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.activations import swiglu

QKV = "fused_qkv"  # attribute of an mlx-lm attention module that holds its Fused q/k/v
MLP_TYPES = (llama.MLP, qwen2.MLP, qwen3.MLP)  # down_proj(swiglu(gate_proj(x), up_proj(x)))


@dataclass(frozen=True)
class Fused:
    """Projections stacked by output row: one matmul, outputs split at `splits`."""

    weight: mx.array  # (sum of outputs, inputs)
    bias: mx.array | None
    splits: tuple[int, ...]

    def __call__(self, x: mx.array, head_dim: int = 0) -> list[mx.array]:
        """The outputs; with `head_dim`, each as (..., heads, head_dim), cut along the heads (a
        view of one contiguous product: no copy for the reshape a split output would need)."""
        y = x @ self.weight.T if self.bias is None else mx.addmm(self.bias, x, self.weight.T)
        if not head_dim:
            bounds = (0, *self.splits, y.shape[-1])
            return [y[..., start:end] for start, end in itertools.pairwise(bounds)]
        y = y.reshape(*y.shape[:-1], -1, head_dim)
        bounds = (0, *(split // head_dim for split in self.splits), y.shape[-2])
        return [y[..., start:end, :] for start, end in itertools.pairwise(bounds)]


def runs_fused(x: mx.array) -> bool:
    """Fused calls serve decode steps of 2 or more rows (one token each). One row runs the
    projections apart, on MLX's gemv: fused, an H200's one-row step took 1.02-1.09x as long."""
    return x.shape[1] == 1 and x.shape[0] > 1


def fuse(linears: list[nn.Module]) -> Fused | None:
    """Stack `linears`' weights into one array and make each weight a view of it. None (and
    nothing changed) when they are not plain Linears that can share one matmul."""
    if not all(type(linear) is nn.Linear for linear in linears):
        return None
    if len({linear.weight.dtype for linear in linears}) != 1:
        return None
    with_bias = {"bias" in linear for linear in linears}
    if len(with_bias) != 1:
        return None
    weight = mx.concatenate([linear.weight for linear in linears])
    bias = mx.concatenate([linear.bias for linear in linears]) if with_bias == {True} else None
    mx.eval(weight, *([] if bias is None else [bias]))
    start, splits = 0, []
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight = weight[start:end]
        if bias is not None:
            linear.bias = bias[start:end]
        splits.append(end)
        start = end
    mx.eval([linear.parameters() for linear in linears])
    return Fused(weight, bias, tuple(splits[:-1]))


class FusedMLP(nn.Module):
    """Wraps an mlx-lm MLP: decode steps of several rows run gate and up as one matmul."""

    def __init__(self, inner: nn.Module, gate_up: Fused):
        super().__init__()
        self.inner = inner
        self._gate_up = gate_up

    def __call__(self, x: mx.array) -> mx.array:
        if not runs_fused(x):
            return self.inner(x)
        gate, up = self._gate_up(x)
        return self.inner.down_proj(swiglu(gate, up))


def fuse_layers(model: nn.Module) -> bool:
    """Fuse every layer's q/k/v and gate/up where `fuse` can. Returns whether every layer's q/k/v
    is fused now; calling again changes nothing."""
    for layer in model.layers:
        attn = mlx_lm_attention(layer.self_attn)
        if getattr(attn, QKV, None) is None:
            setattr(attn, QKV, fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
        if type(layer.mlp) in MLP_TYPES:
            gate_up = fuse([layer.mlp.gate_proj, layer.mlp.up_proj])
            if gate_up is not None:
                layer.mlp = FusedMLP(layer.mlp, gate_up)
    return all(getattr(mlx_lm_attention(layer.self_attn), QKV) for layer in model.layers)


def mlx_lm_attention(module: nn.Module) -> nn.Module:
    """mlx-lm's attention module inside ringq's wrappers of it (each keeps it as `inner`)."""
    inner = getattr(module, "inner", None)
    return module if inner is None else mlx_lm_attention(inner)


def project_heads(attn: nn.Module, x: mx.array) -> list[mx.array]:
    """q, k and v of `x` as (batch, length, heads, head_dim): one fused matmul on a decode step
    where the layer is fused, else the module's three."""
    qkv: Fused | None = getattr(attn, QKV, None)
    if qkv is not None and runs_fused(x):
        return qkv(x, head_dim=attn.q_proj.weight.shape[0] // attn.n_heads)
    batch, length, _ = x.shape
    q = attn.q_proj(x).reshape(batch, length, attn.n_heads, -1)
    k = attn.k_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    v = attn.v_proj(x).reshape(batch, length, attn.n_kv_heads, -1)
    return [q, k, v]
