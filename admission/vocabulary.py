"""ringq's words, each defined once: CLI flags, settings, JSON fields and code all use these.

- strategy: how a job's model is spread over a group's ranks (single, ring, pipeline); a job
  asks for one of them or "auto" (the dispatcher chooses).
- ranks: how many rank processes a group has, one per node, whatever the strategy.
- kv_layout: where a ring group keeps its KV after prefill (replicated on every rank, or sharded).
- exchange: how ring ranks share K/V blocks during prefill (rotate to a neighbour, or allgather).
- transport: the mx.distributed backend a group joins (MLX's TCP "ring", or "nccl" on CUDA).
- device: what a node computes on (cpu, metal, cuda). Not to be confused with transport.
"""

from typing import Literal

Strategy = Literal["single", "ring", "pipeline"]
StrategyChoice = Literal["auto", Strategy]
KVLayout = Literal["replicated", "sharded"]
Exchange = Literal["rotate", "allgather"]
Transport = Literal["ring", "nccl"]
Device = Literal["cpu", "metal", "cuda"]
ComputeDtype = Literal["float32", "float16", "bfloat16"]

STRATEGIES: tuple[Strategy, ...] = ("single", "ring", "pipeline")
STRATEGY_CHOICES: tuple[StrategyChoice, ...] = ("auto", *STRATEGIES)
KV_LAYOUTS: tuple[KVLayout, ...] = ("replicated", "sharded")
EXCHANGES: tuple[Exchange, ...] = ("rotate", "allgather")
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
