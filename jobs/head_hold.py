"""What is held for the head, the oldest job waiting for memory (pure; the rule is stated in
jobs/admit_plan.py, the holds are kept in Redis by jobs/memory_waits.py).

The head's need on each node it waits for counts as a group of its own there: its bytes, and
one of the node's group slots (a GPU runs one group, so a GPU the head waits for runs nothing
else meanwhile)."""

from dataclasses import dataclass

from jobs.schemas import NodeInfo


@dataclass(frozen=True)
class HeadHold:
    """The oldest job waiting for memory, and the bytes it waits for on each of its nodes."""

    job_id: str
    bytes_per_node: dict[str, int]

    @property
    def group_id(self) -> str:
        """The name its hold goes by among a node's groups."""
        return f"held-for-{self.job_id}"

    def held_with(self, held: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        """Node -> group -> bytes, with the hold added as a group on each node it waits for."""
        with_hold = {name: dict(groups) for name, groups in held.items()}
        for name, need_bytes in self.bytes_per_node.items():
            with_hold.setdefault(name, {})[self.group_id] = need_bytes
        return with_hold

    def join_budgets(self, nodes: list[NodeInfo]) -> dict[str, int]:
        """Node -> the budget a join may grow a running group's reservation to: less what is
        held for the head there (jobs/warm_groups.py `join` refuses a join past it)."""
        return {n.name: n.memory_bytes - self.bytes_per_node.get(n.name, 0) for n in nodes}

    def leaves_a_slot(
        self,
        group_nodes: list[str] | tuple[str, ...],
        nodes: list[NodeInfo],
        held: dict[str, dict[str, int]],
        cpu_max_groups: int,
    ) -> bool:
        """Whether a running group on `group_nodes` may take another job (a join): on every
        node held for the head, the head's group must still find a slot beside the groups
        there. Never on a GPU the head waits for: the join would keep its group running."""
        for node in nodes:
            if node.name in group_nodes and node.name in self.bytes_per_node:
                limit = 1 if node.backend == "cuda" else cpu_max_groups
                if len(held.get(node.name, {})) + 1 > limit:
                    return False
        return True
