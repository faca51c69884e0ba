"""Profile terms from a real run's records (internals of `from_run.py`).

Owns the arithmetic from the runtime's per-rank timing records (`unbroken.detect.timing`:
`StageTiming` for plan ranks, `RankTiming` for data-parallel ranks, one JSON line per rank and
iteration in `timings.jsonl`) and its event and metrics logs to the fields of `profile.py`, each
with a line for the profile's `derived` table. Conventions, used throughout:

- a stage's time is the slowest of its ranks (replicas, TP members) in each iteration: the
  gradient reduction and the world-wide sync wait for the slowest;
- a collective's own time is the shortest of its members' blocked times in each iteration: the
  member that arrives last does not wait for the others;
- each statistic is the median over the steady iterations.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

from unbroken.errors import UserError
from unbroken.sim.itertime import IterationInputs, iteration_time

__all__ = [
    "Iteration",
    "dp_terms",
    "ettr_terms",
    "plan_terms",
    "spacing",
    "steady_iterations",
]

Iteration = dict[int, dict[str, Any]]
"""One iteration's timing records by rank."""

Record = dict[str, Any]


def steady_iterations(records: list[Record], skip: Iterable[int] = ()) -> list[Iteration]:
    """Group one run's timing records by iteration, leaving out the first iteration of every
    generation (warm-up), iterations in `skip` (a fault was injected) and iterations some rank
    did not report."""
    by: dict[tuple[int, int], Iteration] = defaultdict(dict)
    for r in records:
        by[(int(r.get("generation", 0)), int(r["iter"]))][int(r["rank"])] = r
    first: dict[int, int] = {}
    for gen, it in by:
        first[gen] = min(first.get(gen, it), it)
    full = max((len(v) for v in by.values()), default=0)
    skipped = set(skip)
    return [
        by[key]
        for key in sorted(by)
        if key[1] != first[key[0]] and key[1] not in skipped and len(by[key]) == full
    ]


def spacing(metrics: list[Record], run: str, skip: Iterable[int] = ()) -> list[float]:
    """Start-to-start times of consecutive iterations of one generation of `run`, leaving out
    each generation's first iteration, iterations that saved a checkpoint and those in `skip`."""
    rows = sorted((m for m in metrics if m.get("run") == run), key=lambda m: m["t_start"])
    first: dict[int, int] = {}
    for m in rows:
        gen = int(m.get("generation", 0))
        first[gen] = min(first.get(gen, m["iter"]), m["iter"])
    skipped = set(skip)
    out = []
    for a, b in itertools.pairwise(rows):
        gen = int(a.get("generation", 0))
        if b["iter"] != a["iter"] + 1 or int(b.get("generation", 0)) != gen:
            continue
        if a["iter"] == first[gen] or a.get("ckpt_s") or a["iter"] in skipped:
            continue
        out.append(b["t_start"] - a["t_start"])
    return out


def _median(steady: list[Iteration], per_iteration: Callable[[Iteration], float]) -> float:
    return statistics.median(per_iteration(it) for it in steady)


def _chunks(rec: Record) -> dict[int, tuple[float, float, int]]:
    """Per virtual stage of a plan rank: (forward+backward per micro-batch, backward (B + W) per
    micro-batch, micro-batches)."""
    acc: dict[int, list[Any]] = defaultdict(lambda: [0.0, 0.0, set()])
    for kind, k, mb, seconds in rec["compute"]:
        acc[k][0] += seconds
        acc[k][1] += seconds if kind != "F" else 0.0
        acc[k][2].add(mb)
    return {k: (t / len(m), b / len(m), len(m)) for k, (t, b, m) in acc.items()}


def _p2p_link(rec: Record) -> float:
    return rec["p2p_min_s"]


_PLAN_DERIVED = MappingProxyType(
    {
        "microbatches": "micro-batches per virtual stage in a rank's F actions",
        "vpp": "virtual stages in the F/B actions / physical stages (a rank's first virtual stage)",
        "stages[].brackets_s": (
            "per virtual stage held: its F + B (+ W) action times per micro-batch (TP collectives "
            "inside), slowest rank of the stage"
        ),
        "stages[].p2p_s": (
            "sends per micro-batch (1 to each neighbouring virtual stage per direction) x the "
            "stage's shortest p2p batch (p2p_min_s: one transfer that did not wait)"
        ),
        "stages[].extra_s": "0: embedding and head + loss run inside the first/last stage's actions",
        "backward_window_s": "B (+ W) action times per micro-batch of the busiest stage",
        "grad_buckets": (
            "one bucket: the gradient reduction's blocked time (reduce_s), shortest member of "
            "each stage, slowest stage; none when there are no replicas"
        ),
        "grad_buckets[].params": (
            "not recorded by runs (bucket sizes): omitted; with one bucket they change nothing"
        ),
        "overlap": "false: the runtime reduces gradients after the last backward (REDUCE_GRAD)",
        "update_s": (
            "OPT_STEP's local work (step_s: protect, AdamW, boundary) of the slowest rank + the "
            "loss/norm all-reduce (sync_s) of the rank that waited least"
        ),
    }
)
"""How `plan_terms` derives each field (the same for every run)."""


# Long: one pass per profile field over the same per-stage records, in profile order.
def plan_terms(steady: list[Iteration]) -> tuple[dict[str, Any], dict[str, str], float]:
    """Every iteration-time field from plan ranks' per-action timings (`StageTiming`).

    Returns:
        (profile fields, derived notes, measured `run_iteration` time of the slowest rank).
    """
    chunks = [{r: _chunks(rec) for r, rec in it.items() if rec["compute"]} for it in steady]
    vstages = {k for it in chunks for c in it.values() for k in c}
    if not vstages:
        raise UserError("the run's timing records hold no compute actions")
    n_virtual = max(vstages) + 1
    # A rank's physical stage is its first virtual stage (virtual stage k runs on k % pp).
    stage_ranks: dict[int, set[int]] = defaultdict(set)
    for it in chunks:
        for r, c in it.items():
            stage_ranks[min(c)].add(r)
    stages = sorted(stage_ranks)
    if n_virtual % len(stages):
        raise UserError(f"{n_virtual} virtual stages do not split over {len(stages)} stages")
    vpp = n_virtual // len(stages)
    microbatches = max(n for it in chunks for c in it.values() for _, _, n in c.values())

    def slowest(it: dict[int, Any], ranks: set[int], value: Callable[[Any], float]) -> float:
        return max(value(it[r]) for r in ranks if r in it)

    table = []
    backward = {}
    for s in stages:
        ranks = stage_ranks[s]
        held = sorted({k for it in chunks for r in ranks if r in it for k in it[r]})
        brackets = [
            statistics.median(slowest(it, ranks, lambda c, k=k: c[k][0]) for it in chunks)
            for k in held
        ]
        sends = sum((k > 0) + (k < n_virtual - 1) for k in held)
        link = _median(steady, lambda it, ranks=ranks: slowest(it, ranks, _p2p_link))
        backward[s] = statistics.median(
            slowest(it, ranks, lambda c: sum(b for _, b, _ in c.values())) for it in chunks
        )
        table.append({"brackets_s": brackets, "p2p_s": sends * link, "extra_s": 0.0})
    busiest = max(range(len(stages)), key=lambda i: sum(table[i]["brackets_s"]) + table[i]["p2p_s"])
    computing = set().union(*stage_ranks.values())

    def reduction(it: Iteration) -> float:
        return max(min(it[r]["reduce_s"] for r in stage_ranks[s] if r in it) for s in stages)

    reduce_s = _median(steady, reduction)
    step_s = _median(steady, lambda it: max(it[r]["step_s"] for r in computing if r in it))
    sync_s = _median(steady, lambda it: min(rec["sync_s"] for rec in it.values()))
    measured = _median(
        steady,
        lambda it: max(
            r["busy_s"] + r["p2p_s"] + r["tp_s"] + r["reduce_s"] + r["sync_s"] for r in it.values()
        ),
    )
    fields = {
        "microbatches": microbatches,
        "vpp": vpp,
        "stages": table,
        "backward_window_s": backward[stages[busiest]],
        "grad_buckets": [{"seconds": reduce_s}] if reduce_s > 0 else [],
        "overlap": False,
        "update_s": step_s + sync_s,
    }
    return fields, dict(_PLAN_DERIVED), measured


def dp_terms(steady: list[Iteration], measured_s: float) -> tuple[dict[str, Any], dict[str, str]]:
    """The iteration-time fields from data-parallel ranks' timings (`RankTiming`); `update_s`
    is fitted as the rest of `measured_s` (nothing after the all-reduce is recorded)."""

    def per_mb(r: Record) -> float:
        # FORWARD 0 -> PROTECT is compute_s + reduce_s; comm_s of it is the all-reduce.
        return (r["compute_s"] + r["reduce_s"] - r["comm_s"]) / len(r["forward_s"])

    microbatches = max(len(r["forward_s"]) for it in steady for r in it.values())
    stage = _median(steady, lambda it: max(per_mb(r) for r in it.values()))
    window = _median(
        steady, lambda it: max(per_mb(r) - statistics.fmean(r["forward_s"]) for r in it.values())
    )
    comm = _median(steady, lambda it: min(r["comm_s"] for r in it.values()))
    buckets = [{"seconds": comm}] if comm > 0 else []
    fields: dict[str, Any] = {
        "microbatches": microbatches,
        "vpp": 1,
        "stages": [{"brackets_s": [stage], "p2p_s": 0.0, "extra_s": 0.0}],
        "backward_window_s": window,
        "grad_buckets": buckets,
        "overlap": False,
    }
    rest = iteration_time(
        IterationInputs(
            microbatches=microbatches,
            stage_s=(stage,),
            backward_window_s=window,
            bucket_s=tuple(b["seconds"] for b in buckets),
            bucket_params=(1.0,) * len(buckets),
            overlap=False,
            update_s=0.0,
        )
    ).iter_s
    fields["update_s"] = max(0.0, measured_s - rest)
    derived = {
        "microbatches": "forward_s entries of a rank's record",
        "vpp": "1: a data-parallel run has one stage",
        "stages[].brackets_s": (
            "(compute_s + reduce_s - comm_s) / micro-batches: FORWARD 0 -> PROTECT without the "
            "all-reduce, slowest rank"
        ),
        "stages[].p2p_s": "0: no pipeline",
        "stages[].extra_s": "0: embedding and head + loss are inside the micro-batch times",
        "backward_window_s": "micro-batch time minus its forward_s, slowest rank",
        "grad_buckets": "one bucket: the all-reduce (comm_s) of the rank that waited least",
        "grad_buckets[].params": "not recorded by runs: omitted; with one bucket they change nothing",
        "overlap": "false: the trainer all-reduces after the last micro-batch's backward",
        "update_s": (
            "FITTED, not measured: the median start-to-start iteration minus T_pipeline and "
            "T_sync. Data-parallel timings stop at PROTECT; the trainer would need to record the "
            "PROTECT -> BOUNDARY end time (as plan ranks' step_s + sync_s) for a measured value"
        ),
    }
    return fields, derived


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


# Long: each ETTR field with its fallback and the line saying how it was derived.
def ettr_terms(
    config: Record, summary: Record, events: list[Record], metrics: list[Record], run: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields the ETTR model adds: checkpoint cost and loads, RMU overhead, size."""
    saves = [e["seconds"] for e in events if e["kind"] == "checkpoint_saved"]
    loads = [e["seconds"] for e in events if e["kind"] == "checkpoint_loaded"]
    repairs = [e["total_ms"] / 1e3 for e in events if e["kind"] == "inplace_repair"]
    derived = {}
    ckpt = _mean(saves)
    if ckpt is not None:
        derived["ckpt_s"] = f"mean of {len(saves)} checkpoint_saved events (the save blocks)"
    else:
        ckpt = float(summary.get("ckpt_cost_s") or 0.0)
        derived["ckpt_s"] = "summary.json ckpt_cost_s" if ckpt else "0: the run saved no checkpoint"
    remote = _mean(loads)
    if remote is not None:
        derived["ckpt_load_remote_s"] = f"mean of {len(loads)} checkpoint_loaded events"
    else:
        remote = ckpt
        derived["ckpt_load_remote_s"] = "no checkpoint was loaded: the save time (same bytes)"
    local = _mean(repairs)
    if local is not None:
        derived["ckpt_load_local_s"] = (
            f"mean of {len(repairs)} inplace_repair events (state rebuilt from host memory)"
        )
    else:
        local = remote
        derived["ckpt_load_local_s"] = "no in-place repair in the run: the remote load time"
    parallel = config.get("parallel", {})
    recovery = config.get("recovery", {}).get("mode")
    others = sorted({m.get("run") for m in metrics} - {run})
    rmu = 0.0
    if recovery == "inplace" and run == "reference" and others:
        faulty = others[0]
        hit = {
            e["iter"] for e in events if e.get("run") == faulty and e["kind"] == "failure_injected"
        }
        theirs, ours = spacing(metrics, faulty, hit), spacing(metrics, run)
        if theirs and ours:
            rmu = max(0.0, statistics.median(theirs) - statistics.median(ours))
        derived["rmu_s"] = (
            f"median start-to-start iteration of run {faulty!r} (in-place recovery: RMU on) minus "
            "the reference's; includes any other steady fault-tolerance overhead"
        )
    else:
        derived["rmu_s"] = "0: no in-place run next to a reference in this dir"
    derived["gpus"] = "config.json parallel.world_size"
    derived["replicated_optimizer"] = (
        "config.json parallel.dp > 1: every replica keeps its stage's full optimizer state"
    )
    derived["moe_a2a_s, interference_dense, interference_moe"] = (
        "0: the runtime neither overlaps gradient sync with compute nor runs inter-node "
        "all-to-all, so there is nothing to measure"
    )
    fields = {
        "ckpt_s": ckpt,
        "ckpt_load_remote_s": remote,
        "ckpt_load_local_s": local,
        "rmu_s": rmu,
        "gpus": int(parallel.get("world_size") or summary.get("world_size") or 1),
        "replicated_optimizer": int(parallel.get("dp") or 1) > 1,
    }
    return fields, derived
