"""`unbroken demo --quick`: the README's main job, end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def _detector_trace(out) -> str:
    """What the fail-slow watch saw, for the failure message."""
    lines = []
    for name in ("events.jsonl", "metrics.jsonl"):
        for row in map(json.loads, (out / name).read_text().splitlines()):
            if row.get("run") != "faulty":
                continue
            if name == "metrics.jsonl":
                lines.append(f"iter {row['iter']} gen {row['generation']} {row['iter_s']:.3f}s")
            elif row["kind"] in ("change_point", "fail_slow", "detector_disabled", "slow_active"):
                lines.append(json.dumps(row))
    return "\n".join(lines)


def test_demo_quick_recovers_in_place_exactly_and_finds_the_slow_rank(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["bit_exact"] is True
    assert s["final_state_hash"] == s["reference_state_hash"]
    assert s["failures_injected"] == s["failures_recovered"] == 3
    assert {rec["mode"] for rec in s["recoveries"]} == {"inplace"}
    assert all(rec["shadow_level"] in (0, 3) for rec in s["recoveries"])
    # ETTR compares against the fault-free run measured just before: with sub-second recoveries
    # a busy machine's drift between the two runs can exceed their difference, so only > 0.
    assert s["ettr"] > 0
    assert [f["rank"] for f in s["fail_slow"]] == [3], _detector_trace(out)
    for name in ("events.jsonl", "metrics.jsonl", "plot.png", "report.html"):
        assert (out / name).stat().st_size > 0
    assert "bit-exact: True" in r.stdout
    assert f"report: {out / 'report.html'}" in r.stdout
