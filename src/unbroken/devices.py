"""The health of a job's devices where no hardware reports it: CPU ranks (issue 18).

On a GPU a lost device is found by probing it; a CPU rank's "device" is its slot on the node,
and nothing in the machine can fail it for real. So a `lose` fault writes the loss here — the
way page loss punches real holes in retained memory — and the agent's health check
(`unbroken.launch.agent.health`) reads it when a trainer exits, exactly as it would read a
probe's answer. Recovery never learns what the injector did any other way.

A device is lost when its file `device-<id>.lost` exists under the registry's directory (the
file holds the reason); written atomically (a rename). It is removed only when the device is
replaced (`clear`: the soak's model of an operator who swaps a node's hardware and starts its
agent again); an agent that saw the device lost never uses it again.

A module of its own at the bottom of the import layers, importing nothing but the standard
library: the agent reads it on every failure, and the agent must not import torch (it would pay
torch's import, seconds on a loaded machine, before it can start a job's trainers).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DeviceRegistry"]


class DeviceRegistry:
    """Args: root (the job's registry directory, created on first write)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _path(self, device: int) -> Path:
        return self.root / f"device-{int(device)}.lost"

    def mark_lost(self, device: int, reason: str) -> None:
        """Record that `device` is gone for the rest of the job."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self._path(device).with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(reason)
        os.replace(tmp, self._path(device))

    def clear(self, device: int) -> None:
        """`device` was replaced (its node came back with new hardware): healthy again. An
        agent that saw it lost keeps it lost; a fresh agent of the node reads it healthy."""
        self._path(device).unlink(missing_ok=True)

    def lost(self, device: int) -> str | None:
        """Why `device` is lost, or None while it is healthy."""
        try:
            return self._path(device).read_text() or "lost"
        except FileNotFoundError:
            return None
