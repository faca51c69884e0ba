"""Recovery on one GPU (NCCL), identical failure schedules: checkpoint-restart, in-place
without a shadow, and in-place through L1 / L2 / L3 shadows; the shadows' GPU memory; and a
forced out-of-memory run with and without reclamation; and a crash that also destroys GPU pages.

Run on the GPU machine from the repository root:

    PYTHONPATH=src python bench/gpu_recovery.py --out OUT_DIR [--config examples/gpu-inplace.toml]

Every variant trains the same job (the config's model, data and iterations) with two trainer
crashes (SIGKILL inside the optimizer update of iteration 7, in the backward pass of 14); the
first variant also runs the fault-free reference, and every variant's final state hash is
compared with it. GPU memory per process is sampled with `nvidia-smi` while the jobs run, so
the shadow's footprint is what the driver reports, not an estimate. Writes OUT_DIR/gpu-recovery.json
and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from unbroken.api import run_job
from unbroken.config import JobConfig, load_config
from unbroken.metrics.log import read_jsonl

KILLS = ["kill:rank=0,iter=7,phase=update", "kill:rank=0,iter=14,phase=backward"]
SPIKE = "memspike:rank=0,iter=6,phase=forward,over=256"
PAGELOSS = "pageloss:rank=0,iter=7,phase=writeback,pages=3,parity=1"


def variants(cfg: JobConfig) -> dict[str, JobConfig]:
    def with_(mode: str, level: int, inject: list[str]) -> JobConfig:
        rec = dataclasses.replace(cfg.recovery, mode=mode, shadow_level=level)
        return dataclasses.replace(cfg, recovery=rec, inject=inject)

    return {
        "ckpt_restart": with_("ckpt_restart", 0, KILLS),
        "inplace": with_("inplace", 0, KILLS),
        "L1": with_("inplace", 1, KILLS),
        "L2": with_("inplace", 2, KILLS),
        "L3": with_("inplace", 3, KILLS),
        "pageloss_L3": with_("inplace", 3, [PAGELOSS]),
        "oom_reclaim_L3": with_("inplace", 3, [SPIKE]),
        "oom_no_shadow": with_("inplace", 0, [SPIKE]),
    }


class GpuSampler(threading.Thread):
    """nvidia-smi every `period_s`: per-process used memory and the device total."""

    def __init__(self, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.time()
            apps = _smi("--query-compute-apps=pid,used_memory")
            total = _smi("--query-gpu=memory.used")
            self.samples.append(
                {
                    "t": t,
                    "apps": {int(r[0]): float(r[1]) for r in apps if len(r) == 2},
                    "used_mb": float(total[0][0]) if total and total[0] else None,
                }
            )
            self.stop.wait(self.period_s)


def _smi(query: str) -> list[list[str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in read_jsonl(path) if e.get("run") != "reference"] if path.exists() else []


def _shadow_footprint(events: list[dict], samples: list[dict]) -> dict:
    """Peak GPU memory nvidia-smi reported for each parked shadow's pid."""
    pids = {e["pid"]: e.get("level") for e in events if e.get("kind") == "shadow_ready"}
    peak: dict[int, float] = {}
    for s in samples:
        for pid, mb in s["apps"].items():
            if pid in pids:
                peak[pid] = max(peak.get(pid, 0.0), mb)
    by_level: dict[str, list[float]] = {}
    for pid, mb in peak.items():
        by_level.setdefault(f"L{pids[pid]}", []).append(mb)
    host = [e.get("footprint_mb") for e in events if e.get("kind") == "shadow_ready"]
    return {
        "gpu_mb_per_shadow": {k: max(v) for k, v in by_level.items()},
        "shadows_seen_by_nvidia_smi": len(peak),
        "host_private_mb": host[:1],
    }


def _print_log_tails(run_dir: Path, lines: int = 12) -> None:
    """The end of every trainer's and shadow's log of a variant that failed."""
    for log in sorted(run_dir.glob("logs/*/*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"   --- {log.relative_to(run_dir)}", *("   | " + t for t in tail), sep="\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/gpu-inplace.toml")
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", help="run only these variants")
    args = p.parse_args(argv)
    out = Path(args.out)
    cfg = load_config(JobConfig, Path(args.config))
    sampler = GpuSampler()
    sampler.start()
    results: dict[str, dict] = {}
    ref_hash = None
    for name, vcfg in variants(cfg).items():
        if args.only and name not in args.only:
            continue
        print(
            f"== {name}: {vcfg.recovery.mode}, shadow L{vcfg.recovery.shadow_level}, "
            f"faults {vcfg.inject}",
            flush=True,
        )
        t0 = time.time()
        first = len(sampler.samples)
        summary = run_job(vcfg, out / name, reference=ref_hash is None, quiet=True)
        ref_hash = ref_hash or summary["reference_state_hash"]
        events = _events(out / name)
        recs = summary.get("recoveries", [])
        results[name] = {
            "wall_s": time.time() - t0,
            "state": summary["state"],
            "bit_exact": summary["final_state_hash"] == ref_hash,
            "recoveries": recs,
            "recovery_s": [r.get("total_s") for r in recs],
            "median_recovery_s": statistics.median([r["total_s"] for r in recs]) if recs else None,
            "memory_events": [
                e
                for e in events
                if e.get("kind")
                in (
                    "memory_spike",
                    "memory_spike_failed",
                    "oom_retry",
                    "shadows_reclaimed",
                    "oom",
                    "shadow_level",
                    "oom_injected",
                    "shadows_spawned",
                    "inplace_repair",
                )
            ],
            "failures_detected": [
                {k: e.get(k) for k in ("rank", "iter", "phase", "reason", "how", "kind")}
                for e in events
                if e.get("kind") == "failure_detected"
            ],
            "recoveries_done": sum(e.get("kind") == "recovery_done" for e in events),
            "footprint": _shadow_footprint(events, sampler.samples[first:]),
            "gpu_used_mb_max": max(
                (s["used_mb"] or 0 for s in sampler.samples[first:]), default=None
            ),
        }
        r = results[name]
        print(
            f"   state {r['state']}  bit-exact {r['bit_exact']}  recoveries "
            f"{[round(x or 0, 3) for x in r['recovery_s']]}  failures detected "
            f"{r['failures_detected']}  recoveries done {r['recoveries_done']}  "
            f"device memory max {r['gpu_used_mb_max']} MiB  footprint {r['footprint']}",
            flush=True,
        )
        for e in r["memory_events"]:
            print("   ", {k: v for k, v in e.items() if k not in ("run", "t")}, flush=True)
        if r["state"] != "done" or not r["bit_exact"]:
            _print_log_tails(out / name)
    sampler.stop.set()
    ckpt = results.get("ckpt_restart", {}).get("median_recovery_s")
    table = []
    for name, r in results.items():
        med = r["median_recovery_s"]
        table.append(
            f"{name:16s} {r['state']:6s} exact={r['bit_exact']!s:5s} median recovery "
            f"{med if med is None else round(med, 3)!s:>7s} s"
            + (f"   speedup vs ckpt {ckpt / med:5.1f}x" if ckpt and med else "")
        )
    print("\n".join(table))
    (out / "gpu-recovery.json").write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r["bit_exact"] and r["state"] == "done" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
