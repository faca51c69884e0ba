"""The plan value: construction, rank numbering, invariants, JSON and determinism."""

import dataclasses
import json
import pickle

import pytest

from unbroken.parallel import (
    SCHEDULES,
    Migration,
    ParallelPlan,
    Replica,
    StageGroup,
    make_plan,
    plan_for,
    split_layers,
)


def test_rank_numbering_is_replica_then_stage_then_tp() -> None:
    plan = make_plan(dp=2, pp=2, tp=2, num_layers=8, microbatches=2)
    groups = [[g.ranks for g in rep.stages] for rep in plan.replicas]
    assert groups == [[(0, 1), (2, 3)], [(4, 5), (6, 7)]]
    assert plan.locate(6) == (1, 1)
    assert plan.ranks == tuple(range(8))
    assert [g.layers for g in plan.replicas[0].stages] == [(0, 4), (4, 8)]


def test_heterogeneous_tp_per_stage_and_per_replica() -> None:
    plan = make_plan(dp=2, pp=2, tp=[[2, 1], [1, 4]], num_layers=4, microbatches=1)
    assert [[g.tp for g in rep.stages] for rep in plan.replicas] == [[2, 1], [1, 4]]
    assert plan.ranks == tuple(range(8))


def test_virtual_stages_reuse_the_device_groups() -> None:
    plan = make_plan(
        dp=1,
        pp=2,
        tp=1,
        num_layers=8,
        microbatches=2,
        schedule="interleaved_1f1b",
        virtual_stages=2,
    )
    assert plan.num_stages == 4 and plan.pp == 2
    assert [g.ranks for g in plan.replicas[0].stages] == [(0,), (1,), (0,), (1,)]
    assert [g.layers for g in plan.replicas[0].stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_json_round_trip_is_exact(schedule: str) -> None:
    v = 2 if schedule == "interleaved_1f1b" else 1
    plan = make_plan(
        dp=2, pp=2, tp=[2, 1], num_layers=8, microbatches=4, schedule=schedule, virtual_stages=v
    )
    again = ParallelPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()
    assert json.loads(plan.to_json(indent=2))["actions"]["0"][0] == "0F0"


def test_plans_pickle() -> None:
    plan = make_plan(
        dp=2, pp=2, tp=1, num_layers=4, microbatches=2, migrations=[Migration(0, 1, 1)]
    )
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_plans_are_deterministic_values() -> None:
    args = dict(dp=2, pp=4, tp=[1, 2, 1, 1], num_layers=16, microbatches=8, schedule="zb_h1")
    a, b = make_plan(**args), make_plan(**args)
    assert a == b and a.to_json() == b.to_json()
    with pytest.raises(TypeError):
        a.actions[0] = ()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.schedule = "gpipe"  # type: ignore[misc]


def test_make_plan_positional_form() -> None:
    assert make_plan(2, 2, 1, 8, 4, "gpipe") == make_plan(
        dp=2, pp=2, tp=1, num_layers=8, microbatches=4, schedule="gpipe"
    )


def test_split_layers() -> None:
    assert split_layers(10, 4) == (3, 3, 2, 2)
    assert split_layers(12, 3, [1.0, 0.25, 1.0]) == (5, 2, 5)  # ResiHP Fig. 5 repartition
    assert sum(split_layers(7, 7)) == 7
    with pytest.raises(ValueError, match="cannot split"):
        split_layers(3, 4)


def test_make_plan_layer_split_and_weights() -> None:
    plan = make_plan(dp=1, pp=3, tp=1, num_layers=12, microbatches=3, stage_weights=[1, 0.25, 1])
    assert [g.layers for g in plan.replicas[0].stages] == [(0, 5), (5, 7), (7, 12)]
    plan = make_plan(dp=1, pp=2, tp=1, num_layers=5, microbatches=2, layer_split=[1, 4])
    assert [g.layers for g in plan.replicas[0].stages] == [(0, 1), (1, 5)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=3), "power of two"),
        (dict(tp=[1, 2, 1]), "per stage"),
        (dict(layer_split=[4, 3]), "layer_split"),
        (dict(schedule="pipedream"), "unknown schedule"),
        (dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=3), "multiple of pp"),
        (dict(virtual_stages=2), "interleaved_1f1b"),
        (dict(microbatches=[2]), "micro-batch counts"),
    ],
)
def test_make_plan_rejects_bad_inputs(kwargs: dict, message: str) -> None:
    args = dict(dp=2, pp=2, tp=1, num_layers=8, microbatches=2) | kwargs
    with pytest.raises(ValueError, match=message):
        make_plan(**args)


def _layout(*groups: tuple[tuple[int, ...], tuple[int, int]]) -> Replica:
    return Replica(tuple(StageGroup(ranks, layers) for ranks, layers in groups))


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ([_layout(((0,), (0, 2)), ((0,), (2, 4)))], "two stage groups"),
        ([_layout(((0,), (0, 2)), ((1,), (3, 4)))], "contiguously"),
        ([_layout(((0,), (0, 2)), ((1,), (2, 3)))], r"not \[0, 4\)"),
        ([_layout(((0,), (0, 4))), _layout(((1,), (0, 2)), ((2,), (2, 4)))], "stages"),
    ],
)
def test_validation_errors_name_the_invariant(replicas: list[Replica], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelPlan(
            replicas=tuple(replicas),
            num_layers=4,
            microbatches=(1,) * len(replicas),
            schedule="1f1b",
        )


def test_stage_group_checks() -> None:
    with pytest.raises(ValueError, match="power of two"):
        StageGroup((0, 1, 2), (0, 1))
    with pytest.raises(ValueError, match="distinct"):
        StageGroup((1, 1), (0, 1))
    with pytest.raises(ValueError, match="non-empty"):
        StageGroup((0,), (2, 2))


def test_explicit_layout_with_gaps_in_ranks() -> None:
    """A re-plan after failures: rank 1 is gone, rank 5 is a standby holding nothing."""
    reps = [_layout(((0,), (0, 3)), ((2, 3), (3, 4))), _layout(((4,), (0, 2)), ((6, 7), (2, 4)))]
    plan = plan_for(reps, [2, 2], "1f1b")
    assert plan.ranks == (0, 2, 3, 4, 6, 7)
    assert set(plan.actions) == set(plan.ranks)
    assert ParallelPlan.from_json(plan.to_json()) == plan


def test_actions_must_match_ranks_and_peers() -> None:
    plan = make_plan(dp=1, pp=2, tp=1, num_layers=4, microbatches=2)
    with pytest.raises(ValueError, match="missing"):
        dataclasses.replace(plan, actions={0: plan.actions[0]})
    bad = dict(plan.actions)
    bad[0] = tuple(a if not a.is_send else dataclasses.replace(a, peer=9) for a in bad[0])
    with pytest.raises(ValueError, match="peer"):
        dataclasses.replace(plan, actions=bad)


def test_migration_is_part_of_the_plan() -> None:
    moves = [Migration(microbatch=4, stage=1, replica=0), Migration(5, 1, 0)]
    plan = make_plan(dp=2, pp=2, tp=1, num_layers=4, microbatches=4, migrations=moves)
    assert plan.owner(4) == 1 and plan.executor(4, 1) == 0 and plan.executor(4, 0) == 1
    assert plan.placement()[(5, 1)] == 0
    mine = {str(a) for a in plan.actions[1]}  # replica 0, stage 1
    assert {"1F4", "1B4", "1RECV_F4<-r2", "1SEND_B4->r2"} <= mine
    theirs = {str(a) for a in plan.actions[3]}  # replica 1, stage 1
    assert "1F4" not in theirs and "1F6" in theirs
    assert ParallelPlan.from_json(plan.to_json()) == plan


def test_migration_checks() -> None:
    with pytest.raises(ValueError, match="moved twice"):
        make_plan(
            dp=2, pp=2, tp=1, num_layers=4, microbatches=2,
            migrations=[Migration(0, 1, 1), Migration(0, 1, 1)],
        )  # fmt: skip
    with pytest.raises(ValueError, match="layers"):
        plan_for(
            [_layout(((0,), (0, 1)), ((1,), (1, 4))), _layout(((2,), (0, 2)), ((3,), (2, 4)))],
            [1, 1],
            "1f1b",
            migrations=[Migration(0, 1, 1)],
        )
