"""One group plan, decided once (pure): from the layout placement chose and the chosen nodes'
facts, everything a group's ranks execute. The dispatcher stores it in the group spec; ranks,
`ringq run` and `ringq bench` follow it and decide nothing again.

Group fields (a warm group takes a job only if they match): model, strategy, ranks and their
devices, exchange, transport, KV layout, compute dtype. Job fields (may differ between the jobs
of one warm group): prefill chunk tokens, prompt, max tokens, temperature.

Prefill chunk tokens follow the device:
- CPU: 512 (OpenBLAS float32: larger chunks gain nothing and grow the score tensors).
- GPUs: 16,384, or the largest power of two below it that fits memory. One H200 at 128K ran
  12.6K tok/s with 16K chunks vs 12.3K with one 128K chunk, while each chunk stays well under
  2 s, so progress, cancel and the stall watchdog still tick."""

from collections.abc import Sequence
from dataclasses import dataclass

from admission.estimate import Layout
from admission.vocabulary import Device, Exchange, Transport

CPU_CHUNK_TOKENS = 512
GPU_CHUNK_TOKENS = 16384
MIN_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class NodeFacts:
    """What planning needs to know of one node (from its NodeInfo)."""

    name: str
    device: Device
    gpu: str | None = None  # a physical GPU's identity ("host/0"); ranks sharing one share it


@dataclass(frozen=True)
class GroupPlan:
    layout: Layout
    nodes: tuple[str, ...]
    devices: tuple[str, ...]  # per rank, e.g. "cuda:host/1" or "cpu"
    exchange: Exchange
    transport: Transport
    compute_dtype: str
    chunk_tokens: int  # a job field: the first job's; later jobs of a warm group bring their own

    @property
    def ranks(self) -> int:
        return len(self.nodes)


def plan_group(
    layout: Layout,
    nodes: Sequence[NodeFacts],
    *,
    model_dtype: str,
    chunk_tokens: int,
    exchange: Exchange | None = None,
) -> GroupPlan:
    """The plan for `layout` on `nodes` (one per rank). `exchange` forces one (RINGQ_EXCHANGE);
    NCCL is used only where every rank has a GPU of its own (it cannot share one)."""
    if len(nodes) != layout.size:
        raise ValueError(f"{layout.label} needs {layout.size} nodes, got {len(nodes)}")
    names = tuple(n.name for n in nodes)
    if shares_a_gpu(nodes):
        nodes = [NodeFacts(n.name, "cpu") for n in nodes]
        chunk_tokens = min(chunk_tokens, CPU_CHUNK_TOKENS)
    chosen = exchange or default_exchange(nodes)
    return GroupPlan(
        layout=layout,
        nodes=names,
        devices=tuple(device_label(n) for n in nodes),
        exchange=chosen,
        transport=transport_for(layout, nodes, chosen),
        compute_dtype=compute_dtype(nodes, model_dtype),
        chunk_tokens=chunk_tokens,
    )


def shares_a_gpu(nodes: Sequence[NodeFacts]) -> bool:
    """A group with GPU ranks that do not each have a GPU of their own. Such a group computes
    on CPU: NCCL refuses two ranks on one GPU, and MLX's ring backend hung while loading."""
    return len(nodes) > 1 and any(n.device == "cuda" for n in nodes) and not own_gpus(nodes)


def default_exchange(nodes: Sequence[NodeFacts]) -> Exchange:
    """All-gather where NCCL can carry it (MLX's NCCL backend has no send/recv; its all_gather
    moved 98 GB/s vs 3 GB/s for ring send/recv on 2xH200), rotation elsewhere."""
    return "allgather" if own_gpus(nodes) else "rotate"


def transport_for(layout: Layout, nodes: Sequence[NodeFacts], exchange: Exchange) -> Transport:
    """NCCL for a ring that exchanges by all-gather with a GPU per rank; MLX's ring backend
    otherwise (rotation and pipelines need send/recv; ranks sharing a GPU break NCCL)."""
    if layout.strategy == "ring" and exchange == "allgather" and own_gpus(nodes):
        return "nccl"
    return "ring"


def own_gpus(nodes: Sequence[NodeFacts]) -> bool:
    """Every node is a CUDA GPU, and no two share one."""
    gpus = [n.gpu for n in nodes if n.device == "cuda" and n.gpu is not None]
    return len(gpus) == len(nodes) and len(set(gpus)) == len(gpus)


def compute_dtype(nodes: Sequence[NodeFacts], model_dtype: str) -> str:
    """CPU ranks compute in float32 (bf16/fp16 matmul is 10-20x slower there); GPUs in the
    model's own dtype."""
    return "float32" if any(n.device == "cpu" for n in nodes) else model_dtype


def default_chunk_tokens(device: Device) -> int:
    return CPU_CHUNK_TOKENS if device == "cpu" else GPU_CHUNK_TOKENS


def chunk_candidates(device: Device, forced: int | None = None) -> list[int]:
    """Chunk sizes to try, largest first: the forced one alone, else the device's default
    halved down to MIN_CHUNK_TOKENS (the first that fits memory wins)."""
    if forced is not None:
        return [forced]
    sizes, size = [], default_chunk_tokens(device)
    while size >= MIN_CHUNK_TOKENS:
        sizes.append(size)
        size //= 2
    return sizes


def device_label(node: NodeFacts) -> str:
    return f"cuda:{node.gpu}" if node.device == "cuda" and node.gpu else node.device
