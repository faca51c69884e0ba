"""The recovery state machine, driven by agent decisions, without processes: its transition
table, its typed actions, and the restore mode each restart carries."""

import itertools

import pytest

from unbroken.recovery import (
    ALLOWED,
    FATAL_EXIT,
    Fail,
    Finish,
    IllegalTransition,
    RecoveryMachine,
    RecoveryState,
    RestoreMode,
    Start,
    Stop,
)


def _running(world=2, **kw):
    m = RecoveryMachine(world_size=world, max_restarts=5, retains_state=True, **kw)
    first = m.begin()
    assert isinstance(first, Start) and first.restore is RestoreMode.FRESH
    m.on_started(0)
    assert m.state is RecoveryState.RUNNING
    return m


def test_failure_stops_then_restarts_in_place_and_ignores_the_old_generation():
    m = _running()
    m.note_progress(progressed=True, injected=True)
    assert isinstance(m.on_rank_exit(1, 0, -9), Stop)
    assert m.on_rank_exit(0, 0, 1) is None  # the survivor of the torn-down generation
    a = m.on_stopped(0)
    assert a == Start(1, RestoreMode.IN_PLACE, "inplace")
    m.on_started(1)
    assert m.on_rank_exit(0, 1, 0) is None
    assert isinstance(m.on_rank_exit(1, 1, 0), Finish)
    assert m.state is RecoveryState.DONE
    assert [t[1] for t in m.transitions] == ["running", "stopping", "restarting", "running", "done"]


def test_a_job_without_retained_state_restarts_from_checkpoints():
    m = RecoveryMachine(world_size=1, max_restarts=3, retains_state=False)
    m.begin()
    m.on_started(0)
    m.on_rank_hung(0, 0, 2.0)
    assert m.on_stopped(0).restore is RestoreMode.CHECKPOINT


def test_fatal_exit_falls_back_to_checkpoint_restart_once():
    m = _running()
    assert isinstance(m.on_rank_exit(0, 0, -9), Stop)
    m.on_started(m.on_stopped(0).generation)
    assert isinstance(m.on_rank_exit(1, 1, FATAL_EXIT), Stop)
    a = m.on_stopped(1)
    assert a.restore is RestoreMode.CHECKPOINT
    m.on_started(2)
    m.on_rank_hung(0, 2, 3.0)
    assert m.on_stopped(2).restore is RestoreMode.IN_PLACE  # the fallback was for one recovery


def test_a_fatal_exit_after_stalled_failures_still_gets_its_checkpoint_fallback():
    m = _running()
    for g in range(2):  # two stalled, uninjected failures (e.g. killed mid-takeover)
        m.note_progress(progressed=False, injected=False)
        assert isinstance(m.on_rank_exit(0, g, -9), Stop)
        m.on_started(m.on_stopped(g).generation)
    m.note_progress(progressed=False, injected=False)
    assert isinstance(m.on_rank_exit(0, 2, FATAL_EXIT), Stop)  # not a crash loop: fall back
    assert m.on_stopped(2).restore is RestoreMode.CHECKPOINT
    m.on_started(3)
    m.note_progress(progressed=False, injected=False)
    a = m.on_rank_exit(1, 3, 1)  # the fallback made no progress either: now it is a loop
    assert isinstance(a, Fail) and "crash loop" in a.reason


def test_crash_loop_and_max_restarts_fail_with_a_reason():
    m = _running()
    for g in range(3):
        m.note_progress(progressed=False, injected=False)
        a = m.on_rank_exit(0, g, 1)
        if isinstance(a, Fail):
            break
        m.on_started(m.on_stopped(g).generation)
    assert m.state is RecoveryState.FAILED and "crash loop" in a.reason
    m = RecoveryMachine(world_size=1, max_restarts=0)
    m.begin()
    m.on_started(0)
    assert isinstance(m.on_rank_exit(0, 0, -9), Fail)


def test_a_node_loss_fails_the_job_once_and_nothing_moves_after_it():
    m = _running()
    assert isinstance(m.on_node_lost("beats stopped"), Fail)
    assert m.on_node_lost("again") is None
    assert m.on_rank_exit(0, 0, 1) is None and m.on_stopped(0) is None
    assert m.state is RecoveryState.FAILED


def test_a_job_that_replans_survives_a_node_loss_as_one_recovery():
    m = _running(world=4, replans=True)
    assert isinstance(m.on_node_lost("agent connection closed"), Stop)
    assert m.on_node_lost("its ranks' peers failed too") is None  # already stopping
    assert m.on_rank_exit(0, 0, 1) is None  # a survivor torn down with the generation
    m.resize(2)
    assert m.on_stopped(0) == Start(1, RestoreMode.IN_PLACE, "inplace")
    m.on_started(1)
    assert m.on_rank_exit(0, 1, 0) is None
    assert isinstance(m.on_rank_exit(1, 1, 0), Finish)


def test_the_transition_table_is_enforced():
    """Every pair of states: the machine's `_go` accepts exactly the listed transitions, and
    the terminal states have none."""
    assert ALLOWED[RecoveryState.DONE] == ALLOWED[RecoveryState.FAILED] == frozenset()
    for old, new in itertools.product(RecoveryState, RecoveryState):
        m = RecoveryMachine(world_size=1, max_restarts=1, state=old)
        if new in ALLOWED[old]:
            m._go(new, "test")
            assert m.state is new and m.transitions == [(old.value, new.value, "test")]
        else:
            with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
                m._go(new, "test")
            assert m.state is old and m.transitions == []


def test_evict_and_restart_recovers_slow_and_lost_devices_from_a_checkpoint():
    """The evict-and-restart baseline (`adapt.policy = "evict"`): a slow device evicted, then a
    lost node, each restart from the newest checkpoint on the others, not in place."""
    m = _running(world=4, replans=True, evicts=True)
    assert isinstance(m.on_evict("rank 3 runs 4.00x slower"), Stop)
    assert m.on_evict("a second report while stopping") is None
    m.resize(3)
    assert m.on_stopped(0) == Start(1, RestoreMode.CHECKPOINT, "ckpt_restart")
    m.on_started(1)
    assert isinstance(m.on_node_lost("agent connection closed"), Stop)
    m.resize(2)
    assert m.on_stopped(1) == Start(2, RestoreMode.CHECKPOINT, "ckpt_restart") and m.restarts == 2
    # Without the policy, a slow device is not the state machine's business.
    plain = _running(world=4, replans=True)
    assert plain.on_evict("rank 3 runs 4.00x slower") is None
    assert plain.state is RecoveryState.RUNNING
