"""Where a training iteration's wall time goes on the GPU (`unbroken bench gpu --profile-step`).

Runs iterations of a trainer under `torch.profiler` and reduces the trace to what MFU depends
on: the wall time, the time at least one kernel ran (the union of the kernel intervals), the
idle gaps on the device longer than a threshold with the host operation that was running when
each began, and device time by kernel family (matrix products, attention, the rest). The raw
per-kernel table goes to the file; the summary goes into the bench's JSON.

Written here rather than taken from a library: the profiler gives events, and the reduction
(busy union, gaps, families) is a few loops specific to this question.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["profile_step"]

_FAMILIES = (
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "cublas", "nvjet", "matmul")),
    ("attention", ("flex", "attention", "flash")),
    ("memcpy_memset", ("memcpy", "memset")),
    ("reduce", ("reduce", "norm")),
)


def _family(name: str) -> str:
    low = name.lower()
    for fam, keys in _FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def _busy_and_gaps(kernels: list[tuple[float, float]], gap_us: float) -> tuple[float, list]:
    """(union of the intervals in us, [(gap start, gap us)] longer than `gap_us`)."""
    busy, gaps = 0.0, []
    end = None
    for s, e in sorted(kernels):
        if end is None or s > end:
            if end is not None and s - end > gap_us:
                gaps.append((end, s - end))
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, gaps


def _host_op_at(cpu_ops: list[tuple[float, float, str]], t: float) -> str:
    """The innermost host operation running at time `t` (the shortest one containing it)."""
    best = None
    for s, e, name in cpu_ops:
        if s <= t <= e and (best is None or e - s < best[1] - best[0]):
            best = (s, e, name)
    return best[2] if best else "?"


def profile_step(trainer, iterations: int, first: int, path: str, gap_ms: float = 0.5) -> dict:
    """Profile `iterations` iterations of `trainer` from `first`; write the kernel table to
    `path`; return the summary (wall, busy, idle, gaps, device ms by family, per iteration)."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        walls = [trainer.run_iteration(first + i).seconds for i in range(iterations)]
    kernels, cpu_ops = [], []
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.events():
        dev = str(getattr(e, "device_type", "")).endswith("CUDA")
        s, d = e.time_range.start, e.time_range.elapsed_us()
        if dev:
            kernels.append((s, s + d))
            by_name[e.name[:100]] += d
        else:
            cpu_ops.append((s, s + d, e.name[:80]))
    busy, gaps = _busy_and_gaps(kernels, gap_ms * 1e3)
    families: dict[str, float] = defaultdict(float)
    for name, us in by_name.items():
        families[_family(name)] += us / 1e3 / iterations
    wall_ms = 1e3 * sum(walls) / iterations
    top = sorted(gaps, key=lambda g: -g[1])[:15]
    out: dict[str, Any] = {
        "iterations": iterations,
        "wall_ms": wall_ms,
        "busy_ms": busy / 1e3 / iterations,
        "idle_ms": wall_ms - busy / 1e3 / iterations,
        "gaps_over_ms": gap_ms,
        "gaps": [{"ms": round(g / 1e3, 3), "host_op": _host_op_at(cpu_ops, s)} for s, g in top],
        "gaps_total_ms": sum(g for _, g in gaps) / 1e3 / iterations,
        "device_ms_by_family": {k: round(v, 2) for k, v in sorted(families.items())},
    }
    with open(path, "w") as f:
        f.write(f"wall {wall_ms:.1f} ms/iter, busy {out['busy_ms']:.1f} ms/iter\n")
        for g in out["gaps"]:
            f.write(f"gap {g['ms']:8.3f} ms at host op {g['host_op']}\n")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:80]:
            f.write(f"{us / 1e3 / iterations:10.3f} ms  {name}\n")
        f.write("-- host ops by self CPU time (ms per iteration, calls)\n")
        host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:40]:
            ms = e.self_cpu_time_total / 1e3 / iterations
            f.write(f"{ms:10.3f} ms  {e.count // iterations:6d}  {e.key[:90]}\n")
    return out
