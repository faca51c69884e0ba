"""The job's memory budget on a CPU node, enforced by the kernel (cgroup v1 memory controller).

Leto §6 reclaims a shadow's GPU memory from inside the active trainer's allocator: before the
allocator reports an OOM, the controller kills the shadow, waits for its memory to be returned,
and the allocation is retried. On a CPU node the same contract is made real with a memory
cgroup around the job's trainers, shadows and state managers:

- `memory.limit_in_bytes` = the budget (`recovery.memory_budget_mb`): the kernel charges every
  page the job touches (anonymous memory, the retained memfd pages, page cache) against it;
- with reclamation on, `memory.oom_control` = `oom_kill_disable 1`: an allocation over the
  budget is not failed and nobody is killed — the allocating task waits in the kernel, and an
  eventfd registered through `cgroup.event_control` wakes the agent, which kills the shadows,
  waits until they are gone (pidfd), and the kernel retries the allocation: the step succeeds;
- with reclamation off, the kernel's OOM killer acts as on any machine: the same allocation
  kills a process — the OOM the controller exists to prevent.

No maintained library manages cgroup-v1 OOM notification (the kernel interface is three files
and an eventfd), so it is written here. cgroup v2 has no `oom_kill_disable`; on such hosts, or
without permission to create a cgroup, a configured budget is refused with a one-line reason.
The agent itself stays outside the cgroup: it must never wait on the memory it is reclaiming.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["BudgetUnavailable", "MemoryBudget", "private_bytes", "require_budget_support"]

_V1_ROOT = Path("/sys/fs/cgroup/memory")
MIB = 1 << 20


class BudgetUnavailable(RuntimeError):
    """This host cannot enforce a memory budget (the message says why)."""


def _own_v1_cgroup() -> Path:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as exc:
        raise BudgetUnavailable(f"cannot read /proc/self/cgroup: {exc}") from None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = _V1_ROOT / path.lstrip("/")
            if where.is_dir():
                return where
            if _V1_ROOT.is_dir():  # the container's own cgroup is the mount's root
                return _V1_ROOT
    raise BudgetUnavailable(
        "no cgroup-v1 memory controller (needed for a memory budget: cgroup v2 cannot hold an "
        "over-budget allocation while the shadows are reclaimed)"
    )


def private_bytes(pid: int) -> int:
    """Bytes only this process maps (what killing it returns): Private_Clean + Private_Dirty
    of /proc/PID/smaps_rollup; 0 if it is gone."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


class MemoryBudget:
    """One cgroup for one job's processes on this node.

    Args:
        name: the cgroup's directory name (under the agent's own memory cgroup).
        limit_bytes: the budget.
        hold_on_oom: True = an over-budget allocation waits for reclamation (and `eventfd`
            becomes readable); False = the kernel OOM killer acts.
    """

    def __init__(self, name: str, limit_bytes: int, hold_on_oom: bool) -> None:
        parent = _own_v1_cgroup()
        self.path = parent / name
        try:
            self.path.mkdir(exist_ok=True)
            self._write("memory.limit_in_bytes", str(limit_bytes))
            self._write("memory.oom_control", "1" if hold_on_oom else "0")
        except OSError as exc:
            self._remove()
            raise BudgetUnavailable(f"cannot set up the memory cgroup {self.path}: {exc}") from None
        self.limit = int(self._read("memory.limit_in_bytes"))
        self.hold_on_oom = hold_on_oom
        self.eventfd: int | None = None
        if hold_on_oom:
            self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            ctl = os.open(self.path / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
            try:
                self._write("cgroup.event_control", f"{self.eventfd} {ctl}")
            finally:
                os.close(ctl)  # the kernel holds its own reference once registered

    @property
    def procs_file(self) -> str:
        """Write a pid here (`echo PID > ...`) to put that process under the budget."""
        return str(self.path / "cgroup.procs")

    def _write(self, name: str, value: str) -> None:
        with open(self.path / name, "w") as fh:
            fh.write(value)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def usage(self) -> int:
        return int(self._read("memory.usage_in_bytes"))

    def peak(self) -> int:
        return int(self._read("memory.max_usage_in_bytes"))

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", "0")

    def under_oom(self) -> bool:
        fields = dict(line.split() for line in self._read("memory.oom_control").splitlines())
        return fields.get("under_oom") == "1"

    def oom_kills(self) -> int:
        fields = dict(line.split() for line in self._read("memory.oom_control").splitlines())
        return int(fields.get("oom_kill", "0"))

    def drain_events(self) -> int:
        """How many OOM notifications arrived since the last call (reads the eventfd)."""
        if self.eventfd is None:
            return 0
        try:
            return os.eventfd_read(self.eventfd)
        except BlockingIOError:
            return 0

    def release_oom_hold(self) -> None:
        """Let the kernel OOM killer act (nothing left to reclaim: the OOM is real)."""
        self._write("memory.oom_control", "0")

    def restore_oom_hold(self) -> None:
        if self.hold_on_oom:
            self._write("memory.oom_control", "1")

    def _remove(self) -> None:
        with contextlib.suppress(OSError):  # still has processes: left to the kernel
            self.path.rmdir()

    def close(self) -> None:
        """Remove the cgroup once its processes are gone (they are, after the agent's
        shutdown kills them); a cgroup that still has processes is left to the kernel."""
        if self.eventfd is not None:
            os.close(self.eventfd)
            self.eventfd = None
        self._remove()


def require_budget_support() -> None:
    """Raise `BudgetUnavailable` (saying why) unless this host can enforce a memory budget."""
    MemoryBudget(f"unbroken-check{os.getpid()}", 1 << 30, hold_on_oom=True).close()
