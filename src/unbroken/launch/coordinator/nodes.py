"""Where a job's ranks run and how its services are reached — as data, never assumed.

`NodeLayout` assigns ranks to nodes (`even`: node n runs ranks n·k … n·k + k − 1; one node is
the embedded default; `for_devices`: the layout of a world re-planned around lost devices, each
rank on the node of its device); `Endpoints` says where the job's store and control server
listen. The coordinator's core sends
each node its own ranks and writes the endpoints into every generation's spec, so nothing
below it hard-codes a host or a node count.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Endpoints", "NodeLayout", "NodeSpec"]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    node: int
    ranks: tuple[int, ...]
    """Global ranks this node runs (its local ranks, in this order)."""


@dataclass(frozen=True, slots=True)
class NodeLayout:
    nodes: tuple[NodeSpec, ...]

    def __post_init__(self) -> None:
        ranks = sorted(r for n in self.nodes for r in n.ranks)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"node layout: ranks must be 0..N-1 exactly once, got {ranks}")
        ids = [n.node for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node layout: node ids repeat: {ids}")

    @classmethod
    def single(cls, world_size: int) -> NodeLayout:
        """Every rank on node 0."""
        return cls((NodeSpec(0, tuple(range(world_size))),))

    @classmethod
    def even(cls, nodes: int, per_node: int) -> NodeLayout:
        """`nodes` nodes of `per_node` ranks, node n running ranks n·per_node onwards."""
        return cls(
            tuple(NodeSpec(n, tuple(range(n * per_node, (n + 1) * per_node))) for n in range(nodes))
        )

    @classmethod
    def for_devices(cls, devices: tuple[int, ...], node_of_device: dict[int, int]) -> NodeLayout:
        """The layout of a world whose rank r runs on `devices[r]`: every rank on its device's
        node; nodes left without a device are not in it."""
        by_node: dict[int, list[int]] = {}
        for rank, device in enumerate(devices):
            by_node.setdefault(node_of_device[device], []).append(rank)
        return cls(tuple(NodeSpec(n, tuple(r)) for n, r in sorted(by_node.items())))

    @property
    def world_size(self) -> int:
        return sum(len(n.ranks) for n in self.nodes)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.node for n in self.nodes)

    def ranks_of(self, node: int) -> tuple[int, ...]:
        for n in self.nodes:
            if n.node == node:
                return n.ranks
        raise KeyError(f"no node {node} in the layout")

    def node_of(self, rank: int) -> int:
        for n in self.nodes:
            if rank in n.ranks:
                return n.node
        raise KeyError(f"no rank {rank} in the layout")


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the job's services listen (the store's port is known once it is up)."""

    host: str = "127.0.0.1"
    """The address the store and the control server bind and advertise."""
    store_port: int = 0
    control_port: int = 0
    """The control server's port (0: any free one — a single-node job's agent is told it)."""
