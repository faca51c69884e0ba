"""Presenting simulator results: the terminal table, the JSON document and the PNG chart.

Owns formatting only; it never computes a model quantity. The chart follows the layout of the
Leto paper's Figure 14: one panel per model (and MTTF), ETTR bars per HOF ratio and policy.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import MappingProxyType
from typing import Any

__all__ = ["advantage_lines", "format_table", "format_workloads", "json_document", "write_chart"]

_POLICY_ORDER = ("inplace", "gemini+", "gemini", "jit")
_COLORS = MappingProxyType(
    {"inplace": "#1b7837", "gemini+": "#2166ac", "gemini": "#92c5de", "jit": "#d6604d"}
)


_NOTES = (
    ("never makes progress", "T_rec >= MTTF: no progress in the closed form; use --des"),
    (
        "assumption 1",
        "T_rec/MTTF > 0.1: recovery is not short against the time between failures "
        "(assumption 1); the linear factor 1 - T_rec/MTTF is approximate",
    ),
    (
        "assumption 2",
        "over 3% of failures are expected during another recovery (assumption 2 breaks); "
        "the closed form charges each a full T_rec",
    ),
    (
        "outlasts an iteration",
        "the checkpoint transfer outlasts an iteration, so L = I/2 + 1 underestimates rollback",
    ),
    (
        "discrete-event and closed form differ",
        "discrete-event and closed form differ by more than 1 point: trust the discrete-event",
    ),
)


def _note_index(warning: str, notes: dict[str, int]) -> int:
    text = next((t for key, t in _NOTES if key in warning), warning)
    return notes.setdefault(text, len(notes) + 1)


def _fmt_s(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def format_table(rows: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> str:
    """A plain-text table of the rows, the in-place advantage, and the assumption warnings."""
    des = any("ettr_des" in r for r in rows)
    head = (
        f"{'model':14}{'GPUs':>8}{'MTTF s':>8}{'HOF':>6}  {'policy':9}{'T_iter s':>9}"
        f"{'I':>5}{'T_rec s':>9}{'ETTR %':>8}"
    )
    if des:
        head += f"{'DES %':>8}{'95% CI':>16}"
    lines = [head, "-" * len(head)]
    notes: dict[str, int] = {}
    for r in rows:
        line = (
            f"{r['model']:14}{r['gpus']:>8}{r['mttf_s']:>8.0f}{r['hof_ratio'] * 100:>5.0f}%  "
            f"{r['policy']:9}{_fmt_s(r['t_iter_s']):>9}{r['ckpt_interval']:>5}"
            f"{_fmt_s(r['t_rec_s']):>9}{r['ettr'] * 100:>8.2f}"
        )
        if des and "ettr_des" in r:
            line += f"{r['ettr_des'] * 100:>8.2f}"
            ci = r.get("ettr_des_ci95")
            line += f"{f'{ci[0] * 100:.2f}-{ci[1] * 100:.2f}':>16}" if ci else f"{'-':>16}"
        marks = sorted({_note_index(w, notes) for w in r.get("warnings", [])})
        if marks:
            line += "  [" + ",".join(str(m) for m in marks) + "]"
        lines.append(line)
    adv = advantage_lines(rows)
    if adv:
        lines += ["", "in-place vs gemini+ (ETTR points):", *adv]
    for s in skipped:
        lines.append(f"skipped {s['policy']} on {s['model']}: {s['reason']}")
    if notes:
        lines += ["", "where the closed form's assumptions (App. C.3) break:"]
        lines += [f"  [{n}] {text}" for text, n in notes.items()]
    return "\n".join(lines)


def advantage_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (model, MTTF): in-place minus gemini+ ETTR at each HOF ratio."""
    by: dict[tuple[str, float], dict[float, dict[str, float]]] = defaultdict(dict)
    for r in rows:
        by[(r["model"], r["mttf_s"])].setdefault(r["hof_ratio"], {})[r["policy"]] = r["ettr"]
    out = []
    for (model, mttf), per_h in by.items():
        parts = []
        for h in sorted(per_h):
            pol = per_h[h]
            if "inplace" in pol and "gemini+" in pol:
                parts.append(f"h={h * 100:.0f}%: {(pol['inplace'] - pol['gemini+']) * 100:+.2f}")
        if parts:
            out.append(f"  {model:14} MTTF {mttf:.0f}s  " + "  ".join(parts))
    return out


def format_workloads(workloads: list[dict[str, Any]]) -> str:
    """One line per workload: the T_iter terms and the checkpoint/RMU costs behind the rows."""
    lines = []
    for w in workloads:
        line = f"{w['model']} on {w['hardware']}, {w['gpus']} GPUs: T_iter {w['t_iter_s']:.2f}s"
        if "t_pipeline_s" in w:
            line += (
                f" = pipeline {w['t_pipeline_s']:.2f} + sync {w['t_sync_s']:.3f} (serial "
                f"{w['t_sync_serial_s']:.3f}, exposed {w['exposed_s']:.3f}) + update "
                f"{w['t_update_s']:.3f}"
            )
        line += (
            f"; T_ckpt {w['t_ckpt_s']:.2f}s, remote load {w['load_remote_s']:.2f}s, "
            f"RMU omega {w['omega'] * 100:.2f}%"
        )
        lines.append(line)
    return "\n".join(lines)


def json_document(
    rows: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    name: str,
    workloads: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `--json` document: {"scenario", "rows", "skipped", "workloads"}."""
    clean = []
    for r in rows:
        row = dict(r)
        if row.get("ettr_des_ci95") is not None:
            row["ettr_des_ci95"] = list(row["ettr_des_ci95"])
        clean.append(row)
    return {"scenario": name, "rows": clean, "skipped": skipped, "workloads": workloads or []}


def write_chart(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Write a Figure-14-style PNG: a panel per (MTTF, model), bars per HOF ratio and policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    mttfs = sorted({r["mttf_s"] for r in rows})
    policies = [p for p in _POLICY_ORDER if any(r["policy"] == p for r in rows)]
    fig, axes = plt.subplots(
        len(mttfs), len(models), figsize=(4.2 * len(models), 3.4 * len(mttfs)), squeeze=False
    )
    width = 0.8 / max(1, len(policies))
    for i, mttf in enumerate(mttfs):
        for j, model in enumerate(models):
            ax = axes[i][j]
            sub = [r for r in rows if r["model"] == model and r["mttf_s"] == mttf]
            hs = sorted({r["hof_ratio"] for r in sub})
            for k, pol in enumerate(policies):
                vals = []
                for h in hs:
                    match = [r["ettr"] for r in sub if r["hof_ratio"] == h and r["policy"] == pol]
                    vals.append(match[0] * 100 if match else 0.0)
                xs = [x + (k - (len(policies) - 1) / 2) * width for x in range(len(hs))]
                bars = ax.bar(xs, vals, width, label=pol, color=_COLORS.get(pol))
                for bar, v in zip(bars, vals, strict=True):
                    if v:
                        ax.annotate(
                            f"{v:.1f}",
                            (bar.get_x() + bar.get_width() / 2, v),
                            ha="center",
                            va="bottom",
                            fontsize=6,
                        )
            gpus = sub[0]["gpus"] if sub else 0
            ax.set_title(f"{model}, {gpus:,} GPUs, MTTF {mttf / 60:g} min", fontsize=9)
            ax.set_xticks(range(len(hs)), [f"{h * 100:.0f}%" for h in hs])
            ax.set_xlabel("HOF ratio")
            ax.set_ylim(50, 100)
            if j == 0:
                ax.set_ylabel("ETTR (%)")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(policies), fontsize=8)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
