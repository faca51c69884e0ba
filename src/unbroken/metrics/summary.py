"""The run summary (`summary.json`) and the terminal table comparing runs."""

from __future__ import annotations

import statistics
from typing import Any

from unbroken.metrics.analysis import analyze_run, ettr, healthy_iter_s, wall_time
from unbroken.metrics.replans import replan_records
from unbroken.metrics.replay import reference_rows, replay_records, replayed_reference

__all__ = ["audit", "build_summary", "format_table"]


def _run_stats(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    done: dict[int, dict[str, Any]] = {m["iter"]: m for m in metrics}
    return {
        # Iterations run in order, so the last one completed counts them all — including an
        # iteration whose update in-place recovery finished (it has no metrics row of its own).
        "iterations": max(done) + 1 if done else 0,
        "wall_s": wall_time(metrics),
        "mean_iter_s": healthy_iter_s(metrics),
        "final_loss": done[max(done)]["loss"] if done else None,
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in metrics) if metrics else 0.0,
        "attempts": len(metrics),
    }


def _slowness(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's detected and injected slow-downs."""
    return {
        "fail_slow": [
            {
                "what": e.get("what", "compute"),
                **{k: e[k] for k in ("rank", "stage", "factor", "since_iter", "detected_at")},
            }
            for e in events
            if e["kind"] == "fail_slow"
        ],
        "slow_injected": [
            {"rank": e["rank"], "iter": e["iter"], "spec": e["spec"]}
            for e in events
            if e["kind"] == "failure_injected" and e["fault"] == "slow"
        ],
    }


def _replans(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's re-plans (`unbroken.metrics.replans`) and the reports it did not act on (the
    summary has these keys only when there are some)."""
    return {
        "replans": replan_records(events, metrics),
        "replans_skipped": [
            {"trigger": e["trigger"], "reason": e["reason"]}
            for e in events
            if e["kind"] == "replan_skipped"
        ],
    }


def build_summary(
    reference: dict[str, Any] | None,
    faulty: dict[str, Any],
    config: dict[str, Any],
    not_fired: list[str] | None = None,
    replays: list[tuple[Any, dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Summary of a faulty run against its fault-free reference.

    Args:
        reference: {"metrics", "events", "final_state_hash", "state"} of the reference run.
        faulty: the same for the run with failures.
        config: the faulty run's config (as a dict).
        not_fired: the scheduled faults that never fired (`unbroken.inject.faults_not_fired`).
        replays: the reference's replays of the faulty run's plan changes that changed its
            bits ((`ReplayPoint`, the replaying run), `unbroken.metrics.replay`): the audit
            takes the reference's rows from each replay on; ETTR keeps the launch plan's run.
    """
    f_metrics, f_events = faulty["metrics"], faulty["events"]
    healthy = healthy_iter_s(reference["metrics"]) if reference else None
    recoveries = analyze_run(f_metrics, f_events, healthy_s=healthy)
    injected = [e for e in f_events if e["kind"] == "failure_injected" and e["fault"] != "slow"]
    ckpts = [e for e in f_events if e["kind"] == "checkpoint_saved"]
    interval_ev = next((e for e in f_events if e["kind"] == "checkpoint_interval"), None)
    summary: dict[str, Any] = {
        "state": faulty["state"],
        "reason": faulty.get("reason", ""),
        "final_state_hash": faulty["final_state_hash"],
        "failures_injected": len(injected),
        "failures_detected": sum(e["kind"] in ("failure_detected", "node_lost") for e in f_events),
        "faults_not_fired": list(not_fired or []),
        "failures_recovered": len(recoveries),
        "recoveries": [r.as_dict() for r in recoveries],
        "faulty": _run_stats(f_metrics),
        "faulty_wall_s": wall_time(f_metrics),
        "iterations": config["train"]["iterations"],
        "ckpt_interval": interval_ev["interval"]
        if interval_ev
        else config["checkpoint"]["interval"],
        "ckpt_cost_s": statistics.median(e["seconds"] for e in ckpts) if ckpts else 0.0,
        "checkpoints_saved": len(ckpts),
        "mean_iter_s": healthy_iter_s(f_metrics),
        "mttf_s": config["checkpoint"]["mttf_s"],
        "world_size": config["parallel"]["world_size"],
        "recovery_mode": config["recovery"]["mode"],
        **_slowness(f_events),
        "change_points": sum(e["kind"] == "change_point" for e in f_events),
    }
    summary["replica_mismatches"] = [
        {"iter": e["iter"], "ranks": e["ranks"]}
        for e in f_events
        if e["kind"] == "replica_mismatch"
    ]
    if reference is not None:
        summary.update(_against_reference(reference, faulty, replays or []))
    summary.update({k: v for k, v in _replans(f_events, f_metrics).items() if v})
    return summary


def _against_reference(
    reference: dict[str, Any], faulty: dict[str, Any], replays: list[tuple[Any, dict[str, Any]]]
) -> dict[str, Any]:
    """The summary's keys that compare the run with its reference (the audit against the
    replays from each replayed change on, `unbroken.metrics.replay`)."""
    audited = replayed_reference(reference, replays)
    out = {
        "reference_state_hash": audited["final_state_hash"],
        "ettr": ettr(reference["metrics"], faulty["metrics"]),
        "reference": _run_stats(reference["metrics"]),
        "reference_wall_s": wall_time(reference["metrics"]),
        **audit(audited, faulty),
    }
    if replays:
        out["replays"] = replay_records(replays)
        out["launch_reference_state_hash"] = reference["final_state_hash"]
    return out


def _rank_diff(
    ref: list[str] | None, got: list[str] | None, devices: list[int] | None = None
) -> list[int]:
    """Ranks whose hash differs between two runs' per-rank hashes (all of them when the
    runs have different rank counts; none when either run recorded none). `devices` (rank ->
    device of `got`'s run, after a lost device shrank its world): each rank is compared with
    the reference rank that ran on its device, and the devices that differ are returned."""
    if ref is None or got is None:
        return []
    if devices is not None and len(devices) == len(got) and max(devices, default=-1) < len(ref):
        return [d for d, h in zip(devices, got, strict=True) if ref[d] != h]
    if len(ref) != len(got):
        return list(range(max(len(ref), len(got))))
    return [r for r, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b]


def _final_devices(events: list[dict[str, Any]]) -> list[int] | None:
    """rank -> device of a run's last generation (None: never recorded)."""
    done = [e for e in events if e["kind"] == "trainer_done"]
    return done[-1].get("devices") if done else None


def _relaid_from(events: list[dict[str, Any]]) -> int | None:
    """The first generation of a run that ran another pipeline plan than the reference (a
    `plan_applied` with stages at a generation's start: a lost device re-planned, issue 18);
    None when none did. A live switch (no generation: every rank keeps its layers and its
    ranks stay the reference's) does not count."""
    gens = [
        e["generation"]
        for e in events
        if e["kind"] == "plan_applied" and "stages" in e and "generation" in e
    ]
    return min(gens) if gens else None


def audit(reference: dict[str, Any], faulty: dict[str, Any]) -> dict[str, Any]:
    """The bit-exact audit of a faulty run against its fault-free reference: the job's final
    hash, every rank's own final hash, and every hashed iteration — per rank — must match.

    Once a run runs another pipeline plan (`_relaid_from`), its ranks hold other parts of the
    model than the reference's ranks: their own hashes are not compared from that generation
    on, and the job's hash decides. A plan job's hash is taken per parameter, whichever rank
    holds it (`PlanExecutor.job_hash`), so it covers the state of every rank under either plan.
    A reference with replayed plan changes (`unbroken.metrics.replay`) gives each faulty row
    the reference row of its generation (`reference_rows`).

    Returns:
        bit_exact, rank_mismatches (ranks whose final state differs), and
        per_iteration_mismatches (iterations where the job's or some rank's hash differs,
        with the ranks: [{"iter", "ranks"}]).
    """
    relaid = _relaid_from(faulty.get("events", []))
    ranks = _rank_diff(
        reference.get("rank_hashes"),
        None if relaid is not None else faulty.get("rank_hashes"),
        _final_devices(faulty.get("events", [])),
    )
    ref_row = reference_rows(reference)
    per_iter: dict[int, set[int]] = {}
    for m in faulty["metrics"]:
        ref = ref_row(m.get("generation", 0), m["iter"])
        if ref is None or m["state_hash"] is None or ref["state_hash"] is None:
            continue  # an iteration one of the runs did not hash
        own = m.get("rank_hashes")
        if relaid is not None and m.get("generation", 0) >= relaid:
            own = None
        diff = set(_rank_diff(ref.get("rank_hashes"), own, m.get("devices")))
        if diff or m["state_hash"] != ref["state_hash"]:
            per_iter.setdefault(m["iter"], set()).update(diff)
    final_equal = bool(faulty["final_state_hash"]) and (
        faulty["final_state_hash"] == reference["final_state_hash"]
    )
    return {
        "bit_exact": final_equal and not ranks and not per_iter,
        "rank_mismatches": ranks,
        "per_iteration_mismatches": sorted(per_iter),
        "per_rank_mismatches": [
            {"iter": it, "ranks": sorted(r)} for it, r in sorted(per_iter.items()) if r
        ],
    }


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text comparison table of the reference and faulty runs and each recovery."""
    ref, flt = summary.get("reference", {}), summary["faulty"]
    lines = [
        f"{'':24}{'reference':>18}{'with failures':>18}",
        f"{'iterations':24}{ref.get('iterations', '-'):>18}{flt['iterations']:>18}",
        f"{'iteration attempts':24}{ref.get('attempts', '-'):>18}{flt['attempts']:>18}",
        f"{'wall time (s)':24}{ref.get('wall_s', 0):>18.2f}{flt['wall_s']:>18.2f}",
        f"{'median iteration (ms)':24}{ref.get('mean_iter_s', 0) * 1e3:>18.1f}"
        f"{flt['mean_iter_s'] * 1e3:>18.1f}",
        f"{'final loss':24}{ref.get('final_loss') or 0:>18.4f}{flt['final_loss'] or 0:>18.4f}",
        # 18 wide: a 16-digit hash keeps a gap from its neighbour.
        f"{'final state hash':24}{summary.get('reference_state_hash') or '-':>18}"
        f"{summary['final_state_hash'] or '-':>18}",
        "",
        f"bit-exact: {summary.get('bit_exact')}   ETTR: {summary.get('ettr', 0):.3f}   "
        f"failures: {summary['failures_recovered']}/{summary['failures_detected']} recovered "
        f"({summary['failures_injected']} injected)   "
        f"checkpoint interval: {summary['ckpt_interval']} it, cost {summary['ckpt_cost_s']:.3f}s",
    ]
    if summary["state"] != "done":
        lines.append(f"job {summary['state']}: {summary.get('reason') or '(no reason given)'}")
    for rank in summary.get("rank_mismatches", []):
        lines.append(f"audit: rank {rank}'s final state differs from the reference's")
    for m in summary.get("per_rank_mismatches", []):
        lines.append(
            f"audit: iteration {m['iter']}: rank(s) {m['ranks']} differ from the reference"
        )
    for m in summary.get("replica_mismatches", []):
        lines.append(f"audit: iteration {m['iter']}: replica(s) of rank(s) {m['ranks']} differ")
    for spec in summary.get("faults_not_fired", []):
        lines.append(f"scheduled fault never fired: {spec} (past the run's end?)")
    for fs in summary["fail_slow"]:
        where = f"rank {fs['rank']}" if fs["rank"] is not None else "the sync stage"
        what = "communication" if fs.get("what") == "comm" else "compute"
        lines.append(
            f"fail-slow detected: {where} ({what}) {fs['factor']:.2f}x slower since iteration "
            f"{fs['since_iter']}, reported after iteration {fs['detected_at']}"
        )
    lines += _replan_lines(summary)
    lines += _replay_lines(summary)
    if summary["recoveries"]:
        lines += [
            "",
            f"{'failure':34}{'mode':>14}{'shadow':>8}{'detect s':>10}{'init s':>9}"
            f"{'recomp s':>10}{'total s':>9}{'shadows again s':>17}",
        ]
        for r in summary["recoveries"]:
            who = f"node {r['node']}" if r.get("node") is not None else f"rank {r['rank']}"
            what = f"{r.get('fault') or r['kind']} {who} it {r['iteration']} {r['phase']}"
            shadow = f"L{r['shadow_level']}" if r.get("shadow_level") else "-"
            again = r.get("protected_again_s")
            lines.append(
                f"{what:34}{r['mode']:>14}{shadow:>8}{r['detect_s']:>10.3f}{r['init_s']:>9.2f}"
                f"{r['recompute_s']:>10.2f}{r['total_s']:>9.2f}"
                + (f"{again:>17.2f}" if again is not None else f"{'-':>17}")
            )
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.0f} ms" if x is not None else "-"


def _replay_lines(summary: dict[str, Any]) -> list[str]:
    """The table's replayed plan changes ([Note: replayed plan change])."""
    return [
        f"audit: the plan change at iteration {r['iteration']} (TP "
        f"{'/'.join(map(str, r['tp']))}, {r['world']} ranks) changed the bits; from it on the "
        "run is compared with the fault-free reference replayed from "
        f"{'the same checkpoint' if r['from_checkpoint'] else 'the initial state'} "
        f"({r['run']}; the launch plan's reference ends at "
        f"{summary.get('launch_reference_state_hash')})"
        for r in summary.get("replays", [])
    ]


def _replan_lines(summary: dict[str, Any]) -> list[str]:
    """The table's re-plans: trigger, placement before/after, iteration time before/after."""
    lines = []
    for r in summary.get("replans", []):
        t = r["trigger"]
        what = (
            f"rank {t.get('rank')} {t.get('factor', 0):.2f}x slow"
            if t["kind"] == "fail_slow"
            else f"device(s) {t.get('devices')} lost"
        )
        before, after = r.get("measured_before") or {}, r.get("measured_after") or {}
        lines.append(
            f"re-plan at iteration {r['iter']} ({what}): devices {r['devices_before']} -> "
            f"{r['devices_after']}, micro-batches {r['counts_before']} -> {r['counts_after']}; "
            f"iteration {_ms(before.get('iter_s'))} -> {_ms(after.get('iter_s'))} (predicted "
            f"{_ms(r['predicted_before_s'])} -> {_ms(r['predicted_after_s'])})"
            + (f"; reconfiguration {r['reconfig_s']:.2f} s" if r.get("reconfig_s") else "")
            + ("; state moved between the ranks" if r.get("restore") == "reshard" else "")
            + (f" (group {r['communicators_s']:.2f} s)" if r.get("communicators_s") else "")
        )
    for r in summary.get("replans_skipped", []):
        lines.append(f"no re-plan for {r['trigger']['kind']}: {r['reason']}")
    return lines
