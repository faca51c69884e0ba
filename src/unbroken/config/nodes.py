"""The `[nodes]` section: how many hosts a job spans and how many ranks each runs."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodesConfig"]


@dataclass(kw_only=True, slots=True)
class NodesConfig:
    """Nodes (hosts) of the job (issue 19). One node is the embedded default; with more,
    node 0 runs the coordinator and its agent and every other node runs an agent that joins it
    (`unbroken train --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`, docs/multinode.md)."""

    count: int = 1
    """Nodes in the job (`--nnodes`)."""
    ranks_per_node: int = 0
    """Ranks each node runs (`--nproc-per-node`); 0: parallel.world_size / count. Node n runs
    ranks n·k … n·k + k − 1."""
    spares: int = 0
    """Spare nodes that may join beyond `count` (node ids count … count + spares − 1, each with
    `ranks_per_node` devices; `--nnodes N:M`). A spare waits as a standby; when a node is lost
    it takes that node's devices and the job grows back to its launch world at the next
    boundary (`adapt.enabled`)."""
    join_timeout_s: float = 60.0
    """How long the coordinator waits for every node's agent to join, and an agent for the
    coordinator to listen (a node started before node 0 retries until then)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("nodes.count must be >= 1")
        if self.ranks_per_node < 0:
            raise ValueError("nodes.ranks_per_node must be >= 0 (0: world_size / count)")
        if self.spares < 0:
            raise ValueError("nodes.spares must be >= 0")
        if self.join_timeout_s <= 0:
            raise ValueError("nodes.join_timeout_s must be > 0")

    def per_node(self, world_size: int) -> int:
        """Ranks per node for a world of `world_size` ranks.

        Raises:
            ValueError: the nodes do not hold the world exactly.
        """
        k = self.ranks_per_node or world_size // self.count
        if k < 1 or k * self.count != world_size:
            raise ValueError(
                f"nodes: {self.count} node(s) × {self.ranks_per_node or 'world_size/count'} "
                f"rank(s) per node do not make parallel.world_size = {world_size}; set "
                "nodes.ranks_per_node (--nproc-per-node) so that count × ranks_per_node = "
                "world_size"
            )
        return k
