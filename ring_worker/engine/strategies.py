"""The engine for a group's strategy."""

from typing import Any

import mlx.nn as nn

from ring_worker.engine.engines import Engine, RingEngine
from ring_worker.engine.pipeline import PipelineEngine
from ring_worker.engine.ring_attention import Exchange, KVLayout


def make_engine(
    model: nn.Module,
    group: Any,
    strategy: str,
    exchange: Exchange = "rotate",
    kv_layout: KVLayout = "replicated",
) -> Engine:
    """A group of one always runs the single-device path (plain mlx-lm modules)."""
    if group is None or group.size() == 1:
        return Engine(model)
    if strategy == "pipeline":
        return PipelineEngine(model, group)
    return RingEngine(model, group, exchange, kv_layout)
