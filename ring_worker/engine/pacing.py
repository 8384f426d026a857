"""Prefill paced layer by layer on GPUs, so a chunk's temporaries do not pile up.

MLX's CUDA backend keeps every queued kernel's inputs alive until the kernel has run, and lets
the host queue several commits ahead, so a chunk built as one graph holds many layers'
temporaries at once (8-12 GiB more on the 8B shape, one H200). Here each layer's output is queued
as soon as it is built, and the host waits for the layer `depth` back before building more: the
device stays busy while at most `depth` layers' temporaries are alive. On CPU the engine's graphs
run unpaced (CPU peaks are calibrated that way)."""

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

LAYERS_IN_FLIGHT = 2


class PacedLayer(nn.Module):
    """A transformer block whose output is queued at once; the shared queue waits for older ones."""

    def __init__(self, inner: nn.Module, queued: deque[mx.array], depth: int):
        super().__init__()
        self.inner = inner
        self._queued = queued
        self._depth = depth

    def __getattr__(self, key: str) -> Any:
        """The block's own attributes (mlx-lm's forward reads some, e.g. Llama's `use_sliding`)."""
        try:
            return super().__getattr__(key)
        except AttributeError:
            if key == "inner":
                raise
            return getattr(self.inner, key)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.inner(x, *args, **kwargs)
        mx.async_eval(out)
        self._queued.append(out)
        while len(self._queued) > self._depth:
            mx.eval(self._queued.popleft())  # returns once that layer has run on the device
        return out


def block(layer: nn.Module) -> nn.Module:
    """The transformer block itself, paced or not (to change its modules, e.g. its MLP)."""
    return layer.inner if isinstance(layer, PacedLayer) else layer


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


@contextmanager
def paced_layers(
    model: nn.Module, depth: int = LAYERS_IN_FLIGHT, force: bool = False
) -> Iterator[None]:
    """Within: the model's layers are paced where the default device is a GPU (or `force`) and
    `depth` > 0; otherwise the model is unchanged."""
    layers = model.model.layers
    if depth <= 0 or not (force or on_gpu()):
        yield
        return
    queued: deque[mx.array] = deque()
    originals = list(layers)
    layers[:] = [PacedLayer(layer, queued, depth) for layer in originals]
    try:
        yield
    finally:
        layers[:] = originals
        queued.clear()
