"""The agent's health check of a rank's device (issue 18): is a failure hardware-operable, or
is the device gone for good?

When a trainer exits with a failure, the agent checks the device it ran on before it reports
the exit. A device that fails the check is lost: the exit goes to the coordinator with the
reason (`RankExited.device_lost`), the device's state manager is stopped (its memory is gone
with the device), and the agent refuses to start anything on it again (`refused`). A first
crash on a healthy device stays hardware-operable and is recovered in place as before.

The check: on CPU ranks a device is the node's slot, and its health is what the job's device
registry says (`unbroken.devices`: the `lose` fault writes there, as a GPU's failure
would show in a probe). A probe of a CUDA device itself (context creation and a small
allocation in a child process) is not built: on a GPU node the registry is read as well.
"""

from __future__ import annotations

from collections.abc import Iterable

from unbroken.devices import DeviceRegistry
from unbroken.messages import StartGeneration

__all__ = ["DeviceHealth"]


class DeviceHealth:
    """The devices of one node: which rank runs where, and which are lost."""

    def __init__(self) -> None:
        self.registry: DeviceRegistry | None = None
        self.devices: dict[int, int] = {}
        """rank -> device, of the generation started last."""
        self.lost: dict[int, str] = {}
        """device -> why it is lost."""

    def configure(self, msg: StartGeneration) -> None:
        """A generation starts: its ranks' devices and where their health is read."""
        if msg.device_registry:
            self.registry = DeviceRegistry(msg.device_registry)
        self.devices = {r: msg.devices.get(str(r), r) for r in msg.ranks}

    def device_of(self, rank: int) -> int:
        return self.devices.get(rank, rank)

    def check(self, rank: int) -> str:
        """After `rank`'s trainer failed: "" if its device is healthy, else why it is lost
        (remembered: the device is never used again)."""
        device = self.device_of(rank)
        if device in self.lost:
            return self.lost[device]
        reason = self.registry.lost(device) if self.registry is not None else None
        if reason is None:
            return ""
        self.lost[device] = f"device {device} lost ({reason})"
        return self.lost[device]

    def refused(self, ranks: Iterable[int]) -> list[tuple[int, str]]:
        """Before a generation starts: its ranks whose device is lost (checked now: a trainer
        killed by a stop was never reported), with the reason."""
        return [(r, reason) for r in ranks if (reason := self.check(r))]
