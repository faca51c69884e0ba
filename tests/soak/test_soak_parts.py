"""The soak's pure parts (`unbroken bench soak`): the seeded failure schedule, the least-squares
leak slope and its per-recovery grouping, the classification of a job's processes, the steady
iterations and the first/last-tenth comparison. No job runs here."""

from __future__ import annotations

import itertools
import json
import os
import random
import threading
import time

import pytest

from unbroken.bench.soak_checks import (
    BOUNDS,
    coordinator_checks,
    cpu_ends,
    disturbed,
    ends_ratio,
    fit_slope,
    group_medians,
    leak_checks,
    recompute_s,
    recovery_ratio,
    smaller_world,
    steady_iterations,
    with_recoveries,
)
from unbroken.bench.soak_schedule import KINDS, NODE_BACK_S, draw_schedule
from unbroken.bench.soak_watch import (
    CLASSES,
    _cpu_rates,
    _EventTail,
    classify,
    sample_processes,
)
from unbroken.inject import parse_fault


def _schedule(seed: int, seconds: float = 600.0):
    return draw_schedule(seed, seconds, 0.5, 4, 4)


def test_the_schedule_is_seeded_and_the_seed_matters():
    assert _schedule(7) == _schedule(7)
    assert _schedule(7)[0] != _schedule(8)[0]


@pytest.mark.parametrize("seed", range(8))
def test_the_schedule_covers_every_kind_with_valid_specs(seed):
    # 5 minutes hold at least 9 failures: every kind once, and the kill that ends a slow one
    faults, iterations = _schedule(seed, 300.0)
    assert {f.kind for f in faults} == set(KINDS) - {"lose", "nodeloss"}  # one node: no re-plan
    for f in faults:
        spec = parse_fault(f.spec)  # every spec is one the runtime parses
        assert spec.rank == f.rank < 4 and spec.iteration == f.iteration
    its = [f.iteration for f in faults]
    assert its == sorted(its) and len(set(its)) == len(its) and its[-1] < iterations
    assert faults[0].kind != "ckptcorrupt"  # needs a checkpoint on disk


@pytest.mark.parametrize("seed", range(5))
def test_a_slow_fault_is_ended_by_killing_its_rank_next(seed):
    faults, _ = _schedule(seed, 900.0)
    for slow, after in itertools.pairwise(faults):
        if slow.kind == "slow":
            assert after.kind == "kill" and after.rank == slow.rank
    assert faults[-1].kind != "slow"


@pytest.mark.parametrize("seed", range(12))
def test_two_nodes_lose_devices_and_nodes_of_the_last_node_and_replace_it(seed):
    faults, iterations = draw_schedule(seed, 900.0, 0.5, 4, 4, nodes=2)
    assert {f.kind for f in faults} == set(KINDS)
    # A fault's rank= names a device (the rank at launch): one for a lost device never fires.
    lost: set[int] = set()
    for f in faults:
        spec = parse_fault(f.spec)
        assert spec.kind.value == ("pageloss" if f.kind.startswith("pageloss") else f.kind)
        assert spec.rank == f.rank < 4 and f.rank not in lost, (f, lost)
        lost = lost | {f.rank} if f.kind == "lose" else set() if f.kind == "nodeloss" else lost
    for prev, after in itertools.pairwise(faults):
        if prev.kind == "lose":
            # The node that lost a device is replaced as a whole next, through a device of it
            # that is still there (the 15-minute run: nodeloss on the lost device never fired).
            assert prev.rank in (2, 3) and after.kind == "nodeloss"
            assert after.rank in (2, 3) and after.rank != prev.rank
        elif after.kind in ("lose", "nodeloss"):
            assert after.rank in (2, 3), after
    for loss in (f for f in faults if f.kind == "nodeloss"):
        # Until the node is back, failures hit node 0's ranks (in every world) only.
        soon = [f for f in faults if loss.t_s < f.t_s < loss.t_s + NODE_BACK_S]
        assert all(f.rank in (0, 1) and f.kind not in ("lose", "nodeloss") for f in soon)
    assert faults[-1].kind not in ("slow", "lose")
    if faults[-1].kind == "nodeloss":  # room for the node's return and the grown world
        assert iterations - faults[-1].iteration >= NODE_BACK_S / 0.5


def test_ranks_that_the_nodes_do_not_split_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        draw_schedule(0, 60.0, 0.5, 3, 4, nodes=2)


def test_the_schedule_spaces_failures_10_to_30_seconds_of_wall_time():
    faults, iterations = _schedule(3, 3600.0)
    gaps = [b.t_s - a.t_s for a, b in itertools.pairwise(faults)]
    assert all(10.0 <= g <= 30.0 for g in gaps)
    assert 3600 / 30 - 1 <= len(faults) <= 3600 / 10
    # iterations: the planned time at 0.5 s per iteration, less the estimated recovery costs
    assert 0.6 * 3600 / 0.5 < iterations <= 3600 / 0.5


def test_page_losses_are_within_and_beyond_the_tolerance():
    faults, _ = _schedule(1, 1800.0)
    within = [parse_fault(f.spec) for f in faults if f.kind == "pageloss"]
    beyond = [parse_fault(f.spec) for f in faults if f.kind == "pageloss_beyond"]
    assert within and all(s.pages < 4 and s.parity == 1 for s in within)
    assert beyond and all(s.pages > 4 for s in beyond)


def test_fit_slope_is_least_squares():
    rng = random.Random(0)
    points = [(x, 3.0 + 0.25 * x + rng.uniform(-0.01, 0.01)) for x in range(50)]
    assert fit_slope(points) == pytest.approx(0.25, abs=1e-3)
    assert fit_slope([(1, 5.0), (1, 7.0)]) is None
    assert fit_slope([(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]) == pytest.approx(0.2)


def _sample(
    recoveries: int,
    fds: int,
    in_recovery: bool = False,
    rss_kib: int = 100 << 10,
    threads: int = 40,
):
    classes = {
        c: {"procs": 0, "fds": 0, "memfds": 0, "threads": 0, "rss_kib": 0, "shmem_kib": 0}
        for c in CLASSES
    }
    classes["trainer"] = {
        "procs": 4,
        "fds": fds,
        "memfds": 8,
        "threads": threads,
        "rss_kib": rss_kib,
        "shmem_kib": 0,
    }
    return {"recoveries": recoveries, "in_recovery": in_recovery, "classes": classes}


def test_leak_checks_find_one_fd_per_recovery_and_ignore_recovery_transients():
    steady = [_sample(k, 40) for k in range(10) for _ in range(3)]
    spikes = [_sample(k, 400, in_recovery=True) for k in range(10)]  # mid-recovery: left out
    checks = {c.name: c for c in leak_checks(steady + spikes, {"trainer": ["trainer"]})}
    assert all(c.passed for c in checks.values())
    leaking = [_sample(k, 40 + k) for k in range(10) for _ in range(3)]
    checks = {c.name: c for c in leak_checks(leaking, {"trainer": ["trainer"]})}
    assert checks["leak trainer.fds/recovery"].passed is False
    assert checks["leak trainer.fds/recovery"].value == pytest.approx(1.0)
    assert checks["leak trainer.memfds/recovery"].passed is True
    assert set(BOUNDS) == {c.split(".")[1].split("/")[0] for c in checks}
    threads = [_sample(k, 40, threads=20 + 2 * k) for k in range(10) for _ in range(3)]
    checks = {c.name: c for c in leak_checks(threads, {"trainer": ["trainer"]})}
    assert checks["leak trainer.threads/recovery"].passed is False
    assert checks["leak trainer.fds/recovery"].passed is True


def test_leak_checks_sum_a_group_so_a_promoted_shadow_is_not_a_leak():
    rows = []
    for k in range(8):  # each recovery turns a trainer into a promoted shadow (forked)
        row = _sample(k, 40)
        moved = min(k, 4)
        row["classes"]["trainer"]["procs"] = 4 - moved
        row["classes"]["shadow"] = {
            "procs": 5 + moved,
            "fds": 0,
            "memfds": 0,
            "rss_kib": 0,
            "shmem_kib": 0,
        }
        rows.append(row)
    by_class = {c.name: c for c in leak_checks(rows, {"shadow": ["shadow"]})}
    assert by_class["leak shadow.procs/recovery"].passed is False
    grouped = {c.name: c for c in leak_checks(rows, {"both": ["trainer", "shadow"]})}
    assert grouped["leak both.procs/recovery"].passed is True


def _composed(recoveries: int, fresh: int, rss_mib: int, in_recovery: bool = False):
    """A sample with `fresh` trainers started fresh (a returned node's) among 4 ranks."""
    row = _sample(recoveries, 40, in_recovery=in_recovery, rss_kib=rss_mib << 10)
    row["classes"]["trainer"]["procs"] = fresh
    return row


def test_memory_is_compared_like_with_like_across_fresh_and_promoted_ranks():
    # A node returned at recoveries 6 and 9: two fresh trainers hold 100 MiB more than the
    # promoted shadows they stand for, until the next recovery; one sample of group 6 was
    # taken as a fault struck (nothing running yet on the new set, 300 MiB less).
    rows = []
    for k in range(1, 12):
        fresh = 2 if k in (6, 9) else 0
        rows += [_composed(k, fresh, 3300 + 100 * (fresh > 0)) for _ in range(8)]
    rows.append(_composed(6, 0, 3000))
    (rss,) = [c for c in leak_checks(rows, {"t": ["trainer"]}) if "rss" in c.name]
    assert rss.passed is True and rss.value == pytest.approx(0.0)
    assert [k for k, _ in group_medians(rows, ["trainer"], "rss_mib")] == [
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        10,
        11,
    ]
    # The process count is fitted over every steady sample: a leak would change the mix.
    assert len(group_medians(rows, ["trainer"], "procs")) == 11
    # A real leak among like samples still fails.
    leaking = [_composed(k, 0, 3300 + 5 * k) for k in range(1, 12) for _ in range(3)]
    (rss,) = [c for c in leak_checks(leaking, {"t": ["trainer"]}) if "rss" in c.name]
    assert rss.passed is False and rss.value == pytest.approx(5.0)


def test_the_start_up_before_the_first_recovery_is_not_a_leak():
    # measured: the shadows' start-up took the fds of the job from ~25 to 41 (agent) and
    # 85 to 230 (shadows) before the first recovery, then stayed flat
    rows = [_sample(0, 85)] * 5 + [_sample(k, 230) for k in range(1, 10) for _ in range(3)]
    (fds,) = [c for c in leak_checks(rows, {"t": ["trainer"]}) if c.name.endswith(".fds/recovery")]
    assert fds.passed is True and fds.value == 0.0


def test_leak_checks_need_enough_recoveries_and_take_group_medians():
    few = leak_checks([_sample(k, 40) for k in range(4)], {"trainer": ["trainer"]})
    assert all(c.passed is None for c in few)  # undecided is not a pass
    rows = [_sample(0, 10), _sample(0, 12), _sample(0, 500), _sample(1, 11)]
    assert group_medians(rows, ["trainer"], "fds") == [(0, 12.0), (1, 11.0)]
    rows = [_sample(0, 1, rss_kib=2048)]
    assert group_medians(rows, ["trainer"], "rss_mib") == [(0, 2.0)]


@pytest.mark.parametrize(
    ("cmdline", "state", "cls"),
    [
        ("/v/bin/python -m unbroken.launch.agent --coordinator 127.0.0.1:5 --node 0", "S", "agent"),
        ("/v/bin/python -m unbroken.state.manager --socket /tmp/x.sock", "S", "state_manager"),
        ("/v/bin/python -m unbroken.launch.trainer", "R", "trainer"),
        ("/v/bin/python -c from unbroken.shadow.forkserver import serve; serve()", "S", "shadow"),
        ("/v/bin/python -m unbroken.launch.trainer", "Z", "zombie"),
        ("/usr/bin/sleep 5", "S", "other"),
    ],
)
def test_processes_are_classified_by_cmdline(cmdline, state, cls):
    assert classify(cmdline, state) == cls


def test_sampling_reads_this_process_as_the_coordinator():
    totals = sample_processes(os.getpid())
    me = totals["coordinator"]
    assert me["procs"] == 1 and me["fds"] >= 3 and me["rss_kib"] > 0
    fd = os.memfd_create("soak-test")
    try:
        assert sample_processes(os.getpid())["coordinator"]["memfds"] == me["memfds"] + 1
    finally:
        os.close(fd)
    assert me["threads"] >= 1
    halt = threading.Event()
    extra = threading.Thread(target=halt.wait)
    extra.start()
    try:
        assert sample_processes(os.getpid())["coordinator"]["threads"] >= me["threads"] + 1
    finally:
        halt.set()
        extra.join()


def test_the_sampler_reports_each_class_s_cpu_in_cores_between_samples():
    """CPU this process burns between two samples shows as the coordinator class's (this
    process's) cores over the interval; a process absent from the previous sample counts 0."""
    before: dict[int, tuple[str, float]] = {}
    sample_processes(os.getpid(), before)
    cpu0 = time.process_time()
    while time.process_time() - cpu0 < 0.3:  # burn CPU in this process
        sum(range(1000))
    burnt = time.process_time() - cpu0
    after: dict[int, tuple[str, float]] = {}
    sample_processes(os.getpid(), after)
    used = after[os.getpid()][1] - before[os.getpid()][1]
    assert used == pytest.approx(burnt, abs=0.05)  # clock ticks of /proc/PID/stat
    assert _cpu_rates(before, after, 2.0)["coordinator"] == pytest.approx(used / 2, abs=0.02)
    assert _cpu_rates({}, after, 1.0)["coordinator"] == 0.0


def test_steady_iterations_leave_out_failures_recomputation_and_slow_stretches():
    metrics = [{"iter": i, "iter_s": 1.0, "ckpt_s": 0.0} for i in range(60)]
    metrics[10]["ckpt_s"] = 0.5
    metrics[10]["iter_s"] = 1.5  # checkpoint time is not the iteration's
    metrics.append({"iter": 30, "iter_s": 9.0})  # recomputed after a failure
    failures = [(20, "kill"), (40, "slow"), (45, "kill")]
    steady = dict(steady_iterations(metrics, failures, settle=3))
    assert steady[10] == 1.0 and 0 not in steady and 1 not in steady
    assert not {19, 20, 23, 30, 39, 44, 48} & set(steady)
    assert {18, 24, 49} <= set(steady)
    assert disturbed([(5, "slow")], 9, 1) == set(range(4, 11))


def test_a_smaller_world_and_its_settling_are_not_steady():
    metrics = [
        {"iter": i, "iter_s": 1.0, "rank_hashes": ["h"] * (2 if 20 <= i < 25 else 4)}
        for i in range(60)
    ]
    metrics[30]["rank_hashes"] = None  # an iteration not hashed: nothing known, kept
    assert smaller_world(metrics, 4, 3) == set(range(20, 28))
    steady = {it for it, _ in steady_iterations(metrics, [], 3, world=4)}
    assert steady == set(range(2, 60)) - set(range(20, 28))


def test_samples_of_a_degraded_world_are_not_steady():
    rows = [_sample(0, 40), _sample(1, 40), {**_sample(1, 10), "degraded": True}]
    assert group_medians(rows, ["trainer"], "fds") == [(0, 40.0), (1, 40.0)]


def test_the_event_tail_follows_the_world_through_a_node_loss_and_its_return(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = _EventTail(path, "faulty", world=4)
    seen = []

    def feed(**event):
        with open(path, "a") as f:
            f.write(json.dumps({"run": "faulty", **event}) + "\n")
        tail.poll()
        seen.append(tail.degraded)

    feed(kind="trainer_ready", generation=0)
    feed(kind="replan", devices_after=[0, 1, 2, 3])  # a fail-slow re-plan: same devices
    feed(kind="node_lost", node=1)
    feed(kind="replan", devices_after=[0, 1])
    feed(kind="trainer_ready", generation=1)  # the survivors train: still 2 of 4
    feed(kind="node_returned", node=1)
    feed(kind="replan", devices_after=[0, 1, 2, 3])
    feed(kind="trainer_ready", generation=2)
    feed(kind="replan", devices_after=[0, 1, 3])  # a device lost
    feed(kind="trainer_ready", generation=3)
    assert seen == [False, False, True, True, True, True, True, False, True, True]


def test_ends_ratio_and_recovery_ratio():
    assert ends_ratio([1.0] * 5) is None
    first, last, ratio = ends_ratio([1.0] * 30 + [1.2] * 30 + [2.0] * 40)
    assert (first, last, ratio) == (1.0, 2.0, 2.0)
    recs = [
        {"fault": "hang", "kind": "hof", "mode": "inplace", "total_s": 4.0, "detected_t": 2},
        {"fault": "kill", "kind": "hof", "mode": "inplace", "total_s": 1.0, "detected_t": 1},
        {"fault": "kill", "kind": "hof", "mode": "inplace", "total_s": 3.0, "detected_t": 3},
    ]
    assert recovery_ratio(recs) == [0.5, 1.0, 1.5]
    # With the breakdown: detection + restart, not recomputation (which follows the phase).
    recs = [
        {**r, "detect_s": 0.1, "init_s": i, "recompute_s": 5.0 * (k % 2)}
        for k, (r, i) in enumerate(zip(recs, (0.3, 0.2, 0.2), strict=True))
    ]
    assert recovery_ratio(recs) == [1.0, 1.0, 1.0]
    assert recovery_ratio(recs, recompute_s) == [2.0, 0.0]  # the hang's median is 0: left out


def test_the_command_refuses_a_non_positive_length():
    import argparse

    from unbroken.bench.soak import add_arguments, run
    from unbroken.errors import UserError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match="--minutes"):
        run(parser.parse_args(["--minutes", "0"]))


def _stats_events(keys_per_window, recovery_times):
    events = [{"kind": "recovery_done", "t": t} for t in recovery_times]
    for i, (keys, handle) in enumerate(keys_per_window):
        events.append(
            {
                "kind": "coordinator_stats",
                "t": 10.0 * i + 5,
                "store_keys": keys,
                "handle_ms_p50": handle,
                "final": False,
            }
        )
    events.append({"kind": "coordinator_stats", "t": 1e9, "store_keys": 10**6, "final": True})
    return events


def test_store_keys_that_pile_up_per_recovery_fail_and_flat_ones_pass():
    recoveries = [10.0 * i + 1 for i in range(12)]  # one recovery per 10 s window
    flat = with_recoveries(_stats_events([(40, 0.1)] * 12, recoveries))
    assert [s["recoveries"] for s in flat][:3] == [1, 2, 3]  # the final one is left out
    keys, timing, _ = coordinator_checks(flat)
    assert keys.passed is True and timing.passed is True
    piling = with_recoveries(_stats_events([(40 + 9 * i, 0.1) for i in range(12)], recoveries))
    keys, _, _ = coordinator_checks(piling)
    assert keys.passed is False and keys.value == 9.0


def test_coordinator_handling_time_that_triples_fails():
    recoveries = [10.0 * i + 1 for i in range(20)]
    slowing = [(40, 0.1)] * 10 + [(40, 0.35)] * 10
    _, timing, _ = coordinator_checks(with_recoveries(_stats_events(slowing, recoveries)))
    assert timing.passed is False and timing.value == 3.5


def test_fired_fault_markers_are_not_counted_as_store_growth():
    recoveries = [10.0 * i + 1 for i in range(12)]
    events = with_recoveries(_stats_events([(40 + i, 0.1) for i in range(12)], recoveries))
    assert coordinator_checks(events)[0].passed is False  # one key more per recovery
    for i, e in enumerate(events):
        e["fault_markers"] = i  # ... each the marker of the fault behind that recovery
    keys, _, _ = coordinator_checks(events)
    assert keys.passed is True and keys.value == 0.0


def test_a_coordinator_pass_that_grows_with_the_run_fails_the_stall_check():
    """The 60-minute soak's coordinator stalled 10.8 s in one pass over its logs; the windows
    said so in `poll_ms_max` (2-5 s in the last tenth against ~10 ms at first)."""
    recoveries = [10.0 * i + 1 for i in range(20)]
    events = with_recoveries(_stats_events([(40, 0.1)] * 20, recoveries))
    stats = [e for e in events if e["kind"] == "coordinator_stats" and not e.get("final")]
    for i, e in enumerate(stats):
        e["poll_ms_max"] = 10.0 if i < 10 else 3000.0
    *_, stall = coordinator_checks(events)
    assert stall.passed is False and stall.value == 300.0
    for e in stats:
        e["poll_ms_max"] = 12.0
    *_, stall = coordinator_checks(events)
    assert stall.passed is True


def test_cpu_ends_compare_each_class_s_cores_at_the_start_and_the_end():
    rows = []
    for k in range(40):
        row = _sample(k // 4, 40)
        for c in CLASSES:
            row["classes"][c]["cpu"] = 0.1
        row["classes"]["agent"]["cpu"] = 0.1 + 0.01 * k  # an agent that takes more and more
        rows.append(row)
    rows.append({**_sample(9, 40, in_recovery=True)})  # no cpu: mid-recovery, left out
    ends = cpu_ends(rows)
    assert ends["trainer"] == (0.1, 0.1)
    first, last = ends["agent"]
    assert first == pytest.approx(0.115) and last == pytest.approx(0.475)  # 4 samples each


def _gpu_sample(recoveries: int, used_mib: float, in_recovery: bool = False):
    row = _sample(recoveries, 40, in_recovery=in_recovery)
    row["gpu"] = {"used_mib": used_mib, "classes": {"trainer": used_mib}}
    return row


def test_gpu_memory_that_a_recovery_never_gives_back_fails_and_a_steady_level_passes():
    rng = random.Random(3)
    steady = [_gpu_sample(k, 5000 + rng.uniform(-6, 6)) for k in range(12) for _ in range(3)]
    spawning = [_gpu_sample(k, 9000, in_recovery=True) for k in range(12)]  # a shadow's warm-up
    leaking = [_gpu_sample(k, 5000 + 2 * k) for k in range(12) for _ in range(3)]  # a granule

    def device_check(samples):
        (check,) = [c for c in leak_checks(samples, {"all": CLASSES}) if "gpu" in c.name]
        return check

    assert device_check(steady + spawning).passed is True
    check = device_check(leaking)
    assert check.passed is False and check.value == pytest.approx(2.0)
    cpu_only = [_sample(k, 40) for k in range(12)]
    assert not [c for c in leak_checks(cpu_only, {"all": CLASSES}) if "gpu" in c.name]


def test_the_gpu_probe_attributes_nvml_processes_to_the_job_s_classes(monkeypatch):
    import types

    from unbroken.bench.soak_watch import GpuProbe

    mib = 1 << 20
    procs = [
        types.SimpleNamespace(pid=11, usedGpuMemory=700 * mib),
        types.SimpleNamespace(pid=12, usedGpuMemory=None),  # NVML: not available
        types.SimpleNamespace(pid=99, usedGpuMemory=50 * mib),  # not a process of the job
    ]
    fake = types.SimpleNamespace(
        NVMLError=RuntimeError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=(1000 + h) * mib),
        nvmlDeviceGetComputeRunningProcesses=lambda h: procs if h == 0 else procs[:1],
    )
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    probe = GpuProbe()
    read = probe.read({11: "shadow", 12: "trainer"})
    assert read == {
        "used_mib": 2001.0,
        "classes": {"other": 50.0, "shadow": 1400.0, "trainer": 0.0},
    }


def test_a_gpu_soak_trains_one_rank_per_gpu_in_bf16_and_never_loses_a_device():
    from unbroken.bench.soak import plan_soak

    faults, iterations, cfg = plan_soak(10, 5, 0.05, nodes=1, gpus=1)
    assert (cfg.parallel.world_size, cfg.train.device, cfg.train.precision) == (1, "cuda", "bf16")
    assert {f.rank for f in faults} == {0} and iterations > 10 * 60 / 0.05 * 0.5
    assert not {f.kind for f in faults} & {"lose", "nodeloss"}
    assert {f.kind for f in faults} == set(KINDS) - {"lose", "nodeloss"}


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--device", "cuda", "--nodes", "2"], "one host"), (["--device", "cuda"], "no CUDA device")],
)
def test_a_gpu_soak_needs_a_gpu_and_one_host(argv, match, monkeypatch):
    import argparse

    import torch

    from unbroken.bench.soak import add_arguments, run
    from unbroken.errors import UserError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match=match):
        run(parser.parse_args(["--minutes", "1", *argv]))
