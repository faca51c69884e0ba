"""`report.html`: one self-contained page about a run directory (`unbroken report RUN_DIR`,
written by `unbroken demo` by default).

The page holds the comparison table of `summary.json` (what `unbroken demo` prints at the end),
loss per iteration of both runs on one axis beside the wall-clock timeline of loss and
throughput with failures, recoveries, fail-slow detections and re-plans marked, the stacked
recovery breakdown per failure, the fail-slow detector's predicted against measured iteration
time, and the audit: every iteration's state hash in both runs.

Self-contained: inline CSS and inline SVG charts (`unbroken.metrics.report_charts`, which says
why matplotlib SVG and not a JavaScript library), no script, no font, image or stylesheet from
anywhere — the file opens offline and can be mailed or attached to an issue as it is. This
module only assembles the page; it reads the run through `report_data` and never recomputes
what the summary states.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from unbroken.metrics import report_charts as charts
from unbroken.metrics.report_data import (
    SEGMENTS,
    RunData,
    markers,
    recovery_bars,
)

__all__ = ["render_report", "write_report"]

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0;
  color: #1d1d1f; background: #fafafa; }
main { max-width: 1280px; margin: 0 auto; padding: 12px 24px 48px; }
h1 { font-size: 22px; margin: 12px 0 2px; } h2 { font-size: 17px; margin: 28px 0 8px; }
.sub { color: #555; margin: 0 0 10px; }
.badges span { display: inline-block; margin: 4px 8px 4px 0; padding: 3px 10px;
  border-radius: 12px; background: #e8e8ed; font-weight: 600; }
.badges .ok { background: #d7f5dd; color: #0b6b22; }
.badges .bad { background: #fde2e1; color: #a1120b; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; align-items: start; }
@media (max-width: 1000px) { .grid { grid-template-columns: 1fr; } }
.card { background: #fff; border: 1px solid #e2e2e7; border-radius: 8px; padding: 10px 12px; }
.card h3 { font-size: 14px; margin: 0 0 6px; }
svg.chart { width: 100%; height: auto; display: block; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; background: #fff; }
th, td { padding: 3px 10px; border-bottom: 1px solid #ececf0; text-align: right; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f2f2f5; }
td.hash, .hash { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; }
tr.mismatch td { background: #fde2e1; } tr.redone td { background: #fff7e0; }
.note { color: #555; font-size: 13px; max-width: 900px; }
.audit { max-height: 520px; overflow: auto; display: inline-block; border: 1px solid #e2e2e7; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _badges(s: dict[str, Any]) -> str:
    exact = s.get("bit_exact")
    rec, inj = s.get("failures_recovered", 0), s.get("failures_injected", 0)
    items = [
        (f"state: {s.get('state')}", "ok" if s.get("state") == "done" else "bad"),
        (f"bit-exact: {exact}", "ok" if exact else ("bad" if exact is False else "")),
        (f"failures recovered: {rec}/{inj}", "ok" if rec == inj else "bad"),
        (f"ETTR: {s['ettr']:.3f}" if "ettr" in s else "no reference run", ""),
        (f"fail-slow found: {len(s.get('fail_slow', []))}", ""),
    ]
    return (
        '<p class="badges">'
        + "".join(
            f'<span class="{c}" id="badge-{i}">{_e(t)}</span>' for i, (t, c) in enumerate(items)
        )
        + "</p>"
    )


def _config_line(cfg: dict[str, Any]) -> str:
    if not cfg:
        return ""
    m, p, d = cfg.get("model", {}), cfg.get("parallel", {}), cfg.get("data", {})
    r, t = cfg.get("recovery", {}), cfg.get("train", {})
    parts = [
        f"model {m.get('preset')}" + (f" (vocab {m['vocab_size']})" if m.get("vocab_size") else ""),
        f"tokenizer {d.get('tokenizer', 'bytes')}",
        f"{p.get('world_size')} ranks (dp {p.get('dp')}, tp {p.get('tp')}, pp {p.get('pp')})",
        f"{t.get('iterations')} iterations",
        f"recovery {r.get('mode')}, shadows L{r.get('shadow_level')}",
    ]
    return f'<p class="sub">{_e(" · ".join(parts))}</p>'


def _comparison(s: dict[str, Any]) -> str:
    """The rows of `unbroken.metrics.summary.format_table`, as a table."""
    ref, flt = s.get("reference", {}), s.get("faulty", {})

    def ms(run: dict[str, Any]) -> str:
        return _num(run["mean_iter_s"] * 1e3, ".1f") if "mean_iter_s" in run else "-"

    rows = [
        ("iterations", ref.get("iterations", "-"), flt.get("iterations", "-")),
        ("iteration attempts", ref.get("attempts", "-"), flt.get("attempts", "-")),
        ("wall time (s)", _num(ref.get("wall_s"), ".2f"), _num(flt.get("wall_s"), ".2f")),
        ("median iteration (ms)", ms(ref), ms(flt)),
        (
            "median tokens/s",
            _num(ref.get("tokens_per_s"), ".0f"),
            _num(flt.get("tokens_per_s"), ".0f"),
        ),
        ("final loss", _num(ref.get("final_loss"), ".4f"), _num(flt.get("final_loss"), ".4f")),
        (
            "final state hash",
            f'<span class="hash">{_e(s.get("reference_state_hash") or "-")}</span>',
            f'<span class="hash">{_e(s.get("final_state_hash") or "-")}</span>',
        ),
    ]
    body = "".join(
        f"<tr><td>{_e(k)}</td><td>{a if k == 'final state hash' else _e(a)}</td>"
        f"<td>{b if k == 'final state hash' else _e(b)}</td></tr>"
        for k, a, b in rows
    )
    lines = [
        f"checkpoint interval {s.get('ckpt_interval')} it, cost {s.get('ckpt_cost_s', 0):.3f} s, "
        f"{s.get('checkpoints_saved', 0)} saved"
    ]
    lines += [
        f"scheduled fault never fired: {f} (past the run's end?)"
        for f in s.get("faults_not_fired", [])
    ]
    for fs in s.get("fail_slow", []):
        where = f"rank {fs['rank']}" if fs.get("rank") is not None else "the sync stage"
        what = "communication" if fs.get("what") == "comm" else "compute"
        lines.append(
            f"fail-slow detected: {where} ({what}) {fs['factor']:.2f}x slower since iteration "
            f"{fs['since_iter']}, reported after iteration {fs['detected_at']}"
        )
    notes = "".join(f"<li>{_e(x)}</li>" for x in lines)
    return (
        '<table id="comparison"><thead><tr><th></th><th>reference</th><th>with failures</th>'
        f'</tr></thead><tbody>{body}</tbody></table><ul class="note">{notes}</ul>'
    )


def _recoveries_table(s: dict[str, Any], bars) -> str:
    if not s.get("recoveries"):
        return '<p class="note">No recoveries in this run.</p>'
    head = "".join(f"<th>{_e(x)} s</th>" for x in SEGMENTS)
    rows = []
    for i, (r, b) in enumerate(zip(s["recoveries"], bars, strict=True)):
        shadow = f"L{r['shadow_level']}" if r.get("shadow_level") else "-"
        again = r.get("protected_again_s")
        cells = "".join(f"<td>{b.seconds[x]:.3f}</td>" for x in SEGMENTS)
        rows.append(
            f'<tr id="recovery-{i}"><td>{_e(b.label)}</td><td>{_e(r.get("mode"))}</td>'
            f"<td>{_e(shadow)}</td>{cells}<td><b>{r.get('total_s', 0):.3f}</b></td>"
            f"<td>{_num(again, '.2f')}</td></tr>"
        )
    return (
        '<table id="recoveries"><thead><tr><th>failure</th><th>mode</th><th>shadow</th>'
        f"{head}<th>total s</th><th>shadows again s</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _audit(run: RunData) -> str:
    """Every iteration's state hash in both runs; a redone iteration lists each attempt."""
    names = run.names
    by_run: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for name in names:
        for m in run.metrics.get(name, []):
            by_run.setdefault(name, {}).setdefault(m["iter"], []).append(m)
    iters = sorted({i for rows in by_run.values() for i in rows})
    mismatched = set(run.summary.get("per_iteration_mismatches", []))
    rows = []
    compared = 0
    for i in iters:
        cells, hashes = [], []
        for name in names:
            attempts = by_run.get(name, {}).get(i, [])
            if not attempts:
                cells.append('<td class="note">no row (update finished by in-place repair)</td>')
                continue
            hs = [a.get("state_hash") for a in attempts]
            hashes.append({h for h in hs if h})
            cells.append(
                '<td class="hash">'
                + "<br>".join(
                    f"{_e(h or '-')} <small>g{a.get('generation', 0)}</small>"
                    for h, a in zip(hs, attempts, strict=True)
                )
                + "</td>"
            )
        comparable = len(hashes) == len(names) == 2 and all(hashes)
        same = comparable and len(hashes[0] | hashes[1]) == 1
        compared += comparable
        mark = "✓" if same else ("✗" if comparable or i in mismatched else "")
        redone = any(len(by_run.get(n, {}).get(i, [])) > 1 for n in names)
        cls = (
            "mismatch"
            if (comparable and not same) or i in mismatched
            else ("redone" if redone else "")
        )
        rows.append(
            f'<tr class="{cls}" id="audit-{i}"><td>{i}</td>{"".join(cells)}<td>{mark}</td></tr>'
        )
    head = "".join(f"<th>{_e(n)}</th>" for n in names)
    verdict = f"{compared} iterations compared, {len(mismatched)} mismatched" + (
        f": {sorted(mismatched)}" if mismatched else ""
    )
    return (
        f'<p class="note" id="audit-verdict">{_e(verdict)}. Hash: sha256 of the whole state '
        "(parameters and optimizer moments) after the iteration, first 16 hex digits; g = the "
        "trainer generation that ran the attempt; highlighted rows were run more than once.</p>"
        f'<div class="audit"><table id="audit"><thead><tr><th>iteration</th>{head}'
        f"<th>same</th></tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _detector(run: RunData, marks) -> str:
    series = run.detector
    events = [e for e in run.events.get(run.main, []) if e["kind"] in ("fail_slow", "change_point")]
    rows = "".join(
        f"<tr><td>{_e(e['kind'])}</td><td>{_e(e.get('verdict', ''))}</td>"
        f"<td>{_e(e.get('change_iteration', e.get('since_iter', '')))}</td>"
        f"<td>{_e(e.get('iteration', e.get('detected_at', '')))}</td>"
        f"<td>{_num(e.get('observed_over_predicted'), '.2f')}</td>"
        f"<td>{_e(e.get('rank', ''))}</td><td>{_num(e.get('factor'), '.2f')}</td></tr>"
        for e in events
    )
    table = (
        '<table id="detections"><thead><tr><th>event</th><th>verdict</th><th>from iteration</th>'
        "<th>at iteration</th><th>observed / predicted</th><th>rank</th><th>factor</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>"
        if events
        else '<p class="note">The detector logged no change point.</p>'
    )
    if series is None or not series.iterations:
        note = series.note if series else "no detector replay"
        return f'<p class="note">{_e(note)}</p>{table}'
    return (
        f'<div class="card">{charts.detector_svg(series, marks)}</div>'
        f'<p class="note">{_e(series.note)}</p>{table}'
    )


def render_report(run: RunData) -> str:
    """The report page of a run, as HTML text."""
    s = run.summary
    main_events = run.events.get(run.main, [])
    marks = markers(run.metrics.get(run.main, []), main_events)
    bars = recovery_bars(s, main_events)
    runs = {n: run.metrics[n] for n in run.names}
    loss_iter = charts.loss_by_iteration_svg(runs, marks)
    timeline = charts.timeline_svg(runs, marks)
    recovery = f'<div class="card">{charts.recovery_bars_svg(bars)}</div>' if bars else ""
    exact_note = (
        "Bit-exact: the run with failures lies exactly on the reference (one curve)."
        if s.get("bit_exact")
        else "The two runs' losses are drawn on one axis; where they differ, both show."
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>unbroken report: {_e(run.run_dir.name)}</title>
<style>{_CSS}</style></head>
<body><main>
<h1>unbroken run report</h1>
<p class="sub">{_e(run.run_dir)}</p>
{_badges(s)}
{_config_line(run.config)}
<h2>Comparison</h2>
{_comparison(s)}
<h2>Loss and throughput</h2>
<div class="grid">
<div class="card" id="card-loss-iter"><h3>Loss per iteration</h3>{loss_iter}
<p class="note">{_e(exact_note)}</p></div>
<div class="card" id="card-timeline"><h3>Wall-clock timeline</h3>{timeline}
<p class="note">Dashed red: an injected failure (shaded until its recovery completed, dotted
green); pink: an injected slow-down; purple: a fail-slow detection; cyan: a re-plan.</p></div>
</div>
<h2>Recovery breakdown</h2>
<p class="note">Per failure, from the failure until the iteration it interrupted was complete
again: detect (failure → detected), init (restart or shadow promotion, attach, rendezvous:
the rest of the time before training resumed), localize and reconstruct (the slowest rank's
repair of lost pages and the interrupted update, from its inplace_repair event), recompute
(iterations redone). Totals are the summary's.</p>
{recovery}
{_recoveries_table(s, bars)}
<h2>Fail-slow detector: predicted vs measured iteration time</h2>
{_detector(run, marks)}
<h2>Audit: state hashes per iteration</h2>
{_audit(run)}
<p class="note">Written by <code>unbroken report</code> from summary.json, events.jsonl,
metrics.jsonl and timings.jsonl in this run directory.</p>
</main></body></html>
"""


def write_report(run: RunData, path: str | Path | None = None) -> Path:
    """Write the report of `run` (default: `report.html` in its run directory)."""
    out = Path(path) if path is not None else run.run_dir / "report.html"
    out.write_text(render_report(run), encoding="utf-8")
    return out
