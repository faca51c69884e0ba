"""Fail-stop decisions reach recovery through the detectors' one interface: the coordinator
turns an agent's rank_exit / rank_hung and its own node-loss decisions into
`DetectionEvent(kind=FAIL_STOP)`, logs them (the event-log records keep their fields) and hands
them to `RecoveryMachine.on_detection`. No processes: a recording stand-in plays the agent."""

from __future__ import annotations

import time
import types

import pytest

from unbroken.detect.events import DetectionEvent, DetectionKind, FailStopCause
from unbroken.launch.coordinator import Coordinator
from unbroken.metrics.log import read_jsonl
from unbroken.recovery import RecoveryMachine, RecoveryState

from ..foundation.conftest import tiny_job


def _stop(cause: FailStopCause, **kw) -> DetectionEvent:
    return DetectionEvent(kind=DetectionKind.FAIL_STOP, cause=cause, **kw)


def _running() -> RecoveryMachine:
    fsm = RecoveryMachine(world_size=2, max_restarts=3, mode="inplace")
    fsm.begin()
    fsm.on_started(0)
    return fsm


def test_fsm_acts_on_fail_stop_events_by_cause():
    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.EXIT, rank=1, generation=0, returncode=-9))
    assert act.op == "stop" and fsm.state is RecoveryState.STOPPING
    assert "rank 1 exited with status -9" in fsm.transitions[-1][2]

    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.HANG, rank=0, generation=0, silent_s=1.6))
    assert act.op == "stop" and "hung (no heartbeat for 1.60s)" in fsm.transitions[-1][2]

    fsm = _running()
    act = fsm.on_detection(_stop(FailStopCause.NODE_LOST, rank=None, node=0, reason="closed"))
    assert act.op == "fail" and fsm.state is RecoveryState.FAILED


def test_fsm_ignores_stale_generations_and_fail_slow_reports():
    fsm = _running()
    assert fsm.on_detection(_stop(FailStopCause.EXIT, rank=1, generation=7, returncode=1)) is None
    slow = DetectionEvent(kind=DetectionKind.FAIL_SLOW, rank=1, stage=0, factor=2.0)
    assert fsm.on_detection(slow) is None
    assert fsm.state is RecoveryState.RUNNING


def test_fsm_rejects_a_fail_stop_event_without_its_fields():
    with pytest.raises(ValueError, match="returncode"):
        _running().on_detection(_stop(FailStopCause.EXIT, rank=1, generation=0))
    with pytest.raises(ValueError, match="not a valid FailStopCause"):
        _running().on_detection(_stop("melted", rank=1, generation=0))  # type: ignore[arg-type]


class Agent:
    """Records what the coordinator sends to its agent."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.is_agent = True
        self.channel = types.SimpleNamespace(send=lambda op, **f: self.sent.append(op))


@pytest.fixture
def coordinator(tmp_path):
    coord = Coordinator(tiny_job(), tmp_path, quiet=True)
    coord.store = types.SimpleNamespace(port=0)  # only written into the generation spec
    coord._last_failure_t = 0.0
    coord._agent_seen = time.time()
    agent = Agent()
    coord.agent = agent
    coord._execute(coord.fsm.begin())
    coord._handle(agent, {"op": "started", "generation": 0})
    assert coord.fsm.state is RecoveryState.RUNNING and agent.sent == ["start"]
    yield coord, agent, tmp_path / "events.jsonl"
    coord.sel.close()
    coord.events.close()


def _records(path, kind):
    return [e for e in read_jsonl(path) if e["kind"] == kind]


def test_rank_exit_becomes_a_fail_stop_event_logged_and_acted_on(coordinator):
    coord, agent, log = coordinator
    seen: list[DetectionEvent] = []
    emit = coord.emit
    coord.emit = lambda e: (seen.append(e), emit(e))  # type: ignore[method-assign]
    coord._handle(
        agent,
        {"op": "rank_exit", "rank": 1, "generation": 0, "returncode": -9, "t": 5.0, "said": ""},
    )
    (event,) = seen
    assert (event.kind, event.cause, event.rank, event.returncode) == (
        DetectionKind.FAIL_STOP,
        FailStopCause.EXIT,
        1,
        -9,
    )
    (rec,) = _records(log, "failure_detected")
    assert rec["rank"] == 1 and rec["generation"] == 0 and rec["t_detected"] == 5.0
    assert rec["reason"] == "exited with status -9" and "detect_s" in rec
    assert rec["detection"] == "fail_stop" and rec["cause"] == "exit" and rec["returncode"] == -9
    assert coord.fsm.state is RecoveryState.STOPPING and agent.sent[-1] == "stop"


def test_a_finished_rank_is_not_a_failure(coordinator):
    coord, agent, log = coordinator
    coord._handle(agent, {"op": "rank_exit", "rank": 0, "generation": 0, "returncode": 0, "t": 1.0})
    assert _records(log, "failure_detected") == []
    assert coord.fsm.state is RecoveryState.RUNNING and coord.fsm.finished_ranks == {0}


def test_rank_hung_becomes_a_fail_stop_event(coordinator):
    coord, agent, log = coordinator
    coord._handle(agent, {"op": "rank_hung", "rank": 0, "generation": 0, "silent_s": 1.7, "t": 2.0})
    (rec,) = _records(log, "failure_detected")
    assert (
        rec["cause"] == "hang" and rec["silent_s"] == 1.7 and rec["reason"] == "hung (silent 1.70s)"
    )
    assert coord.fsm.state is RecoveryState.STOPPING and agent.sent[-1] == "stop"


def test_node_loss_becomes_a_fail_stop_event_and_fails_the_run(coordinator):
    coord, agent, log = coordinator
    coord._node_lost("beats stopped (agent silent for 1.2s)", 1.2)
    (rec,) = _records(log, "node_lost")
    assert rec["node"] == 0 and "beats stopped" in rec["reason"] and rec["silent_s"] == 1.2
    assert rec["detection"] == "fail_stop" and rec["cause"] == "node_lost"
    assert coord.fsm.state is RecoveryState.FAILED
    assert agent.sent == ["start"]  # nothing is sent to a lost agent


def test_fail_slow_reports_reach_the_same_sink(coordinator):
    coord, _, _ = coordinator
    assert coord.slow_watch.detector.sink is coord
