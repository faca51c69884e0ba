"""Which resumable updater a job gets: the graph-replayed one on a GPU where it applies, the
stream-ordered one on a GPU otherwise, the host-marked one on the CPU (see `unbroken.update.rmu`,
`.stream`, `.graph` for what each adds)."""

from __future__ import annotations

from typing import Literal

from unbroken.update.graph import GraphUpdater, graph_capable
from unbroken.update.rmu import ResumableUpdater
from unbroken.update.stream import StreamUpdater, stream_capable

__all__ = ["UpdaterKind", "resumable_updater"]

UpdaterKind = Literal["auto", "unfused", "stream", "host"]
"""auto: the fastest that applies; unfused: the graph with the ten-launch transactions (no
fused step + parity kernel; for comparisons); stream: never the graph; host: the host-marked
updater (CPU semantics, wrong for a GPU crash — for comparisons only)."""


def resumable_updater(
    state, geometry, step, regions, prot, *, kind: UpdaterKind = "auto", backend: str = "auto"
) -> ResumableUpdater:
    """The resumable updater for this state (see the module docstring), built once."""
    if kind == "host" or not stream_capable(state, regions, prot, backend):
        cls = ResumableUpdater
    elif kind == "stream" or not graph_capable(step):
        cls = StreamUpdater
    else:
        fused = kind != "unfused"
        return GraphUpdater(state, geometry, step, regions, prot, backend=backend, fused=fused)
    return cls(state, geometry, step, regions, prot, backend=backend)
