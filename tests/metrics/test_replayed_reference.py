"""The reference a run with a replayed plan change is audited against
(`unbroken.metrics.replay`): the launch-plan reference before the change, each replay from
its change on, the last replay's final hashes — with negative controls through `audit`."""

from __future__ import annotations

from unbroken.launch.coordinator.replay import ReplayPoint
from unbroken.metrics.replay import reference_rows, replay_records, replayed_reference
from unbroken.metrics.summary import audit


def _run(rows, final, name="r"):
    """rows: (iteration, hash[, generation])."""
    return {
        "run_name": name,
        "final_state_hash": final,
        "rank_hashes": [final],
        "metrics": [
            {
                "iter": r[0],
                "state_hash": r[1],
                "rank_hashes": None,
                "generation": r[2] if len(r) > 2 else 0,
            }
            for r in rows
        ],
    }


def _point(iteration, generation=1):
    plan = {"replicas": [[{"ranks": [0, 1], "layers": [0, 2]}]]}
    return ReplayPoint(generation, iteration, plan, 2, f"/kept/gen{generation}")


LAUNCH = _run([(0, "a0"), (1, "a1"), (2, "a2"), (3, "a3"), (4, "a4")], "a4", "reference")
REPLAY = _run([(2, "b2"), (3, "b3"), (4, "b4")], "b4", "replay1")


def test_each_generation_is_audited_against_the_reference_it_ran_beside():
    row = reference_rows(replayed_reference(LAUNCH, [(_point(2), REPLAY)]))
    # Generation 0 ran iteration 2 and 3 under the launch plan before the device was lost;
    # generation 1 ran them again from the checkpoint under the new plan.
    assert [row(0, i)["state_hash"] for i in range(5)] == ["a0", "a1", "a2", "a3", "a4"]
    assert [row(1, i)["state_hash"] for i in (2, 3, 4)] == ["b2", "b3", "b4"]
    assert row(1, 1) is None  # the replay never ran it
    merged = replayed_reference(LAUNCH, [(_point(2), REPLAY)])
    assert merged["final_state_hash"] == "b4" and merged["rank_hashes"] == ["b4"]
    assert replayed_reference(LAUNCH, []) is LAUNCH


def test_two_changes_take_each_replay_from_its_generation_on():
    second = _run([(3, "c3"), (4, "c4")], "c4", "replay2")
    merged = replayed_reference(LAUNCH, [(_point(2), REPLAY), (_point(3, 3), second)])
    row = reference_rows(merged)
    assert [row(g, 3)["state_hash"] for g in (0, 1, 2, 3, 4)] == ["a3", "b3", "b3", "c3", "c3"]
    assert merged["final_state_hash"] == "c4"


def test_the_audit_passes_only_a_run_that_matches_the_reference_before_and_the_replay_after():
    faulty = _run(
        [(0, "a0"), (1, "a1"), (2, "a2"), (3, "a3"), (2, "b2", 1), (3, "b3", 1), (4, "b4", 1)],
        "b4",
        "faulty",
    )
    replays = [(_point(2), REPLAY)]
    assert audit(replayed_reference(LAUNCH, replays), faulty)["bit_exact"] is True
    # Against the launch reference alone the same run is not bit-exact.
    assert audit(LAUNCH, faulty)["per_iteration_mismatches"] == [2, 3, 4]
    # A run that went wrong before the change is caught there, though it ends on the replay;
    # so is a generation-0 row that differs from the launch reference at an iteration the
    # replay ran again.
    early = _run([(0, "a0"), (1, "zz"), (2, "b2", 1), (3, "b3", 1), (4, "b4", 1)], "b4")
    assert audit(replayed_reference(LAUNCH, replays), early)["per_iteration_mismatches"] == [1]
    rerun = _run([(0, "a0"), (1, "a1"), (2, "zz"), (2, "b2", 1), (3, "b3", 1), (4, "b4", 1)], "b4")
    assert audit(replayed_reference(LAUNCH, replays), rerun)["per_iteration_mismatches"] == [2]


def test_replay_records_name_the_change():
    (row,) = replay_records([(_point(2), REPLAY)])
    assert row == {
        "generation": 1,
        "iteration": 2,
        "world": 2,
        "tp": [2],
        "stages": [[0, 2]],
        "from_checkpoint": True,
        "run": "replay1",
        "final_state_hash": "b4",
    }
