"""The live view of a run without processes: `RunStatus` and `RunMetrics` fed the rows and events
a run writes (as the coordinator's monitor hands them on), served by a real `LiveServer` and
scraped over HTTP; two runs of one process keep separate registries."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from unbroken.metrics.analysis import RecoveryBreakdown
from unbroken.metrics.live import LiveServer
from unbroken.metrics.observer import RunInfo
from unbroken.metrics.status import RunStatus, describe_event, ettr_so_far

T0 = 1_000.0


def _info(run: str = "faulty") -> RunInfo:
    return RunInfo(
        run=run,
        world_size=2,
        iterations=6,
        recovery_mode="inplace",
        shadow_level=3,
        plan="data parallel: 2 replicas",
    )


def _row(it: int, t: float, gen: int = 0, loss: float = 4.0) -> dict:
    return {
        "iter": it,
        "generation": gen,
        "t_start": t,
        "t_end": t + 0.5,
        "iter_s": 0.5,
        "loss": loss - 0.1 * it,
        "tokens": 256,
        "tokens_per_s": 512.0,
        "ckpt_s": 0.0,
    }


def _state(old: str, new: str, gen: int, restarts: int, t: float) -> dict:
    return {"kind": "state", "t": t, "old": old, "new": new, "reason": "", "generation": gen,
            "restarts": restarts}  # fmt: skip


def _feed(live, failure: bool = True) -> None:
    """A run: 2 ranks, shadows ready, a kill of rank 1 in iteration 2, in-place recovery."""
    live.started(_info(live.run if hasattr(live, "run") else "faulty"))
    live.event(_state("starting", "running", 0, 0, T0))
    live.event({"kind": "shadows_spawned", "t": T0, "level": 3, "generation": 1})
    for rank in (0, 1):
        live.event({"kind": "shadow_ready", "t": T0 + 1, "rank": rank, "level": 3,
                    "generation": 1})  # fmt: skip
    for it in (0, 1):
        for rank in (0, 1):
            live.timing({"rank": rank, "iter": it, "generation": 0})
        live.iteration(_row(it, T0 + it * 0.5))
    if not failure:
        return
    live.event({"kind": "failure_injected", "t": T0 + 1.1, "rank": 1, "iter": 2,
                "phase": "update", "fault": "kill"})  # fmt: skip
    live.event({"kind": "failure_detected", "t": T0 + 1.2, "rank": 1, "iter": 2,
                "phase": "update", "reason": "exited with status -9", "cause": "exit",
                "injected": "kill:rank=1,iter=2,phase=update", "detect_s": 0.1})  # fmt: skip
    live.event(_state("running", "stopping", 0, 0, T0 + 1.2))
    live.event(_state("stopping", "restarting", 1, 1, T0 + 1.3))
    live.event({"kind": "shadows_promoted", "t": T0 + 1.3, "generation": 1, "level": 3,
                "ready": 2})  # fmt: skip
    live.event({"kind": "shadows_spawned", "t": T0 + 1.3, "level": 3, "generation": 2})
    live.event(_state("restarting", "running", 1, 1, T0 + 1.4))
    for rank in (0, 1):
        live.timing({"rank": rank, "iter": 3, "generation": 1})
    live.iteration(_row(3, T0 + 1.5, gen=1))
    live.recovered(
        RecoveryBreakdown(kind="hof", mode="inplace", rank=1, iteration=2, phase="update",
                          detect_s=0.1, init_s=0.4, recompute_s=0.0, total_s=0.4,
                          restored_iter=3, fault="kill", cause="exit")
    )  # fmt: skip
    live.event({"kind": "fail_slow", "t": T0 + 2, "rank": 0, "what": "compute", "factor": 3.0,
                "since_iter": 3, "detected_at": 3})  # fmt: skip
    live.event({"kind": "replan", "t": T0 + 2.1, "trigger": {"kind": "fail_slow", "rank": 0}})


def test_status_follows_the_state_machine_ranks_and_shadows():
    status = RunStatus()
    status.started(_info())
    _feed(status)
    s = status.snapshot()
    assert s["state"] == "running" and s["generation"] == 1 and s["restarts"] == 1
    assert [r["state"] for r in s["ranks"]] == ["up", "up"]
    assert [r["iteration"] for r in s["ranks"]] == [3, 3]
    # generation 1's shadows were promoted; generation 2's are spawned, not ready yet
    assert [(r["shadow_generation"], r["shadow_ready"]) for r in s["ranks"]] == [(2, False)] * 2
    assert s["shadows_ready"] == 0
    assert s["completed"] == 4 and s["attempts"] == 3
    assert s["ranks"][0]["slow_factor"] == 3.0
    assert [f["rank"] for f in s["failures"]] == [1]
    assert s["recoveries"][0]["mode"] == "inplace"
    texts = [e["text"] for e in s["events"]]
    assert any(t.startswith("failure detected: rank 1 exited with status -9") for t in texts)
    assert json.loads(json.dumps(s, allow_nan=False))  # JSON as served


def test_a_failed_rank_and_its_peers_during_recovery():
    status = RunStatus()
    status.started(_info())
    status.event(_state("starting", "running", 0, 0, T0))
    for rank in (0, 1):
        status.timing({"rank": rank, "iter": 0, "generation": 0})
    status.event({"kind": "failure_detected", "t": T0 + 1, "rank": 0, "iter": 1})
    status.event(_state("running", "stopping", 0, 0, T0 + 1))
    assert [r["state"] for r in status.snapshot()["ranks"]] == ["failed", "stopping"]
    status.event(_state("stopping", "restarting", 1, 1, T0 + 2))
    assert [r["state"] for r in status.snapshot()["ranks"]] == ["failed", "restarting"]
    status.finished("failed", "crash loop")
    assert [r["state"] for r in status.snapshot()["ranks"]] == ["stopped", "stopped"]


def test_ettr_so_far_against_the_reference_and_estimated():
    ref = [_row(i, T0 + i * 0.5) for i in range(4)]
    # the same iterations, with a 1 s stall before iteration 2
    run = [_row(i, T0 + i * 0.5 + (1.0 if i >= 2 else 0.0)) for i in range(4)]
    value, basis = ettr_so_far(run, ref)
    assert basis == "reference" and value == pytest.approx(2.0 / 3.0)
    value, basis = ettr_so_far(run, None)
    assert basis == "estimate" and value == pytest.approx(4 * 0.5 / 3.0)
    assert ettr_so_far([], None) == (None, "none")


def test_re_plans_are_listed_among_the_events():
    replan = {"kind": "replan", "t": T0, "trigger": {"kind": "fail_slow", "rank": 3},
              "counts_before": [4, 4, 4, 4], "counts_after": [5, 5, 4, 2],
              "devices_after": [0, 1, 2, 3]}  # fmt: skip
    assert describe_event(replan) == (
        "re-plan (fail_slow): micro-batches per rank [4, 4, 4, 4] → [5, 5, 4, 2] "
        "on devices [0, 1, 2, 3]"
    )
    applied = {"kind": "plan_applied", "t": T0, "epoch": 1, "iter": 20, "counts": [5, 5, 4, 2]}
    assert describe_event(applied) == "plan 1 applied from iteration 20: [5, 5, 4, 2]"


def test_an_unknown_event_is_not_listed_and_a_malformed_one_does_not_raise():
    assert describe_event({"kind": "checkpoint_saved", "iter": 3}) is None
    assert describe_event({"kind": "recovery_done"}) == "recovery_done"


def _scrape(url: str) -> dict:
    text = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_server_exposes_each_run_in_its_own_registry():
    server = LiveServer("127.0.0.1", 0)
    try:
        ref = server.observe("reference")
        _feed(ref, failure=False)
        ref.finished("done", "every rank finished")
        faulty = server.observe("faulty")
        _feed(faulty)
        m = _scrape(server.url)
        run = ("run", "faulty")
        assert m[("unbroken_iterations_total", (run,))] == 3
        assert m[("unbroken_iteration", (run,))] == 4
        assert m[("unbroken_tokens_total", (run,))] == 3 * 256
        labels = tuple(
            sorted([run, ("mode", "inplace"), ("fault_class", "hof"), ("fault", "kill")])
        )
        assert m[("unbroken_recoveries_total", labels)] == 1
        hist = tuple(sorted([run, ("mode", "inplace"), ("fault_class", "hof")]))
        assert m[("unbroken_recovery_seconds_count", hist)] == 1
        assert m[("unbroken_recovery_seconds_bucket", tuple(sorted((*hist, ("le", "0.5")))))] == 1
        assert m[("unbroken_recovery_seconds_bucket", tuple(sorted((*hist, ("le", "0.25")))))] == 0
        failed = tuple(sorted([run, ("cause", "exit"), ("fault", "kill")]))
        assert m[("unbroken_failures_detected_total", failed)] == 1
        assert (
            m[("unbroken_fail_slow_reports_total", tuple(sorted([run, ("what", "compute")])))] == 1
        )
        assert m[("unbroken_replans_total", (run,))] == 1  # the faulty run's one re-plan
        assert m[("unbroken_job_state", tuple(sorted([run, ("state", "running")])))] == 1
        assert m[("unbroken_job_state", tuple(sorted([run, ("state", "done")])))] == 0
        assert m[("unbroken_rank_up", tuple(sorted([run, ("rank", "1")])))] == 1
        assert m[("unbroken_shadows_ready", (run,))] == 0
        # the faulty run's ETTR is measured against the reference's rows
        assert ("unbroken_ettr", tuple(sorted([run, ("basis", "reference")]))) in m
        # no series of the reference run in the faulty run's registry, nothing in the default
        assert not [k for k in m if ("run", "reference") in k[1]]
        assert REGISTRY.get_sample_value("unbroken_iterations_total", {"run": "faulty"}) is None
        # the earlier run is still readable; the page and its JSON are served
        status = json.loads(
            urllib.request.urlopen(server.url + "status.json?run=reference", timeout=10).read()
        )
        assert status["run"] == "reference" and status["state"] == "done"
        assert [r["run"] for r in status["runs"]] == ["reference", "faulty"]
        page = urllib.request.urlopen(server.url, timeout=10).read().decode()
        assert '<canvas id="chart"' in page and "http" not in page.split("<script>")[1]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(server.url + "nothing", timeout=10)
    finally:
        server.close()


def test_a_port_in_use_is_a_user_error(tmp_path):
    from unbroken.api import _live_server
    from unbroken.config import JobConfig, MetricsConfig
    from unbroken.errors import UserError

    server = LiveServer("127.0.0.1", 0)
    try:
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        cfg = JobConfig(metrics=MetricsConfig(port=port))
        with pytest.raises(UserError, match=f"metrics.port {port}: cannot listen"):
            _live_server(cfg, tmp_path, quiet=True)
    finally:
        server.close()


def test_the_grafana_dashboard_queries_only_metrics_the_exporter_has():
    import re
    from pathlib import Path

    from unbroken.metrics.live import LiveRun

    live = LiveRun("faulty")
    _feed(live)
    exposed = {
        s.name
        for family in text_string_to_metric_families(live.metrics.exposition().decode())
        for s in family.samples
    }
    dashboard = Path(__file__).parents[2] / "examples" / "grafana" / "unbroken-dashboard.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bunbroken_\w+", e)}
    assert used and used <= exposed, used - exposed


@pytest.mark.parametrize(
    ("args", "toml"),
    [(["--metrics-port", "70000"], ""), ([], "[metrics]\nport = -1\n")],
)
def test_a_bad_metrics_port_is_one_line_exit_2(tmp_path, args, toml):
    import subprocess
    import sys

    cfg = tmp_path / "job.toml"
    cfg.write_text(toml)
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "train", "--config", str(cfg), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert (
        lines[0].startswith("unbroken: error:") and "metrics.port must be in 0..65535" in lines[0]
    )
