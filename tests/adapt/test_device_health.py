"""A lost device, as the agent and the recovery machine see it: the agent's health check tells
a crash on a healthy device (hardware-operable) from a lost one, stops the lost device's state
manager and refuses to start anything there again; the machine recovers a lost device when the
job re-plans and fails with the reason when it does not."""

from __future__ import annotations

import pytest

from tests.launch.test_agent import Node, _gone
from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.inject import DeviceRegistry, FaultKind, parse_fault
from unbroken.messages import RankExited, Shutdown, Started, StartGeneration
from unbroken.recovery import Fail, RecoveryMachine, RecoveryState, Start, Stop


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    if n.thread.is_alive():
        n.coordinator.send(Shutdown())
        n.thread.join(120)


def test_a_lost_device_is_reported_fenced_and_refused(node, tmp_path):
    registry = DeviceRegistry(tmp_path / "devices")
    sockets = {str(d): str(tmp_path / f"sm{d}.sock") for d in (0, 1)}
    spec = node.spec(0, {0: {"go": True, "exit": 3}, 1: {"go": True, "exit": 9}})
    node.start(0, spec, [0, 1], state_managers=sockets, device_registry=str(registry.root))
    managers = node.agent.supervisor.state_managers
    assert set(managers) == {0, 1}
    lost_manager = managers[1]
    coord = node.coordinator
    node.go(0)  # a crash on a healthy device: hardware-operable
    crash = coord.expect(RankExited, rank=0)
    assert (crash.returncode, crash.device_lost) == (3, "")
    registry.mark_lost(1, "the probe failed")
    node.go(1)
    lost = coord.expect(RankExited, rank=1)
    assert lost.device_lost == "device 1 lost (the probe failed)"
    assert 1 not in managers and lost_manager.poll() is not None  # its memory went with it
    assert managers[0].poll() is None
    # Nothing starts on the lost device again: the generation is refused, rank by rank.
    spec1 = node.spec(1, {0: {"then": "run"}, 1: {"then": "run"}})
    coord.send(
        StartGeneration(
            generation=1,
            spec=spec1,
            ranks=[0, 1],
            heartbeat_timeout_s=3.0,
            node_heartbeat_s=0.2,
            device_registry=str(registry.root),
        )
    )
    refused = coord.expect(RankExited, rank=1, generation=1)
    assert refused.device_lost.startswith("device 1 lost") and "refused" in refused.said
    assert all(t.generation == 0 for t in node.agent.trainers.values())  # nothing of gen 1
    # The survivors' world: one rank, on device 0.
    spec2 = node.spec(2, {0: {"go": True, "exit": 0}})
    started = node.start(2, spec2, [0], devices={"0": 0}, device_registry=str(registry.root))
    assert isinstance(started, Started) and not started.promoted
    node.go(0)
    assert coord.expect(RankExited, rank=0, generation=2).returncode == 0
    pids = node.shutdown()
    assert all(_gone(p) for p in pids)


def test_ranks_keep_their_devices_after_a_world_change(node, tmp_path):
    registry = DeviceRegistry(tmp_path / "devices")
    registry.mark_lost(0, "gone before the start")
    spec = node.spec(0, {0: {"go": True, "exit": 0}, 1: {"go": True, "exit": 0}})
    # Ranks 0 and 1 run on devices 1 and 2: device 0 (lost) is not used, so nothing is refused.
    node.start(0, spec, [0, 1], devices={"0": 1, "1": 2}, device_registry=str(registry.root))
    assert node.agent.health.device_of(1) == 2
    node.go(0)
    node.go(1)
    for r in (0, 1):
        assert node.coordinator.expect(RankExited, rank=r).returncode == 0
    node.shutdown()


def _event(rank: int, generation: int, cause: FailStopCause) -> DetectionEvent:
    return DetectionEvent(
        kind=DetectionKind.FAIL_STOP,
        cause=cause,
        rank=rank,
        generation=generation,
        returncode=-9,
        reason="exited with status -9; device 1 lost",
    )


def test_the_machine_recovers_a_lost_device_on_fewer_ranks_only_when_the_job_replans():
    m = RecoveryMachine(world_size=4, max_restarts=5, retains_state=True, replans=True)
    m.begin()
    m.on_started(0)
    assert isinstance(m.on_detection(_event(1, 0, FailStopCause.DEVICE_LOST)), Stop)
    start = m.on_stopped(0)
    assert isinstance(start, Start) and start.generation == 1
    m.resize(3)
    m.on_started(1)
    for r in range(3):
        m.on_rank_exit(r, 1, 0)
    assert m.state is RecoveryState.DONE  # three ranks finishing is the whole job now

    fixed = RecoveryMachine(world_size=4, max_restarts=5, retains_state=True)
    fixed.begin()
    fixed.on_started(0)
    fail = fixed.on_detection(_event(1, 0, FailStopCause.DEVICE_LOST))
    assert isinstance(fail, Fail) and fixed.state is RecoveryState.FAILED
    assert "adapt.enabled" in fixed.transitions[-1][2]


def test_lose_is_a_fault_kind_with_the_usual_triggers():
    f = parse_fault("lose:rank=2,iter=5,phase=update")
    assert (f.kind, f.rank, f.iteration, f.phase.value) == (FaultKind.LOSE, 2, 5, "update")
    assert f.text() == "lose:rank=2,iter=5,phase=update"
