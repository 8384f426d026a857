"""Choosing where a job runs: strategy, ring size and nodes (pure; no I/O)."""

from dataclasses import dataclass
from typing import Literal

from admission.estimate import MemoryEstimate, estimate_node_bytes
from admission.model_shape import ModelShape


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    available_bytes: int
    dense_weights: bool  # CPU nodes dequantize weights


@dataclass(frozen=True)
class PlacementRequest:
    prompt_tokens: int
    max_new_tokens: int
    chunk_tokens: int
    ring_size: int | None  # None: automatic
    sharding: str  # "auto" | "ring" | "pipeline" | "single"
    ring_min_tokens: int  # automatic choice: shorter prompts run on one node


@dataclass(frozen=True)
class PlacementPlan:
    strategy: Literal["single", "ring", "pipeline"]
    nodes: tuple[str, ...]
    bytes_per_node: int


class CannotPlace(Exception):
    """No placement fits; the message says bytes needed vs available per node."""


def plan_placement(
    shape: ModelShape, request: PlacementRequest, nodes: list[NodeCapacity]
) -> PlacementPlan:
    if not nodes:
        raise CannotPlace("no live nodes: start one with `ringq node` (or `ringq up`)")
    for size in candidate_sizes(request, len(nodes)):
        if strategy_for(request, size) == "pipeline" and size > shape.layers:
            raise CannotPlace(
                f"a pipeline of {size} needs {size} layers; the model has {shape.layers}"
            )
        fitting = []
        for node in sorted(nodes, key=lambda n: -n.available_bytes):
            need = node_estimate(shape, request, size, node).total_bytes
            if need <= node.available_bytes:
                fitting.append((node.name, need))
        if len(fitting) >= size:
            chosen = fitting[:size]
            return PlacementPlan(
                strategy=strategy_for(request, size),
                nodes=tuple(name for name, _ in chosen),
                bytes_per_node=max(need for _, need in chosen),
            )
    raise CannotPlace(describe_shortfall(shape, request, nodes))


def strategy_for(request: PlacementRequest, size: int) -> Literal["single", "ring", "pipeline"]:
    if size == 1:
        return "single"
    return "pipeline" if request.sharding == "pipeline" else "ring"


def candidate_sizes(request: PlacementRequest, live: int) -> list[int]:
    if request.sharding == "single":
        return [1]
    if request.ring_size is not None:
        if request.ring_size > live:
            raise CannotPlace(
                f"ring of {request.ring_size} needs {request.ring_size} nodes; {live} live"
            )
        return [request.ring_size]
    if request.sharding in ("ring", "pipeline"):
        if live < 2:
            raise CannotPlace(f"a {request.sharding} needs at least 2 nodes; {live} live")
        return list(range(2, live + 1))
    if request.prompt_tokens < request.ring_min_tokens or live == 1:
        return list(range(1, live + 1))
    # Long prompt: all live nodes first (fastest prefill), fewer if memory says so.
    return list(range(live, 0, -1))


def node_estimate(
    shape: ModelShape, request: PlacementRequest, size: int, node: NodeCapacity
) -> MemoryEstimate:
    return estimate_node_bytes(
        shape,
        request.prompt_tokens,
        request.max_new_tokens,
        size,
        request.chunk_tokens,
        dense_weights=node.dense_weights,
        pipeline=strategy_for(request, size) == "pipeline",
    )


def describe_shortfall(
    shape: ModelShape, request: PlacementRequest, nodes: list[NodeCapacity]
) -> str:
    parts = []
    for node in nodes:
        need = node_estimate(shape, request, 1, node)
        parts.append(
            f"{node.name}: needs {gib(need.total_bytes)} (weights {gib(need.weights_bytes)}, "
            f"KV {gib(need.kv_bytes)}), has {gib(node.available_bytes)}"
        )
    return (
        f"job of {request.prompt_tokens} prompt tokens does not fit on the live nodes: "
        + "; ".join(parts)
    )


def gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
