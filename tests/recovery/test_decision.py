"""The one recovery decision, as a pure function of every rank's retained summary: the path
every rank takes and each rank's action, for every branch (Leto §5.2's rule)."""

import pytest

from unbroken.recovery import (
    RankAction,
    RestoreMode,
    RestorePath,
    RetainedSummary,
    decide_restore,
    restore_mode,
)
from unbroken.update.marker import MarkerState, Stage


def _rank(stage=Stage.IDLE, iteration=5, done=4, **stats) -> RetainedSummary:
    marker = MarkerState(stage=stage, iteration=iteration, done_iter=done, **stats)
    return RetainedSummary(held=True, repaired=True, progress=done >= 0, marker=marker)


NOTHING = RetainedSummary(held=False, repaired=False, progress=False)
BROKEN = RetainedSummary(held=True, repaired=False, progress=True)


def test_every_rank_at_a_boundary_resumes_there():
    d = decide_restore([_rank(), _rank()])
    assert (d.path, d.next_iteration, d.finish) == (RestorePath.RESUME, 5, None)
    assert d.actions == (RankAction.AT_BOUNDARY, RankAction.AT_BOUNDARY)


def test_a_rank_that_protected_its_gradients_redoes_the_iteration_with_the_others():
    d = decide_restore([_rank(Stage.GRADS_PROTECTED), _rank()])
    assert (d.path, d.next_iteration) == (RestorePath.RESUME, 5)
    assert d.actions == (RankAction.REDO, RankAction.AT_BOUNDARY)
    assert d.reason == "redo the interrupted iteration 5"


def test_one_synced_rank_makes_every_rank_finish_that_update_with_its_statistics():
    synced = _rank(Stage.SYNCED, loss=2.5, grad_norm=1.25, grad_scale=0.5, lr=1e-3)
    d = decide_restore([_rank(Stage.GRADS_PROTECTED), synced, _rank(Stage.IDLE, 6, 5)])
    assert (d.path, d.finish, d.next_iteration) == (RestorePath.RESUME, 5, 6)
    assert d.actions == (
        RankAction.FINISH_WITH_PEER_STATS,
        RankAction.FINISH_UPDATE,
        RankAction.UPDATE_DONE,
    )
    assert (d.stats.loss, d.stats.grad_norm, d.stats.grad_scale, d.stats.lr) == (
        2.5,
        1.25,
        0.5,
        1e-3,
    )


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([_rank(Stage.SYNCED, 5), _rank(Stage.SYNCED, 6, 5)], "synced different iterations"),
        ([_rank(Stage.SYNCED, 5), _rank(Stage.IDLE, 4, 3)], "cannot join the update of 5"),
        ([_rank(Stage.IDLE, 5, 4), _rank(Stage.IDLE, 6, 5)], "completed different iterations"),
        ([_rank(), BROKEN], "rank(s) [1] could not repair"),
        ([NOTHING, _rank()], "rank(s) [0] retained nothing and peers made progress"),
    ],
)
def test_inconsistent_or_lost_progress_falls_back_to_checkpoints(rows, reason):
    d = decide_restore(rows)
    assert d.path is RestorePath.FALLBACK and reason in d.reason


def test_a_rank_beyond_repair_or_empty_is_filled_from_its_replica_while_the_rest_resume():
    """With data-parallel replicas a broken or empty rank no longer costs the job a checkpoint
    restart: the others decide as without it, and it takes a replica's state at the boundary."""
    synced = _rank(Stage.SYNCED, loss=2.5, grad_norm=1.25, grad_scale=0.5, lr=1e-3)
    rows = [BROKEN, synced, NOTHING, _rank(Stage.IDLE, 6, 5)]
    d = decide_restore(rows, [(0, 1, 2, 3)])
    assert (d.path, d.finish, d.next_iteration) == (RestorePath.RESUME, 5, 6)
    assert d.actions == (
        RankAction.FILL,
        RankAction.FINISH_UPDATE,
        RankAction.FILL,
        RankAction.UPDATE_DONE,
    )
    assert d.fill == ((0, 1), (2, 1)) and "take a replica's state" in d.reason


def test_a_rank_without_a_healthy_replica_still_falls_back():
    """Replica sets of a plan: rank 1's only replica (rank 3) is broken too; rank 0 could be
    filled from rank 2, but the job can only resume if every lacking rank can."""
    d = decide_restore([BROKEN, BROKEN, _rank(), BROKEN], [(0, 2), (1, 3)])
    assert d.path is RestorePath.FALLBACK and d.fill == ()
    assert decide_restore([_rank(), BROKEN]).path is RestorePath.FALLBACK  # no replica sets
    d = decide_restore([BROKEN, _rank(), _rank(), _rank()], [(0, 2), (1, 3)])
    assert d.path is RestorePath.RESUME and d.fill == ((0, 2),)
    assert decide_restore([BROKEN, NOTHING], [(0, 1)]).path is RestorePath.FALLBACK


def test_a_rank_behind_the_job_takes_its_replicas_state_where_one_has_it():
    """A standby rejoining a grown world holds the iteration its replica was dissolved at
    (done 2); its replica (rank 0) and the other stage's ranks completed 6. It is filled, not
    a reason to fall back; without a replica it still falls back."""
    rows = [_rank(Stage.IDLE, 7, 6), _rank(Stage.IDLE, 7, 6), _rank(Stage.IDLE, 3, 2)]
    rows.append(_rank(Stage.IDLE, 7, 6))
    d = decide_restore(rows, [[0, 2], [1, 3]])
    assert (d.path, d.next_iteration) == (RestorePath.RESUME, 7)
    assert d.actions[2] is RankAction.FILL and d.fill == ((2, 0),)
    assert d.actions[0] is RankAction.AT_BOUNDARY
    assert decide_restore(rows, [[0], [1, 3], [2]]).path is RestorePath.FALLBACK
    assert decide_restore(rows).path is RestorePath.FALLBACK


def test_ranks_inside_the_newest_update_are_not_behind_it():
    """A peer completed 5; ranks past 5's sync, or protected for it, finish it (not filled)."""
    rows = [_rank(Stage.IDLE, 6, 5), _rank(Stage.SYNCED, 5), _rank(Stage.GRADS_PROTECTED, 5)]
    d = decide_restore(rows, [[0, 1, 2]])
    assert d.path is RestorePath.RESUME and d.fill == () and d.finish == 5
    behind = [_rank(Stage.IDLE, 6, 5), _rank(Stage.GRADS_PROTECTED, 4, 3)]
    assert decide_restore(behind, [[0, 1]]).fill == ((1, 0),)


def test_a_rank_of_no_stage_neither_falls_back_nor_chooses_the_boundary():
    """[Note: a rank of no stage]: rank 1 holds nothing in its plan (new regions, or a marker
    of a layout it no longer holds, 2 iterations behind); the others decide without it, their
    fill pairs in the full table's ranks, and it stands by. Without the flag the same rows
    fall back."""
    synced = _rank(Stage.SYNCED, loss=2.5, grad_norm=1.25, grad_scale=0.5, lr=1e-3)
    empty = RetainedSummary(held=False, repaired=False, progress=False, empty=True)
    stale = RetainedSummary(
        held=True, repaired=True, progress=True, marker=MarkerState(done_iter=2), empty=True
    )
    for standby in (empty, stale):
        rows = [synced, standby, BROKEN, _rank(Stage.IDLE, 6, 5)]
        d = decide_restore(rows, [(0, 2), (2, 3)])
        assert (d.path, d.finish, d.next_iteration) == (RestorePath.RESUME, 5, 6)
        assert d.actions == (
            RankAction.FINISH_UPDATE,
            RankAction.STANDBY,
            RankAction.FILL,
            RankAction.UPDATE_DONE,
        )
        assert d.fill == ((2, 0),) and "[1] hold no stage" in d.reason
    no_flag = RetainedSummary(held=False, repaired=False, progress=False)
    assert decide_restore([synced, no_flag], [(0,)]).path is RestorePath.FALLBACK
    # Every rank of no stage (not a plan's world) is not special-cased.
    assert decide_restore([empty, empty]).path is RestorePath.START_OVER


def test_nothing_retained_and_no_progress_starts_over_in_this_generation():
    fresh_start = _rank(Stage.IDLE, 0, -1)
    d = decide_restore([NOTHING, fresh_start])
    assert d.path is RestorePath.START_OVER and "[0] retained nothing" in d.reason


def test_a_summary_survives_its_row_form_and_an_unrepaired_one_has_no_marker():
    s = _rank(Stage.SYNCED, 7, 6, loss=1.5, grad_norm=2.0, grad_scale=0.25, lr=3e-4)
    row = s.to_row()
    assert len(row) == RetainedSummary.ROW
    back = RetainedSummary.from_row(row)
    assert back.marker.stage is Stage.SYNCED and (back.marker.iteration, back.marker.lr) == (
        7,
        3e-4,
    )
    assert RetainedSummary.from_row(BROKEN.to_row()) == BROKEN
    empty = RetainedSummary(held=False, repaired=False, progress=False, empty=True)
    assert RetainedSummary.from_row(empty.to_row()) == empty


def test_the_coordinator_restore_mode():
    assert restore_mode(True, 0, False) is RestoreMode.FRESH
    assert restore_mode(True, 3, False) is RestoreMode.IN_PLACE
    assert restore_mode(True, 3, True) is RestoreMode.CHECKPOINT
    assert restore_mode(False, 3, False) is RestoreMode.CHECKPOINT


def test_a_filled_rank_does_not_finish_an_update_it_never_held():
    """With a peer past the sync, the decision carries `finish`; the rank to be filled has no
    marker to finish from and must leave its updater alone (it takes the donor's state after)."""
    from unbroken.launch.restore import finish_update

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the filled rank's updater was used: {name}")

    synced = _rank(Stage.SYNCED, loss=2.5, grad_norm=1.25, grad_scale=0.5, lr=1e-3)
    d = decide_restore([synced, NOTHING], [(0, 1)])
    assert d.finish == 5 and d.actions[1] is RankAction.FILL
    finish_update(Untouchable(), d, 1, hook=None)
