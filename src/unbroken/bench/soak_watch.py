"""The soak's resource watch: samples, from a thread of the bench process (never from inside the
runtime), every process of the running job — the job's process tree below the bench process,
read from /proc — and appends one JSON row per sample to `soak.jsonl`.

Per process: open fds (`/proc/PID/fd`), memfds among them (links naming `memfd:`), threads,
RSS and shared memory (`Threads`, `VmRSS`, `RssShmem` of `/proc/PID/status`), summed per class: `coordinator` (the
bench process itself: `run_job` runs the coordinator in the calling process), `agent`,
`state_manager`, `trainer`, `shadow` (the fork server and every process forked from it: idle
shadows, and promoted shadows that now train — a fork keeps its server's cmdline), `zombie`
(exited, not reaped) and `other`. Plus the event log's size and the recoveries so far, read
from `events.jsonl`: each sample is labelled with the number of recoveries finished in the
faulty run (`recovery_done` events), whether one is in progress, and whether the job runs on
fewer devices than it launched with (`degraded`: a node lost and not yet grown back).
Per class also `cpu`: the CPU time its processes used since the previous sample, in cores
(utime + stime of `/proc/PID/stat` over the interval, processes alive at both samples): on a
machine whose ranks share cores, what the other processes take is what the trainers lose, so a
steady iteration time that rises over a run is read against it.

On a GPU job (a `GpuProbe` given) each row also holds `gpu`: the device memory in use on every GPU of
the machine (NVML's device total, in MiB: the state managers' retained allocations, every
trainer's and shadow's CUDA context and caching allocator; what a promoted shadow never gives
back shows there) and, per class, what NVML attributes to the class's processes. Read with
`pynvml` (the `nvidia-ml-py` package, NVIDIA's own binding; the `gpu` extra), never with a
CUDA context of this process.

Samples are taken only once the faulty run has started (the fault-free reference before it
runs without shadows or retained state: another process set).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "CLASSES",
    "GpuProbe",
    "ResourceSampler",
    "alive",
    "classify",
    "descendants",
    "process_state",
    "sample_processes",
]

CLASSES = ("coordinator", "agent", "state_manager", "trainer", "shadow", "zombie", "other")

_MARKERS = (
    ("unbroken.launch.agent", "agent"),
    ("unbroken.state.manager", "state_manager"),
    ("forkserver", "shadow"),
    ("unbroken.launch.trainer", "trainer"),
)


def classify(cmdline: str, state: str = "S") -> str:
    """The class of a job's process from its cmdline (NUL bytes as spaces) and /proc state."""
    if state == "Z":
        return "zombie"
    for marker, name in _MARKERS:
        if marker in cmdline:
            return name
    return "other"


def _proc_tree() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    tree, out, todo = _proc_tree(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def process_state(pid: int) -> str:
    """The process's state letter from /proc (R, S, Z, ...); "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Running or sleeping: not gone, and not a zombie (exited, only its reaping left)."""
    return process_state(pid) not in ("", "Z")


def _read_process(pid: int) -> dict[str, Any] | None:
    """One process's figures; None if it is gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        state = fields.get("State", "S").split()[0]
        fds = memfds = 0
        if state != "Z":
            for name in os.listdir(f"/proc/{pid}/fd"):
                fds += 1
                with contextlib.suppress(OSError):  # closed between listing and reading
                    memfds += "memfd:" in os.readlink(f"/proc/{pid}/fd/{name}")
    except (OSError, ValueError):
        return None
    return {
        "class": classify(cmdline, state),
        "fds": fds,
        "memfds": memfds,
        "threads": int(fields.get("Threads", "0").split()[0] or 0),
        "rss_kib": _kib(fields.get("VmRSS")),
        "shmem_kib": _kib(fields.get("RssShmem")),
    }


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` in seconds; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _kib(value: str | None) -> int:
    return int(value.split()[0]) if value else 0


def sample_processes(
    root_pid: int, cpu: dict[int, tuple[str, float]] | None = None
) -> dict[str, dict[str, int]]:
    """Per class: live processes, fds, memfds, threads, RSS and shared memory (KiB), summed
    over the root process (as `coordinator`) and every process below it. `cpu`, when given,
    receives pid -> (class, CPU seconds so far) of every process read."""
    keys = ("procs", "fds", "memfds", "threads", "rss_kib", "shmem_kib")
    totals = {c: dict.fromkeys(keys, 0) for c in CLASSES}
    for pid in [root_pid, *sorted(descendants(root_pid))]:
        info = _read_process(pid)
        if info is None:
            continue
        cls = "coordinator" if pid == root_pid else info.pop("class")
        info.pop("class", None)
        if cpu is not None and (used := cpu_seconds(pid)) is not None:
            cpu[pid] = (cls, used)
        row = totals[cls]
        row["procs"] += 1
        for key, value in info.items():
            row[key] += value
    return totals


class GpuProbe:
    """NVML's view of the machine's GPUs: memory in use per device and per process.

    Raises (on construction):
        RuntimeError: no NVML (the `nvidia-ml-py` package, or the driver's library, missing).
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError(
                "GPU sampling needs the nvidia-ml-py package (pip install 'unbroken[gpu]')"
            ) from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"NVML did not initialize: {exc}") from exc
        self._nvml = pynvml
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]

    def read(self, classes_of: dict[int, str]) -> dict[str, Any]:
        """{"used_mib": summed over the devices, "classes": MiB per class of `classes_of`
        (pid -> class; processes NVML lists that are not in it count as "other")}."""
        nvml, used, per_class = self._nvml, 0, {}
        for handle in self._handles:
            used += nvml.nvmlDeviceGetMemoryInfo(handle).used
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                cls = classes_of.get(proc.pid, "other")
                per_class[cls] = per_class.get(cls, 0) + (proc.usedGpuMemory or 0)
        mib = 1 << 20
        return {
            "used_mib": round(used / mib, 1),
            "classes": {c: round(b / mib, 1) for c, b in sorted(per_class.items())},
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()


class _EventTail:
    """Reads `events.jsonl` as it grows: the faulty run's recoveries so far."""

    def __init__(self, path: Path, run: str, world: int = 0) -> None:
        self.path, self.run, self.world = path, run, world
        self.offset = 0
        self.started = False
        self.detected = self.done = self.lines = 0
        self.degraded = False
        """The job runs on fewer devices than it launched with (`world`): from a node's loss
        or a re-plan onto fewer devices to the first trainers of the world grown back."""
        self._growing = False

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        self.offset += end
        for line in data[:end].splitlines():
            self.lines += 1
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("run") != self.run:
                continue
            self.started = True
            kind = event.get("kind")
            self.detected += kind == "failure_detected"
            self.done += kind == "recovery_done"
            self._follow_world(event)

    def _follow_world(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        if kind == "node_lost":
            self.degraded, self._growing = True, False
        elif kind == "replan" and "devices_after" in event:
            whole = len(event["devices_after"]) >= self.world
            self.degraded = self.degraded or not whole
            self._growing = self.degraded and whole
        elif kind == "trainer_ready" and self._growing:
            self.degraded = self._growing = False


class ResourceSampler(threading.Thread):
    """Samples the job every `interval_s` into `out_path` (one JSON row per sample) until
    `stop()`; `rows` holds what was written."""

    def __init__(
        self,
        run_dir: Path,
        out_path: Path,
        interval_s: float,
        run: str = "faulty",
        world: int = 0,
        gpu: GpuProbe | None = None,
    ):
        super().__init__(name="soak-sampler", daemon=True)
        self.gpu = gpu
        self.events = _EventTail(run_dir / "events.jsonl", run, world)
        self.events_path = run_dir / "events.jsonl"
        self.out_path = out_path
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()
        self._cpu: dict[int, tuple[str, float]] = {}
        self._t_cpu = self.t0

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        with open(self.out_path, "a") as out:
            while not self._halt.wait(self.interval_s):
                row = self.sample()
                if row is not None:
                    self.rows.append(row)
                    out.write(json.dumps(row, separators=(",", ":")) + "\n")
                    out.flush()

    def sample(self) -> dict[str, Any] | None:
        """One row (None before the faulty run started)."""
        self.events.poll()
        if not self.events.started:
            return None
        cpu: dict[int, tuple[str, float]] = {}
        per_class = sample_processes(os.getpid(), cpu)
        now = time.monotonic()
        for cls, cores in _cpu_rates(self._cpu, cpu, now - self._t_cpu).items():
            per_class[cls]["cpu"] = cores
        self._cpu, self._t_cpu = cpu, now
        gpu = self.gpu.read({pid: c for pid, (c, _) in cpu.items()}) if self.gpu else None
        self.events.poll()  # a recovery that ended while sampling counts as in progress
        try:
            events_bytes = self.events_path.stat().st_size
        except OSError:
            events_bytes = 0
        return {
            "t": round(time.monotonic() - self.t0, 3),
            "recoveries": self.events.done,
            "in_recovery": self.events.detected > self.events.done,
            "degraded": self.events.degraded,
            "events_bytes": events_bytes,
            "events_lines": self.events.lines,
            "classes": per_class,
            **({"gpu": gpu} if gpu is not None else {}),
        }


def _cpu_rates(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], dt: float
) -> dict[str, float]:
    """Per class, the cores its processes used between two samples `dt` seconds apart (only
    processes alive at both: one that started or ended between them is left out)."""
    rates = dict.fromkeys(CLASSES, 0.0)
    if dt <= 0:
        return rates
    for pid, (cls, used) in after.items():
        if pid in before:
            rates[cls] += max(0.0, used - before[pid][1]) / dt
    return {c: round(v, 3) for c, v in rates.items()}
