"""Small cluster states for the planner tests: a toy workload priced in round numbers."""

from __future__ import annotations

from dataclasses import replace

from unbroken.parallel import Replica, StageGroup, split_layers
from unbroken.plan import ClusterState, Fabric, Layout, Workload

GiB = 2**30

WORKLOAD = Workload(
    num_layers=8,
    tokens=1024,
    sum_sq=1024.0**2,
    alpha_s=1e-6,
    beta_s=1e-10,
    head_s=2e-3,
    message_bytes=2e6,
    layer_params=5e7,
    embed_params=2e7,
    head_params=2e7,
    act_bytes_per_layer=4e8,
    head_act_bytes=1e8,
    reserved_bytes=0.5 * GiB,
    step_s_per_param=1e-11,
)
"""About 1 ms per layer forward; 0.8 GB of state per layer, 0.4 GB of activations."""
FABRIC = Fabric(gpus_per_node=8, intra_bytes_per_s=2e11, inter_bytes_per_s=2e10)


def layout(dp: int, pp: int, tp: int, microbatches: int, layers: int = 8) -> Layout:
    """Megatron rank order (TP, then DP, then PP), even split."""
    split = split_layers(layers, pp)
    edges = [sum(split[:k]) for k in range(pp + 1)]
    return Layout(
        replicas=tuple(
            Replica(
                tuple(
                    StageGroup(
                        tuple((s * dp + d) * tp + i for i in range(tp)), (edges[s], edges[s + 1])
                    )
                    for s in range(pp)
                )
            )
            for d in range(dp)
        ),
        microbatches=(microbatches,) * dp,
    )


def state(lay: Layout, memory: float = 40 * GiB, spare: int = 0) -> ClusterState:
    """Every rank of `lay` healthy (and `spare` standby ranks after them)."""
    top = max(lay.ranks) + 1
    workload = replace(WORKLOAD, num_layers=lay.num_layers)
    return ClusterState.healthy(
        lay.skeleton, workload, FABRIC, memory_bytes=memory, spare=range(top, top + spare)
    )
