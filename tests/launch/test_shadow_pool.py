"""The agent's shadow pool without processes: shadows wait as pending while the fork server
imports, a relaunch after an allocation failure waits until that rank is past the iteration it
retried, and a reclamation kills every shadow and drops pending ones."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from unbroken.launch.agent.hang import Liveness
from unbroken.launch.agent.procs import RankProc
from unbroken.launch.agent.shadows import RelaunchAfter, ShadowPool
from unbroken.messages import RankBeat, RankStatus, ShadowPlan, StartGeneration


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid, self.killed, self.reaped = pid, False, False

    def poll(self) -> int | None:
        return -9 if self.killed else None

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        self.reaped = True
        return -9


class FakeSupervisor:
    """Records spawns; the fork server is "starting" until `importing` is cleared."""

    def __init__(self) -> None:
        self.importing = False
        self.spawned: list[tuple[int, int, int, int]] = []
        self.procs: list[FakeProc] = []

    def start_forkserver(self) -> None:
        self.importing = True

    def forkserver_starting(self) -> bool:
        return self.importing

    forkserver = None

    def fork_failed(self) -> str | None:
        return None

    def spawn(self, msg, rank, generation, spec, shadow_level=0, attempt=0) -> RankProc:
        self.spawned.append((rank, generation, shadow_level, attempt))
        proc = FakeProc(1000 + len(self.procs))
        self.procs.append(proc)
        return RankProc(rank, generation, proc, Liveness(spawned=0.0))  # type: ignore[arg-type]

    @staticmethod
    def kill(procs) -> None:
        procs = list(procs)
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _plan(start: str = "exec") -> StartGeneration:
    return StartGeneration(
        generation=4,
        spec="gen4.json",
        ranks=[0, 1],
        heartbeat_timeout_s=2.0,
        node_heartbeat_s=0.5,
        shadows=ShadowPlan(level=3, start=start, next_spec="gen5.json"),
    )


def _beat(rank: int, iteration: int) -> RankBeat:
    return RankBeat(
        rank=rank, generation=4, pid=1, t=0.0, status=RankStatus.TRAINING, iteration=iteration
    )


def test_shadows_wait_for_the_fork_server_then_spawn_for_the_next_generation():
    sup = FakeSupervisor()
    pool = ShadowPool(sup)  # type: ignore[arg-type]
    launch = pool.prepare(_plan("fork"), level=3)
    assert launch is not None and (launch.level, launch.generation) == (3, 5)
    assert pool.pending is not None and sup.spawned == []
    pool.spawn_pending()
    assert sup.spawned == []  # still importing
    sup.importing = False
    pool.spawn_pending()
    assert sup.spawned == [(0, 5, 3, 1), (1, 5, 3, 1)] and pool.pending is None
    assert pool.alive_for(5, [0, 1]) and not pool.alive_for(4, [0, 1])
    assert pool.ready_count([0, 1]) == 0


def test_relaunch_after_an_allocation_failure_waits_until_the_rank_is_past_its_iteration():
    sup = FakeSupervisor()
    pool = ShadowPool(sup)  # type: ignore[arg-type]
    pool.prepare(_plan(), level=3)
    first = list(sup.procs)
    pool.reclaim()
    assert all(p.killed and p.reaped for p in first) and pool.shadows == {}
    pool.relaunch_after = RelaunchAfter(rank=0, iteration=7, level=2, generation=5)
    for beat in (_beat(1, 9), _beat(0, 7)):  # another rank, or not yet past 7: nothing
        pool.on_beat(beat, [0, 1])
    assert len(sup.spawned) == 2 and pool.relaunch_after is not None
    pool.on_beat(_beat(0, 8), [1, 0])
    assert pool.relaunch_after is None and pool.level_now == 2
    assert sup.spawned[2:] == [(0, 5, 2, 2), (1, 5, 2, 2)]


def test_a_reclamation_drops_pending_shadows_and_a_new_start_forgets_the_relaunch():
    sup = FakeSupervisor()
    pool = ShadowPool(sup)  # type: ignore[arg-type]
    pool.prepare(_plan("fork"), level=3)
    assert pool.pending is not None
    pool.reclaim()
    sup.importing = False
    pool.spawn_pending()
    assert pool.pending is None and sup.spawned == []
    pool.relaunch_after = RelaunchAfter(rank=0, iteration=7, level=2, generation=5)
    assert pool.prepare(_plan(), level=0) is None  # a start brings its own shadows (none here)
    assert pool.relaunch_after is None and sup.spawned == []


@pytest.mark.ci_required  # CI runs as root: raising a process's priority needs the privilege
def test_a_promoted_shadow_returns_to_the_jobs_priority_not_to_zero():
    if os.geteuid() != 0:
        pytest.skip("raising a process's priority needs root")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, 3)  # a job started under `nice -n 3`
    try:
        pool = ShadowPool(FakeSupervisor())  # type: ignore[arg-type]
        # A shadow: lower priority, with a second thread started at that priority (its
        # heartbeat, gloo's threads), waiting for its promotion on stdin.
        code = (
            "import sys, threading; threading.Thread(target=sys.stdin.readline, daemon=True)"
            ".start(); print(flush=True); sys.stdin.readline()"
        )
        shadow = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=lambda: os.nice(5),
        )
        assert shadow.stdout is not None and shadow.stdout.readline() == b"\n"  # both threads up
        pool.shadows[0] = RankProc(0, 1, shadow, Liveness(spawned=0.0))
        tasks = [int(t) for t in os.listdir(f"/proc/{shadow.pid}/task")]
        assert len(tasks) == 2 and {os.getpriority(os.PRIO_PROCESS, t) for t in tasks} == {8}
        pool.promote(0, "spec.json", now=1.0)
        # Every thread at the job's priority: niceness is per thread on Linux.
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tasks} == {3}
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
        shadow.kill()
        shadow.wait()


def test_shadows_are_found_by_device_and_promoted_under_their_new_rank():
    """A world change (devices lost or back): a shadow prepared for rank 2 on device 2 takes
    rank 1 of the new world on the same device, told to regroup with it."""
    import io

    from unbroken.messages import Promote, decode_json

    sup = FakeSupervisor()
    pool = ShadowPool(sup)  # type: ignore[arg-type]
    plan = StartGeneration(
        generation=4,
        spec="gen4.json",
        ranks=[0, 1, 2],
        heartbeat_timeout_s=2.0,
        node_heartbeat_s=0.5,
        shadows=ShadowPlan(level=3, start="exec", next_spec="gen5.json"),
        devices={"0": 0, "1": 1, "2": 2},
    )
    pool.prepare(plan, level=3)
    # Not parked yet: an L3 shadow may be inside its set's group formation with peers of the
    # old world, which a lost node took with it. None is taken into a changed world.
    assert pool.by_device(5) == {}
    for r, t in pool.shadows.items():
        t.beat = dataclasses.replace(_beat(r, -1), status=RankStatus.SHADOW_READY, level=3)
    assert pool.by_device(5) == {0: 0, 1: 1, 2: 2} and pool.by_device(4) == {}
    sup.procs[1].kill()  # device 1's shadow died with it
    assert pool.by_device(5) == {0: 0, 2: 2}
    pool.shadows[0].beat = _beat(0, -1)  # a beat that says it is not parked (starting)
    assert pool.by_device(5) == {2: 2}
    stdin = io.BytesIO()
    pool.shadows[2].proc.stdin = stdin  # type: ignore[attr-defined]
    t = pool.promote(2, "gen5.json", now=1.0, as_rank=1)
    assert t.rank == 1 and 2 not in pool.shadows
    msg = decode_json(stdin.getvalue().decode().strip(), (Promote,))
    assert msg == Promote(spec="gen5.json", rank=1, regroup=True)


def test_the_coordinators_set_number_is_used_on_every_node_and_a_relaunch_gets_its_own():
    """A node that joined later (its agent counts from 0) must still meet the other nodes'
    shadows: the set number comes from the coordinator; a node-local relaunch stays clear of
    it."""
    sup = FakeSupervisor()
    pool = ShadowPool(sup)  # type: ignore[arg-type]
    plan = dataclasses.replace(
        _plan(), shadows=ShadowPlan(level=3, start="exec", next_spec="gen5.json", attempt=5)
    )
    pool.prepare(plan, level=3)
    assert sup.spawned == [(0, 5, 3, 5), (1, 5, 3, 5)]
    pool.reclaim()
    pool.relaunch(2, 5, [0, 1])
    assert sup.spawned[2:] == [(0, 5, 2, 1_000_001), (1, 5, 2, 1_000_001)]


def test_shadows_are_told_to_warm_up_and_then_map_the_state_once_their_trainer_has_trained():
    """`WarmUp` goes to a shadow whose rank's trainer of the generation before has completed
    an iteration (parked or not: a GPU shadow waits for it before its warm-up); `MapRetained`
    to such a shadow once it is parked (not before the trainer has trained: it may still
    remake its regions). Each once."""
    import io

    from unbroken.messages import MapRetained, WarmUp, decode_json

    sup = FakeSupervisor()
    pool = ShadowPool(sup)  # type: ignore[arg-type]
    pool.prepare(_plan(), level=3)  # shadows of generation 5 beside trainers of generation 4
    stdins = {r: io.BytesIO() for r in pool.shadows}
    for r, t in pool.shadows.items():
        t.proc.stdin = stdins[r]  # type: ignore[attr-defined]
    trainers = {
        r: RankProc(r, 4, FakeProc(2000 + r), Liveness(spawned=0.0))  # type: ignore[arg-type]
        for r in (0, 1)
    }

    def told() -> dict[int, list]:
        return {
            r: [
                decode_json(line, (MapRetained, WarmUp))
                for line in s.getvalue().decode().splitlines()
            ]
            for r, s in stdins.items()
        }

    trainers[0].beat = _beat(0, 0)  # training, nothing completed yet
    trainers[1].beat = dataclasses.replace(_beat(1, 1), completed=0)
    pool.tell(trainers)
    assert told() == {0: [], 1: [WarmUp()]}  # neither parked; rank 0's trainer has not trained
    for r, t in pool.shadows.items():
        t.beat = dataclasses.replace(_beat(r, -1), status=RankStatus.SHADOW_READY, level=3)
    pool.tell(trainers)
    assert told() == {0: [], 1: [WarmUp(), MapRetained()]}
    trainers[0].beat = dataclasses.replace(_beat(0, 1), completed=0)
    pool.tell(trainers)
    pool.tell(trainers)
    assert told() == {0: [WarmUp(), MapRetained()], 1: [WarmUp(), MapRetained()]}  # once each
