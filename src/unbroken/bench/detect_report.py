"""The report of `unbroken bench detect`: both detectors' scores on the measured jobs, the
timing-noise diagnostics, and what each injected fail-slow level really cost, as one JSON-ready
dict (`summarize`) and as the printed table (`print_summary`)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

__all__ = ["print_summary", "summarize"]


def _level_of(spec: str) -> str:
    """The level of a slow fault spec (`level=`, or the factor of older logs)."""
    from unbroken.detect.levels import LEVEL_LOSS, slow_factor_for

    if "level=" in spec:
        return spec.split("level=", 1)[1].split(",", 1)[0]
    factor = float(spec.rsplit("factor=", 1)[1].split(",", 1)[0])
    by_factor = {round(slow_factor_for(lv), 3): lv.value for lv in LEVEL_LOSS}
    return by_factor.get(round(factor, 3), f"{factor:g}")


def _measured_loss(jobs) -> dict[tuple[str, str], list[float]]:
    """Throughput loss each injected (what, level) really caused: 1 - 1 / the median, after
    the fault, of iteration time over the healthy time of the same workload, predicted by a
    workload model fitted on every healthy iteration before it (so that a phase of cheaper
    documents after the fault does not hide part of the loss, nor a costlier one add to it).
    Without per-rank timings: median iteration time after vs before."""
    from unbroken.detect.detector import mb_samples
    from unbroken.detect.workload import WorkloadPredictor

    out: dict[tuple[str, str], list[float]] = {}
    for job in jobs:
        if job.fault_iter is None:
            continue
        healthy = job.observations[2 : job.fault_iter]
        after = job.observations[job.fault_iter + 1 :]
        if not healthy or not after:
            continue
        samples = mb_samples(healthy)
        if samples:
            model = WorkloadPredictor.fit_data_parallel(
                samples, [(o.doc_lengths, o.seconds) for o in healthy]
            )
            ratio = statistics.median(
                o.seconds / model.iteration_time(o.doc_lengths) for o in after
            )
        else:
            ratio = statistics.median(o.seconds for o in after) / statistics.median(
                o.seconds for o in healthy
            )
        out.setdefault((job.fault_what, _level_of(job.fault_spec)), []).append(1.0 - 1.0 / ratio)
    return out


def _mean_active(jobs, level: str, key: str) -> float | None:
    """Mean of a comm fault's `slow_active` field over the jobs of one level."""
    values = [
        j.fault_active[key]
        for j in jobs
        if j.fault_what == "comm" and j.fault_active and _level_of(j.fault_spec) == level
    ]
    return statistics.fmean(values) if values else None


def _multi_doc_share(jobs) -> tuple[float, float]:
    """Share of micro-batches holding several documents; 5th percentile of sum l^2 / N^2."""
    multi, ratios = 0, []
    for job in jobs:
        for o in job.observations:
            for replica in o.doc_lengths:
                for d in replica:
                    multi += len(d) > 1
                    ratios.append(sum(x * x for x in d) / sum(d) ** 2)
    ratios.sort()
    return multi / max(1, len(ratios)), ratios[len(ratios) // 20] if ratios else 1.0


def _levels(series) -> dict[str, dict[str, Any]]:
    """Per injected (what, level): its factor (comm: the mean applied factor and comm share),
    the target and the measured throughput loss, and the number of jobs."""
    from unbroken.detect.levels import LEVEL_LOSS, slow_factor_for

    losses = _measured_loss(series)
    return {
        f"{what}/{lv.value}": {
            "factor": slow_factor_for(lv)
            if what == "compute"
            else _mean_active(series, lv.value, "factor"),
            "comm_share": _mean_active(series, lv.value, "comm_share") if what == "comm" else None,
            "target_loss": LEVEL_LOSS[lv],
            "measured_loss": statistics.fmean(losses[(what, lv.value)]),
            "jobs": len(losses[(what, lv.value)]),
        }
        for what in ("compute", "comm")
        for lv in LEVEL_LOSS
        if losses.get((what, lv.value))
    }


def summarize(series, setup, cfg, t0: float) -> dict[str, Any]:
    """Score `series` (the jobs' `JobSeries`) with our detector (`cfg`), the baseline and the
    baseline that only reports slowdowns; `t0` is when the bench started (for `wall_s`)."""
    from unbroken.bench.detect_evaluate import noise_diagnostics, score_jobs
    from unbroken.detect.detector import DetectorConfig

    ours = score_jobs(series, cfg)
    base = score_jobs(series, DetectorConfig(baseline=True))
    strict = score_jobs(series, DetectorConfig(baseline=True, baseline_slowdowns_only=True))
    multi, q5 = _multi_doc_share(series)
    return {
        "ours": ours.to_dict(),
        "baseline": base.to_dict(),
        "baseline_slowdowns_only": strict.to_dict(),
        "jobs": len(series),
        "faulty_jobs": sum(j.fault_iter is not None for j in series),
        "setup": {
            "world_size": setup.world_size,
            "iterations": setup.iterations,
            "tokens_per_microbatch": setup.tokens_per_microbatch,
            "microbatches_per_rank": setup.microbatches,
            "model": setup.describe(),
            "multi_doc_share": multi,
            "sum_sq_over_n2_p5": q5,
        },
        "noise": noise_diagnostics(series, cfg),
        "levels": _levels(series),
        "per_job": {"ours": ours.detail, "baseline": base.detail},
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "load_avg": os.getloadavg(),
        "wall_s": time.time() - t0,
    }


def print_summary(result: dict[str, Any]) -> None:
    """Print `summarize`'s result as the bench's table."""
    multi, q5 = result["setup"]["multi_doc_share"], result["setup"]["sum_sq_over_n2_p5"]
    rows = [
        ("micro-batch time MAPE (%)", "mb_mape", "{:.2f}"),
        ("iteration time MAPE (%)", "iter_mape", "{:.2f}"),
        ("false alarms per job", "false_alarms_per_job", "{:.2f}"),
        ("validation s per false alarm", "validation_s_per_false_alarm", "{:.2e}"),
        ("accuracy", "accuracy", "{:.3f}"),
        ("detection delay (iterations)", "detect_delay_iters", "{:.2f}"),
        ("detector overhead (% of iter)", "overhead_pct", "{:.3f}"),
        ("benign points dropped per job", "benign_dropped_per_job", "{:.2f}"),
    ]
    modes = ("ours", "baseline", "baseline_slowdowns_only")
    print(f"{'':34}{'ours':>12}{'baseline':>12}{'(slowdowns)':>12}")
    for label, key, fmt in rows:
        cells = ["-" if result[m][key] is None else fmt.format(result[m][key]) for m in modes]
        print(f"{label:34}" + "".join(f"{c:>12}" for c in cells))
    print(
        f"jobs {result['jobs']} ({result['faulty_jobs']} faulty); multi-document micro-batches "
        f"{100 * multi:.1f}%, 5th pct of sum l^2/N^2 = {q5:.2f}"
    )
    noise = result["noise"]
    cpu, floor = noise["mb_mape_cpu"], noise["mb_mape_floor"]
    print(
        "timing noise: micro-batch MAPE on process CPU time "
        + ("-" if cpu is None else f"{cpu:.2f}%")
        + "; error of a perfect model on identical micro-batches "
        + ("-" if floor is None else f"{floor:.2f}%")
    )
    for lv, v in result["levels"].items():
        factor = "-" if v["factor"] is None else f"{v['factor']:.2f}"
        share = "" if v["comm_share"] is None else f" (comm share {v['comm_share']:.1%})"
        print(
            f"level {lv}: factor {factor}{share}, target loss {v['target_loss']:.0%}, "
            f"measured {v['measured_loss']:.0%} ({v['jobs']} jobs)"
        )
