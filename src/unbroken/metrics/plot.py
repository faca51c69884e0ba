"""PNG plot of loss and throughput over time, with failures and recoveries marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_runs"]


def plot_runs(runs: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Plot each run's loss and tokens/s against seconds since its start.

    Args:
        runs: name -> {"metrics": [...], "events": [...]}.
        path: output PNG.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, run in runs.items():
        metrics = run["metrics"]
        if not metrics:
            continue
        t0 = min(m["t_start"] for m in metrics)
        xs = [m["t_end"] - t0 for m in metrics]
        ax_loss.plot(xs, [m["loss"] for m in metrics], ".-", ms=3, label=name)
        ax_tps.plot(xs, [m["tokens_per_s"] for m in metrics], ".-", ms=3, label=name)
        for e in run["events"]:
            if e["kind"] == "failure_injected":
                for ax in (ax_loss, ax_tps):
                    ax.axvline(e["t"] - t0, color="red", ls="--", lw=1)
                ax_loss.annotate(
                    f"{e['fault']} r{e['rank']}",
                    (e["t"] - t0, ax_loss.get_ylim()[1]),
                    color="red",
                    fontsize=7,
                    va="top",
                )
            elif e["kind"] == "recovery_done":
                for ax in (ax_loss, ax_tps):
                    ax.axvline(e["t"] - t0, color="green", ls=":", lw=1)
    ax_loss.set_ylabel("loss")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("seconds since first iteration (red: failure, green: recovered)")
    ax_loss.legend()
    ax_loss.set_title("unbroken: training through failures")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
