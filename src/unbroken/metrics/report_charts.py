"""The run report's charts, drawn with matplotlib and returned as inline SVG text.

Why matplotlib SVG rather than a JavaScript charting library: the report is a static record of a
finished run, so nothing needs to redraw in the page; matplotlib is already a dependency of
unbroken (the runtime's `plot.png`), maintained, and gets axes, ticks and scales right; its SVG
needs no script, no vendored bundle and no license to carry, and the page stays readable with
scripts disabled. Text is drawn as glyph paths (`svg.fonttype = "path"`), so the page renders
exactly as laid out here on a machine without matplotlib's font — which the label layout
depends on.

Event labels never overlap: each is measured with the figure's renderer and placed in the
first lane (row) of a strip above the plot where it clears every label already placed by
`LABEL_GAP_PX` (`assign_lanes`); the strip grows by one row per lane used.

Every element a reader or a test looks for carries an id (`set_gid`, an SVG `<g id=...>`):
`loss-iter-<run>`, `timeline-loss-<run>`, `timeline-tps-<run>`, `label-<chart>-<i>` (with a
`<title>`), `bar-<i>-<segment>`, `detector-measured`, `detector-predicted`.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

from unbroken.metrics.report_data import (
    SEGMENTS,
    DetectorSeries,
    Marker,
    RecoveryBar,
)

__all__ = [
    "LABEL_GAP_PX",
    "assign_lanes",
    "detector_svg",
    "loss_by_iteration_svg",
    "recovery_bars_svg",
    "timeline_svg",
]

LABEL_GAP_PX = 6.0
"""Least horizontal gap between two labels in one lane, in pixels at the figure's dpi."""

COLORS = {
    "reference": "#1f77b4",
    "faulty": "#ff7f0e",
    "train": "#ff7f0e",
    "failure": "#d62728",
    "recovered": "#2ca02c",
    "slow": "#e377c2",
    "fail_slow": "#9467bd",
    "replan": "#17becf",
    "detect": "#d62728",
    "init": "#ff9896",
    "localize": "#9467bd",
    "reconstruct": "#17becf",
    "recompute": "#7f7f7f",
}
_DPI = 96
_LANE_IN = 0.24  # height of one label lane, inches
_BOTTOM_IN = 0.55  # below the lowest plot: its tick labels and x label, inches
_LABELED = ("failure", "slow", "fail_slow", "replan")


def assign_lanes(spans: Sequence[tuple[float, float]], gap: float = LABEL_GAP_PX) -> list[int]:
    """Lane of each horizontal span (x0, x1) so that spans in one lane are at least `gap`
    apart; spans are taken left to right and each goes to the lowest lane where it fits.

    Returns:
        One lane index (0 = nearest the plot) per span, in the order given.
    """
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    ends: list[float] = []  # right end of the last span in each lane
    lanes = [0] * len(spans)
    for i in order:
        x0, x1 = spans[i]
        lane = next((k for k, end in enumerate(ends) if x0 >= end + gap), len(ends))
        if lane == len(ends):
            ends.append(x1)
        else:
            ends[lane] = x1
        lanes[i] = lane
    return lanes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig, name: str, titles: dict[str, str], *, tight: bool = False) -> str:
    """The figure as an `<svg>` element for inlining: no XML header or metadata, scalable,
    ids salted per chart, a `<title>` in each labelled group; `tight` crops or extends the
    canvas to what is drawn (long tick labels)."""
    import matplotlib

    plt = _pyplot()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": f"unbroken-{name}"}):
        fig.savefig(
            buf, format="svg", metadata={"Date": None}, bbox_inches="tight" if tight else None
        )
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)
    # Scalable: drop the fixed size (the viewBox stays); at most 1.3x its drawn size, so
    # text is never blown up past legibility on a wide screen.
    width_px = fig.get_size_inches()[0] * _DPI * 1.3
    text = re.sub(
        r'<svg([^>]*?) width="[^"]*" height="[^"]*"',
        rf'<svg\1 class="chart" id="chart-{name}" role="img" style="max-width: {width_px:.0f}px"',
        text,
        count=1,
    )
    for gid, title in titles.items():
        text = text.replace(f'<g id="{gid}">', f'<g id="{gid}"><title>{_esc(title)}</title>', 1)
    return text


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _label_strip(fig, strip, chart: str, marks: list[tuple[float, str, str]]) -> dict[str, str]:
    """Place labels (x in data units, text, color) in lanes in `strip` (an axes sharing x with
    the plot below it) and grow the figure by the lanes used. Returns {gid: title}."""
    strip.set_ylim(0, 1)
    strip.axis("off")
    if not marks:
        return {}
    fig.canvas.draw()  # settles the autoscaled x limits the labels are measured against
    renderer = fig.canvas.get_renderer()
    right = strip.get_window_extent(renderer).x1
    texts, spans = [], []
    for i, (x, label, color) in enumerate(marks):
        t = strip.text(x, 0.0, label, color=color, fontsize=8, va="bottom", ha="left")
        t.set_gid(f"label-{chart}-{i}")
        box = t.get_window_extent(renderer)
        if box.x1 > right:  # no room to the right of its line: end the label at it
            t.set_horizontalalignment("right")
            box = t.get_window_extent(renderer)
        texts.append(t)
        spans.append((box.x0, box.x1))
    lanes = assign_lanes(spans)
    n = max(lanes) + 1
    w, h = fig.get_size_inches()
    strip_h = strip.get_position().height * h
    extra = max(0.0, n * _LANE_IN - strip_h)
    fig.set_size_inches(w, h + extra)
    # Keep every other axes' height in inches: scale the figure-fraction boxes.
    scale = h / (h + extra)
    for ax in fig.axes:
        box = ax.get_position()
        if ax is strip:
            ax.set_position(
                [box.x0, box.y0 * scale, box.width, box.height * scale + extra / (h + extra)]
            )
        else:
            ax.set_position([box.x0, box.y0 * scale, box.width, box.height * scale])
    strip.set_ylim(0, n)
    for t, lane, (x, _, color) in zip(texts, lanes, marks, strict=True):
        t.set_y(lane + 0.12)
        strip.vlines(x, 0, lane + 0.12, color=color, lw=0.6)  # leader from the plot to it
    return {t.get_gid(): t.get_text() for t in texts}


def _figure(rows: Sequence[float], width: float = 6.4):
    """A figure with a label strip on top and plots sharing its x axis, at fixed margins (so
    label positions measured before a resize stay valid)."""
    plt = _pyplot()
    heights = [_LANE_IN, *rows]
    fig = plt.figure(figsize=(width, sum(heights) + _BOTTOM_IN), dpi=_DPI)
    grid = fig.add_gridspec(
        len(heights),
        1,
        height_ratios=heights,
        hspace=0.08,
        left=0.12,
        right=0.97,
        top=0.98,
        bottom=_BOTTOM_IN / (sum(heights) + _BOTTOM_IN),
    )
    strip = fig.add_subplot(grid[0])
    axes = [fig.add_subplot(grid[i + 1], sharex=strip) for i in range(len(rows))]
    return fig, strip, axes


def _vlines(axes, marks: Sequence[tuple[float, str]]) -> None:
    for ax in axes:
        for x, kind in marks:
            ax.axvline(x, color=COLORS[kind], lw=0.9, ls="--" if kind != "recovered" else ":")


def _done(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last attempt of each iteration, in iteration order."""
    last = {m["iter"]: m for m in rows}
    return [last[i] for i in sorted(last)]


def loss_by_iteration_svg(runs: dict[str, list[dict[str, Any]]], marks: list[Marker]) -> str:
    """Loss per iteration of every run on one axis (a bit-exact run lies on its reference);
    failures and fail-slow events marked at their iteration."""
    fig, strip, (ax,) = _figure([3.0])
    for name, rows in runs.items():
        done = _done(rows)
        width, style = (4.0, "-") if name == "reference" else (1.4, "--")
        (line,) = ax.plot(
            [m["iter"] for m in done],
            [m["loss"] for m in done],
            style,
            lw=width,
            color=COLORS.get(name, "#444"),
            alpha=0.55 if name == "reference" else 1.0,
            marker=None if name == "reference" else ".",
            ms=3,
            label=name,
        )
        line.set_gid(f"loss-iter-{name}")
    shown = [m for m in marks if m.kind in _LABELED and m.iteration is not None]
    _vlines([ax], [(m.iteration, m.kind) for m in shown])
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.25)
    titles = _label_strip(
        fig,
        strip,
        "iter",
        [(m.iteration, f"{m.label} @{m.iteration}", COLORS[m.kind]) for m in shown],
    )
    return _svg(fig, "loss-iter", titles)


def timeline_svg(runs: dict[str, list[dict[str, Any]]], marks: list[Marker]) -> str:
    """Loss and tokens/s of every run against seconds since its first iteration; failures,
    recoveries, fail-slow detections and re-plans of the run with failures marked."""
    fig, strip, (ax_loss, ax_tps) = _figure([1.9, 1.6])
    for name, rows in runs.items():
        if not rows:
            continue
        t0 = min(m["t_start"] for m in rows)
        xs = [m["t_end"] - t0 for m in rows]
        color = COLORS.get(name, "#444")
        (a,) = ax_loss.plot(
            xs, [m["loss"] for m in rows], ".-", ms=2.5, lw=1, color=color, label=name
        )
        (b,) = ax_tps.plot(
            xs, [m["tokens_per_s"] for m in rows], ".-", ms=2.5, lw=1, color=color, label=name
        )
        a.set_gid(f"timeline-loss-{name}")
        b.set_gid(f"timeline-tps-{name}")
    _vlines([ax_loss, ax_tps], [(m.t, m.kind) for m in marks])
    failures = [m for m in marks if m.kind == "failure"]
    recovered = [m for m in marks if m.kind == "recovered"]
    for f, r in zip(failures, recovered, strict=False):
        for ax in (ax_loss, ax_tps):
            ax.axvspan(f.t, max(r.t, f.t), color=COLORS["failure"], alpha=0.08, lw=0)
    ax_loss.set_ylabel("loss")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_xlabel("seconds since the run's first iteration")
    ax_loss.legend(loc="upper right", fontsize=8)
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.25)
    ax_loss.tick_params(labelbottom=False)
    shown = [m for m in marks if m.kind in _LABELED]
    titles = _label_strip(fig, strip, "time", [(m.t, m.label, COLORS[m.kind]) for m in shown])
    return _svg(fig, "timeline", titles)


def recovery_bars_svg(bars: list[RecoveryBar]) -> str:
    """One horizontal bar per recovery, stacked by `SEGMENTS`, its total at the end."""
    plt = _pyplot()
    height = 0.9 + 0.42 * max(1, len(bars))
    fig, ax = plt.subplots(figsize=(6.4, height), dpi=_DPI)
    fig.subplots_adjust(left=0.33, right=0.9, top=1 - 0.35 / height, bottom=0.55 / height)
    ys = list(range(len(bars)))[::-1]
    for y, (i, bar) in zip(ys, enumerate(bars), strict=True):
        left = 0.0
        for seg in SEGMENTS:
            s = bar.seconds[seg]
            rect = ax.barh(
                y, s, left=left, color=COLORS[seg], height=0.6, label=seg if i == 0 else None
            )
            rect.patches[0].set_gid(f"bar-{i}-{seg}")
            left += s
        ax.text(left, y, f" {bar.total_s:.2f} s", va="center", fontsize=8)
    ax.set_yticks(ys, [f"{b.label} ({b.mode})" for b in bars], fontsize=8)
    ax.set_xlabel("seconds from the failure")
    ax.legend(
        ncols=len(SEGMENTS),
        fontsize=7,
        loc="lower center",
        bbox_to_anchor=(0.4, 1.0),
        frameon=False,
    )
    ax.grid(axis="x", alpha=0.25)
    ax.set_xlim(0, max((b.total_s for b in bars), default=1.0) * 1.18 or 1.0)
    return _svg(
        fig,
        "recovery",
        {
            f"bar-{i}-{s}": f"{b.label}: {s} {b.seconds[s]:.3f} s"
            for i, b in enumerate(bars)
            for s in SEGMENTS
        },
        tight=True,
    )


def _runs(xs: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs (first, last) of sorted integers."""
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return out


def _gapped(its: Sequence[int], ys: Sequence[float | None]) -> tuple[list[int], list[float]]:
    """Points over every iteration from the first to the last, NaN where none was fed, so a
    line breaks where the detector saw nothing (recovery grace, a dropped iteration)."""
    by = dict(zip(its, ys, strict=True))
    xs = list(range(min(its), max(its) + 1))
    return xs, [float("nan") if by.get(x) is None else by[x] for x in xs]


def detector_svg(series: DetectorSeries, marks: list[Marker]) -> str:
    """Measured iteration time against the detector's predicted healthy time per iteration;
    the injected slow-down and the detections marked."""
    fig, strip, (ax,) = _figure([2.6])
    (m,) = ax.plot(
        *_gapped(series.iterations, series.measured_s),
        ".-",
        lw=1,
        ms=3,
        color="#333",
        label="measured",
    )
    m.set_gid("detector-measured")
    if any(p is not None for p in series.predicted_s):
        (p,) = ax.plot(
            *_gapped(series.iterations, series.predicted_s),
            "-",
            lw=2,
            color=COLORS["fail_slow"],
            alpha=0.8,
            label="predicted healthy",
        )
        p.set_gid("detector-predicted")
    warm = [i for i, p in zip(series.iterations, series.predicted_s, strict=True) if p is None]
    for k, (a, b) in enumerate(_runs(warm)):
        ax.axvspan(
            a - 0.5, b + 0.5, color="#bbb", alpha=0.3, lw=0, label="warm-up" if not k else None
        )
    shown = [
        mk
        for mk in marks
        if mk.kind in ("slow", "fail_slow", "replan") and mk.iteration is not None
    ]
    _vlines([ax], [(mk.iteration, mk.kind) for mk in shown])
    ax.set_xlabel("iteration (gaps: not fed — recovery grace)")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.25)
    titles = _label_strip(
        fig,
        strip,
        "detector",
        [(mk.iteration, f"{mk.label} @{mk.iteration}", COLORS[mk.kind]) for mk in shown],
    )
    return _svg(fig, "detector", titles)
