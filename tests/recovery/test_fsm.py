"""The recovery state machine, driven by agent decisions."""

from unbroken.recovery import FATAL_EXIT, RecoveryMachine, RecoveryState


def _running(world=2, **kw):
    m = RecoveryMachine(world_size=world, max_restarts=5, mode="inplace", **kw)
    assert m.begin().op == "start"
    m.on_started(0)
    assert m.state is RecoveryState.RUNNING
    return m


def test_failure_stops_then_restarts_in_place_and_ignores_the_old_generation():
    m = _running()
    m.note_progress(progressed=True, injected=True)
    assert m.on_rank_exit(1, 0, -9).op == "stop"
    assert m.on_rank_exit(0, 0, 1) is None  # the survivor of the torn-down generation
    a = m.on_stopped(0)
    assert (a.op, a.generation, a.recovery, a.resume) == ("start", 1, "inplace", True)
    m.on_started(1)
    assert m.on_rank_exit(0, 1, 0) is None
    assert m.on_rank_exit(1, 1, 0).op == "finish"
    assert m.state is RecoveryState.DONE
    assert [t[1] for t in m.transitions][-1] == "done"


def test_fatal_exit_falls_back_to_checkpoint_restart_once():
    m = _running()
    assert m.on_rank_exit(0, 0, -9).op == "stop"
    m.on_started(m.on_stopped(0).generation)
    assert m.on_rank_exit(1, 1, FATAL_EXIT).op == "stop"
    a = m.on_stopped(1)
    assert a.recovery == "ckpt_restart"
    m.on_started(2)
    m.on_rank_hung(0, 2, 3.0)
    assert m.on_stopped(2).recovery == "inplace"  # the fallback was for one recovery only


def test_a_fatal_exit_after_stalled_failures_still_gets_its_checkpoint_fallback():
    m = _running()
    for g in range(2):  # two stalled, uninjected failures (e.g. killed mid-takeover)
        m.note_progress(progressed=False, injected=False)
        assert m.on_rank_exit(0, g, -9).op == "stop"
        m.on_started(m.on_stopped(g).generation)
    m.note_progress(progressed=False, injected=False)
    assert m.on_rank_exit(0, 2, FATAL_EXIT).op == "stop"  # not a crash loop: fall back
    assert m.on_stopped(2).recovery == "ckpt_restart"
    m.on_started(3)
    m.note_progress(progressed=False, injected=False)
    a = m.on_rank_exit(1, 3, 1)  # the fallback made no progress either: now it is a loop
    assert a.op == "fail" and "crash loop" in a.reason


def test_crash_loop_and_max_restarts_fail_with_a_reason():
    m = _running()
    for g in range(3):
        m.note_progress(progressed=False, injected=False)
        a = m.on_rank_exit(0, g, 1)
        if a.op == "fail":
            break
        m.on_started(m.on_stopped(g).generation)
    assert m.state is RecoveryState.FAILED and "crash loop" in a.reason
    m = RecoveryMachine(world_size=1, max_restarts=0)
    m.begin()
    m.on_started(0)
    assert m.on_rank_exit(0, 0, -9).op == "fail"
