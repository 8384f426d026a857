"""Choosing where a job runs: layout (strategy, ranks, KV layout) and nodes (pure; no I/O).

Candidates are tried in order and the first that fits wins. Sizes: prompts shorter than
`ring_min_tokens` take the fewest nodes that fit; longer ones the most live nodes (fastest
prefill), fewer if memory says so. At each size: a ring with replicated KV (every rank holds all
weights), then a ring with sharded KV (when the replicated KV does not fit), then a pipeline (when
the weights themselves do not fit on one node). `ranks`, `strategy` and `kv_layout` narrow the
candidates to what the user asked for.
"""

from dataclasses import dataclass, replace
from typing import cast

from admission.estimate import Layout, MemoryEstimate, estimate_node_bytes
from admission.group_plan import chunk_candidates
from admission.model_shape import ModelShape
from admission.vocabulary import KVLayout, StrategyChoice


@dataclass(frozen=True)
class NodeCapacity:
    name: str
    available_bytes: int
    dense_weights: bool  # CPU nodes dequantize weights (and compute in float32)
    compute_dtype_bytes: int | None = None  # GPU nodes: the model's own dtype; None: the shape's

    @property
    def device(self) -> str:
        return "cpu" if self.dense_weights else "gpu"


@dataclass(frozen=True)
class PlacementRequest:
    prompt_tokens: int
    max_new_tokens: int
    chunk_tokens: int | None  # None: per device, the largest that fits (admission.group_plan)
    ranks: int | None  # None: automatic
    strategy: StrategyChoice
    ring_min_tokens: int  # automatic choice: shorter prompts run on the fewest nodes
    kv_layout: str = "auto"  # "auto" | "replicated" | "sharded" (ring groups)
    preferred_nodes: tuple[str, ...] = ()  # taken first among those that fit (a kept prefix)
    checkpoint_tokens: int = 0  # prefill checkpoint interval (0: off): their KV copies count


@dataclass(frozen=True)
class PlacementPlan:
    layout: Layout
    nodes: tuple[str, ...]
    bytes_per_node: int
    chunk_tokens: int

    @property
    def strategy(self) -> str:
        return self.layout.strategy


class CannotPlace(Exception):
    """No placement fits; the message says bytes needed vs available per node."""


def plan_placement(
    shape: ModelShape, request: PlacementRequest, nodes: list[NodeCapacity]
) -> PlacementPlan:
    if not nodes:
        raise CannotPlace("no live nodes: start one with `ringq node` (or `ringq up`)")
    layouts = candidate_layouts(request, len(nodes), shape.layers)
    for layout in layouts:
        fitting = []
        for node in sorted(nodes, key=lambda n: (n.name not in request.preferred_nodes,
                                                  -n.available_bytes)):  # fmt: skip
            if (fit := fitting_chunk(shape, request, layout, node)) is not None:
                fitting.append((node.name, *fit))
        if len(fitting) >= layout.size:
            chosen = fitting[: layout.size]
            return PlacementPlan(
                layout=layout,
                nodes=tuple(name for name, _, _ in chosen),
                bytes_per_node=max(need for _, need, _ in chosen),
                chunk_tokens=min(chunk for _, _, chunk in chosen),
            )
    raise CannotPlace(describe_shortfall(shape, request, nodes, layouts))


def fitting_chunk(
    shape: ModelShape, request: PlacementRequest, layout: Layout, node: NodeCapacity
) -> tuple[int, int] | None:
    """(bytes needed, chunk tokens) with the largest chunk that fits on `node`; None if none."""
    for chunk in chunk_candidates("cpu" if node.dense_weights else "cuda", request.chunk_tokens):
        need = node_estimate(shape, replace(request, chunk_tokens=chunk), layout, node)
        if need.total_bytes <= node.available_bytes:
            return need.total_bytes, chunk
    return None


def candidate_layouts(request: PlacementRequest, live: int, layers: int) -> list[Layout]:
    layouts = []
    for size in candidate_sizes(request, live):
        layouts.extend(layouts_of_size(request, size, layers))
    return layouts


def layouts_of_size(request: PlacementRequest, size: int, layers: int) -> list[Layout]:
    if size == 1:
        return [Layout("single")]
    kv_layouts: list[KVLayout] = ["replicated", "sharded"]
    if request.kv_layout in kv_layouts:
        kv_layouts = [cast(KVLayout, request.kv_layout)]
    ring = [Layout("ring", size, kv) for kv in kv_layouts]
    pipeline = [Layout("pipeline", size)] if size <= layers else []
    if request.strategy == "ring":
        return ring
    if request.strategy == "pipeline":
        if not pipeline:
            raise CannotPlace(f"a pipeline of {size} needs {size} layers; the model has {layers}")
        return pipeline
    return ring + pipeline


def candidate_sizes(request: PlacementRequest, live: int) -> list[int]:
    if request.strategy == "single":
        return [1]
    if request.ranks is not None:
        if request.ranks > live:
            raise CannotPlace(
                f"a group of {request.ranks} needs {request.ranks} nodes; {live} live"
            )
        return [request.ranks]
    if request.strategy in ("ring", "pipeline"):
        if live < 2:
            raise CannotPlace(f"a {request.strategy} needs at least 2 nodes; {live} live")
        return list(range(2, live + 1))
    if request.prompt_tokens < request.ring_min_tokens or live == 1:
        return list(range(1, live + 1))
    # Long prompt: all live nodes first (fastest prefill), fewer if memory says so.
    return list(range(live, 0, -1))


def node_estimate(
    shape: ModelShape, request: PlacementRequest, layout: Layout, node: NodeCapacity
) -> MemoryEstimate:
    chunk = request.chunk_tokens or chunk_candidates("cpu" if node.dense_weights else "cuda")[-1]
    return estimate_node_bytes(
        shape.in_dtype(node.compute_dtype_bytes) if node.compute_dtype_bytes else shape,
        request.prompt_tokens,
        request.max_new_tokens,
        layout,
        chunk,
        dense_weights=node.dense_weights,
        checkpoint_tokens=request.checkpoint_tokens,
    )


def describe_shortfall(
    shape: ModelShape,
    request: PlacementRequest,
    nodes: list[NodeCapacity],
    layouts: list[Layout],
) -> str:
    """Needed vs available per node for the most frugal layout tried."""
    layout = min(
        layouts or [Layout("single")],
        key=lambda candidate: node_estimate(shape, request, candidate, nodes[0]).total_bytes,
    )
    parts = []
    for node in nodes:
        need = node_estimate(shape, request, layout, node)
        parts.append(
            f"{node.name}: needs {gib(need.total_bytes)} (weights {gib(need.weights_bytes)}, "
            f"KV {gib(need.kv_bytes)}), has {gib(node.available_bytes)}"
        )
    tried = ", ".join(dict.fromkeys(candidate.label for candidate in layouts))
    return (
        f"job of {request.prompt_tokens} prompt tokens does not fit on the live nodes "
        f"(tried {tried}); as {layout.label}: " + "; ".join(parts)
    )


def gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
