"""The coordinator's decisions for a pipeline job (`PipelineAdaptation`), without processes:
a lost device of a one-replica pipeline shrinks it onto the survivors and asks for a checkpoint
restart; in a DP x PP job the scheduler dissolves the broken replica and the survivors restore
in place; a slow device moves micro-batches off its replica and gets them back at full speed;
what is not built is skipped with its reason."""

from __future__ import annotations

import json

import pytest

from unbroken.config import AdaptConfig
from unbroken.detect.events import DetectionEvent, DetectionKind
from unbroken.detect.pipeline import PlanFit, PlanSchedule
from unbroken.detect.workload import MicroBatchModel, WorkloadPredictor
from unbroken.launch.coordinator.adapt_plan import PipelineAdaptation, emulates
from unbroken.metrics.log import JsonlLog, read_jsonl
from unbroken.parallel import ParallelPlan, Replica, StageGroup, make_plan, plan_for
from unbroken.plan import NoPlanError


def _adapt(tmp_path, pp=4, layers=8, dp=1):
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    said: list[str] = []
    return PipelineAdaptation(make_plan(dp, pp, 1, layers, 4), events, said.append), said


def _events(tmp_path, kind):
    return [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == kind]


def test_an_unchanged_world_keeps_its_plan_and_spec(tmp_path):
    adapt, _ = _adapt(tmp_path)
    assert adapt.next_world() is None
    assert adapt.spec_fields() == {"plan": None, "plan_epoch": 0} and not adapt.relayout


def test_a_lost_device_shrinks_the_pipeline_onto_the_survivors(tmp_path):
    adapt, said = _adapt(tmp_path)
    adapt.note_lost(2, "device 2 lost (health check)")
    world = adapt.next_world()
    assert world is not None and world.devices == (0, 1, 3) and world.epoch == 1
    assert world.placement is None and adapt.relayout
    fields = adapt.spec_fields()
    plan = ParallelPlan.from_dict(fields["plan"])
    assert fields["plan_epoch"] == 1 and plan.pp == 3 and sorted(plan.ranks) == [0, 1, 2]
    (replan,) = _events(tmp_path, "replan")
    assert replan["trigger"]["devices"] == [2] and replan["restore"] == "checkpoint"
    assert replan["devices_after"] == [0, 1, 3] and len(replan["after"]) == 3
    assert "1 x 4 -> 1 x 3 (replicas x stages)" in said[-1]
    # A second loss shrinks again, from the running world's devices.
    adapt.note_lost(3, "device 3 lost")
    assert adapt.next_world().devices == (0, 1)


def test_a_shrunk_pipeline_grows_back_to_the_launch_plan_from_the_checkpoint(tmp_path):
    adapt, _ = _adapt(tmp_path)
    adapt.note_lost(1, "lost")
    adapt.next_world()
    assert not adapt.grows
    adapt.note_returned([1], "node 0 returned")
    assert adapt.grows
    world = adapt.next_world()
    assert world.devices == (0, 1, 2, 3) and adapt.relayout  # the survivors' layers moved
    assert ParallelPlan.from_dict(adapt.spec_fields()["plan"]) == adapt.launch
    grow = _events(tmp_path, "replan")[-1]
    assert grow["trigger"]["kind"] == "devices_returned" and grow["restore"] == "checkpoint"
    assert adapt.next_world() is None and not adapt.grows


def test_a_dissolved_replica_grows_back_in_place_when_its_devices_return(tmp_path):
    adapt, _ = _adapt(tmp_path, pp=2, layers=4, dp=2)
    adapt.note_lost(2, "node 1 lost")
    adapt.note_lost(3, "node 1 lost")
    assert adapt.next_world().devices == (0, 1)
    adapt.note_returned([2], "node 1 returned")
    assert not adapt.grows  # device 3 is still lost
    adapt.note_returned([3], "node 1 returned")
    world = adapt.next_world()
    assert world.devices == (0, 1, 2, 3) and not adapt.relayout  # 0, 1 kept their stages
    assert _events(tmp_path, "replan")[-1]["restore"] == "in_place"


def test_devices_back_before_the_world_shrank_keep_the_running_plan(tmp_path):
    adapt, _ = _adapt(tmp_path)
    adapt.note_lost(3, "node 1 lost")
    adapt.note_returned([3], "spare node 2 replaces lost node 1")
    assert adapt.next_world() is None and not _events(tmp_path, "replan_skipped")


def _slow(rank: int, factor: float = 4.0) -> DetectionEvent:
    return DetectionEvent(
        kind=DetectionKind.FAIL_SLOW, iteration=5, rank=rank, factor=factor, cause="compute"
    )


def test_a_slow_device_of_a_one_replica_pipeline_is_not_planned_around_without_retained_state(
    tmp_path,
):
    adapt, _ = _adapt(tmp_path)
    assert adapt.on_fail_slow(_slow(1, 2.0)) is False
    (skip,) = _events(tmp_path, "replan_skipped")
    assert "recovery.mode = inplace" in skip["reason"] and not adapt.restarts


def _moving(tmp_path, dp=1, pp=4, layers=8):
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    said: list[str] = []
    plan = make_plan(dp, pp, 1, layers, 4)
    return PipelineAdaptation(plan, events, said.append, moves_layers=True), said


def test_a_slow_stage_of_a_one_replica_pipeline_gives_layers_away_at_a_planned_stop(tmp_path):
    adapt, said = _moving(tmp_path)
    launch = adapt.plan
    assert adapt.on_fail_slow(_slow(1, 3.0), iter_s=0.2) is True
    # Decided, not adopted: the running generation stops first (`restarts`).
    assert adapt.restarts and adapt.plan == launch and "moves layers" in said[-1]
    assert _events(tmp_path, "replan") == []
    assert adapt.on_fail_slow(_slow(2, 3.0)) is False  # one move at a time
    world = adapt.next_world()
    assert world is not None and world.devices == (0, 1, 2, 3) and world.epoch == 1
    assert adapt.reshard == launch and not adapt.relayout and not adapt.restarts
    new = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    layers = [g.layers for g in new.replicas[0].stages]
    assert layers[1][1] - layers[1][0] < 2 and layers[0][0] == 0 and layers[-1][1] == 8
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "reshard" and replan["trigger"]["rank"] == 1
    assert replan["predicted_after"] < replan["predicted_before"]
    assert "layers per stage" in said[-1]
    # The slow mark stays: the same report again finds nothing better.
    assert adapt.on_fail_slow(_slow(1, 3.0)) is False
    assert adapt.replans == 1


def test_a_one_replica_pipeline_takes_its_layers_back_at_a_planned_stop_at_full_speed(tmp_path):
    # PP2, 4 layers: rank 0 4x slow gives a layer away; at full speed again it takes it back
    # the same way (decided now, adopted at the planned stop, the state moved: RESHARD).
    adapt, said = _moving(tmp_path, pp=2, layers=4)
    launch = adapt.plan
    assert adapt.on_fail_slow(_slow(0), iter_s=0.2) is True
    assert adapt.on_recovered(0, 1.0) is False  # the move waits for its stop first
    assert "waiting for its stop" in _events(tmp_path, "replan_skipped")[-1]["reason"]
    adapt.next_world()
    moved = adapt.plan
    assert [g.layers for g in moved.replicas[0].stages] == [(0, 1), (1, 4)]
    adapt.reshard = None  # read by the coordinator
    assert adapt.on_recovered(1, 1.0) is False  # rank 1 was never marked slow
    assert adapt.on_recovered(0, 1.03, iter_s=0.25) is True
    assert adapt.restarts and adapt.plan == moved and "moves layers" in said[-1]
    assert len(_events(tmp_path, "replan")) == 1  # adopted at the stop
    world = adapt.next_world()
    assert world is not None and world.devices == (0, 1) and world.epoch == 2
    assert adapt.reshard == moved and not adapt.relayout and not adapt.restarts
    assert [g.layers for g in adapt.plan.replicas[0].stages] == [(0, 2), (2, 4)]
    assert adapt.plan.microbatches == launch.microbatches == (4,)
    back = _events(tmp_path, "replan")[-1]
    assert back["trigger"] == {"kind": "speed_recovered", "rank": 0, "factor": 1.03, "device": 0}
    assert back["restore"] == "reshard" and back["epoch"] == 2
    assert [s["layers"] for s in back["before"]] == [[0, 1], [1, 4]]
    assert [s["layers"] for s in back["after"]] == [[0, 2], [2, 4]]
    assert back["predicted_after"] < back["predicted_before"]
    assert adapt.replans == 2
    assert adapt.on_recovered(0, 1.0) is False  # healthy already
    assert adapt.next_world() is None


def test_a_one_replica_pipeline_keeps_moved_layers_past_max_replans(tmp_path):
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    plan = make_plan(1, 2, 1, 4, 4)
    adapt = PipelineAdaptation(
        plan, events, lambda _: None, adapt=AdaptConfig(max_replans=1), moves_layers=True
    )
    assert adapt.on_fail_slow(_slow(0)) is True
    adapt.next_world()
    assert adapt.on_recovered(0, 1.0) is False and not adapt.restarts
    assert "max_replans = 1 reached" in _events(tmp_path, "replan_skipped")[-1]["reason"]


def _layouts(plan: ParallelPlan) -> list[list[tuple[int, int]]]:
    return [[g.layers for g in rep.stages] for rep in plan.replicas]


def test_a_dp_x_pp_job_moves_the_slow_replicas_layers_alone_and_takes_them_back(tmp_path):
    # Replica 0's first stage at 1/6 speed: the scheduler's repartition gives that replica alone
    # layers [0, 1) [1, 4) beside replica 1's [0, 2) [2, 4) (the ordered reduction folds each
    # parameter over its holders, wherever they hold it): decided now, adopted at a planned
    # stop, the state moved between the ranks (RESHARD). At full speed again the launch
    # layout and counts come back the same way.
    adapt, said = _moving(tmp_path, dp=2, pp=2, layers=4)
    launch = adapt.plan
    assert adapt.on_fail_slow(_slow(0, 6.0), iter_s=0.2) is True
    assert adapt.restarts and adapt.plan == launch and "moves layers" in said[-1]
    world = adapt.next_world()
    assert world is not None and world.devices == (0, 1, 2, 3)
    assert adapt.reshard == launch and not adapt.relayout
    moved = adapt.plan
    assert _layouts(moved) == [[(0, 1), (1, 4)], [(0, 2), (2, 4)]]
    assert moved.microbatches[0] < moved.microbatches[1]
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "reshard" and replan["trigger"]["rank"] == 0
    assert replan["predicted_after"] < replan["predicted_before"]
    adapt.reshard = None  # read by the coordinator
    assert adapt.on_recovered(0, 1.02, iter_s=0.25) is True
    assert adapt.restarts and adapt.plan == moved
    assert adapt.next_world() is not None and adapt.reshard == moved
    assert _layouts(adapt.plan) == _layouts(launch) and adapt.plan.microbatches == (4, 4)
    back = _events(tmp_path, "replan")[-1]
    assert back["trigger"]["kind"] == "speed_recovered" and back["restore"] == "reshard"
    assert adapt.replans == 2


def test_a_slow_device_of_a_dp_x_pp_job_moves_microbatches_and_keeps_every_ranks_layers(
    tmp_path,
):
    class Store:  # what the coordinator publishes (`JobStore.publish_placement`), in memory
        def __init__(self) -> None:
            self.published: list[tuple[int, str]] = []

        def publish_placement(self, epoch: int, text: str) -> None:
            self.published.append((epoch, text))

    store = Store()
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    adapt = PipelineAdaptation(make_plan(2, 2, 1, 4, 4), events, lambda _: None, store)
    assert adapt.on_fail_slow(_slow(0), iter_s=0.2) is True
    ((epoch, text),) = store.published
    plan = ParallelPlan.from_dict(json.loads(text)["plan"])
    assert epoch == 1 and plan.microbatches[0] < plan.microbatches[1]
    assert plan.ranks == (0, 1, 2, 3) and adapt.plan == plan
    assert [g.layers for g in plan.replicas[1].stages] == [(0, 2), (2, 4)]
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "live"
    assert 0.2 < replan["predicted_after_s"] < replan["predicted_before_s"]  # 0.2 s: healthy
    # The same report again: the plan already accounts for it.
    assert adapt.on_fail_slow(_slow(0)) is False
    assert "predicted gain" in _events(tmp_path, "replan_skipped")[-1]["reason"]
    # At full speed again: its replica gets its micro-batches back, live, on the same ranks.
    assert adapt.on_recovered(1, 1.02) is False  # rank 1 was never marked slow
    assert adapt.on_recovered(0, 1.02, iter_s=0.2) is True
    (_, text) = store.published[-1]
    back = ParallelPlan.from_dict(json.loads(text)["plan"])
    assert back.microbatches == (4, 4) and back.ranks == (0, 1, 2, 3) and adapt.plan == back
    assert [g.layers for g in back.replicas[0].stages] == [(0, 2), (2, 4)]
    _, again = _events(tmp_path, "replan")
    assert again["trigger"] == {"kind": "speed_recovered", "rank": 0, "factor": 1.02, "device": 0}
    assert again["restore"] == "live" and again["counts_after"] == [4, 4]
    assert again["predicted_after_s"] < again["predicted_before_s"]
    assert adapt.on_recovered(0, 1.0) is False  # healthy already
    assert adapt.replans == 2


def test_a_pipeline_job_does_not_switch_back_and_forth_past_max_replans(tmp_path):
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    plan = make_plan(2, 2, 1, 4, 4)
    adapt = PipelineAdaptation(plan, events, lambda _: None, adapt=AdaptConfig(max_replans=1))
    assert adapt.on_fail_slow(_slow(0)) is True
    assert adapt.on_recovered(0, 1.0) is False
    assert "max_replans = 1 reached" in _events(tmp_path, "replan_skipped")[-1]["reason"]


def _config(**parallel):
    from unbroken.config import AdaptConfig, JobConfig, ParallelConfig

    policy = parallel.pop("policy", "resihp")
    return JobConfig(
        parallel=ParallelConfig(**parallel), adapt=AdaptConfig(enabled=True, policy=policy)
    )


def test_the_config_admits_plan_jobs_and_says_what_it_refuses():
    assert _config(world_size=4, pp=4).parallel.planned
    assert _config(world_size=4, pp=2).parallel.dp == 2
    assert _config(world_size=4, tp=2).parallel.dp == 2
    with pytest.raises(ValueError, match=r'set parallel\.schedule = "1f1b" or "gpipe"'):
        _config(world_size=4, pp=2, schedule="zb_h1")
    assert _config(world_size=4, pp=2, policy="evict").adapt.policy == "evict"  # baselines too


def test_a_dp_x_pp_job_dissolves_the_broken_replica_and_keeps_the_survivors_in_place(tmp_path):
    adapt, said = _adapt(tmp_path, pp=2, layers=4, dp=2)
    adapt.note_lost(1, "device 1 lost (health check)")
    world = adapt.next_world()
    # Replica 0 (devices 0, 1) is dissolved; replica 1 (devices 2, 3) runs every micro-batch
    # as ranks 0, 1 and keeps its stages; device 0 is a standby outside the world.
    assert world is not None and world.devices == (2, 3) and not adapt.relayout
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert (plan.dp, plan.pp, plan.microbatches, plan.ranks) == (1, 2, (8,), (0, 1))
    assert [g.layers for g in plan.replicas[0].stages] == [(0, 2), (2, 4)]
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "in_place" and replan["devices_after"] == [2, 3]
    assert "standbys (alive, outside the world): devices [0]" in replan["explain"]
    assert "in place, no checkpoint" in said[-1]
    # Then the only copy of stage 1 is lost: the survivor and the standby run the pipeline
    # from the checkpoint.
    adapt.note_lost(3, "device 3 lost")
    world = adapt.next_world()
    assert world.devices == (0, 2) and adapt.relayout
    assert _events(tmp_path, "replan")[-1]["restore"] == "checkpoint"
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert (plan.dp, plan.pp, plan.microbatches) == (1, 2, (8,))
    # And then one device of those: the last one alone, one stage.
    adapt.note_lost(0, "device 0 lost")
    assert adapt.next_world().devices == (2,) and adapt.relayout


def test_losing_every_copy_of_a_stage_restarts_one_replica_from_the_checkpoint(tmp_path):
    adapt, _ = _adapt(tmp_path, pp=2, layers=4, dp=2)
    adapt.note_lost(0, "lost")
    adapt.note_lost(2, "lost")
    world = adapt.next_world()
    assert world.devices == (1, 3) and adapt.relayout
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert (plan.dp, plan.pp, plan.microbatches) == (1, 2, (8,))


def test_a_dp_x_tp_job_dissolves_the_replica_whose_tp_group_lost_a_device(tmp_path):
    """The scheduler would shrink replica 1's TP group to the device left (its shards then
    need resharding); the coordinator dissolves the replica instead and device 2 stands by,
    until no replica is left whole and the standby joins a restart from the checkpoint."""
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    adapt = PipelineAdaptation(make_plan(2, 1, 2, 4, 4), events, lambda _: None)
    adapt.note_lost(3, "lost")
    world = adapt.next_world()
    assert world.devices == (0, 1) and not adapt.relayout
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert (plan.dp, plan.microbatches, plan.replicas[0].stages[0].tp) == (1, (8,), 2)
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "in_place" and "devices [2]" in replan["explain"]
    # Then replica 0 loses a device too: no whole replica left. The standby (device 2) and
    # device 0 run the job at TP 2 again, from the newest checkpoint.
    adapt.note_lost(1, "lost")
    world = adapt.next_world()
    assert world.devices == (0, 2) and adapt.relayout
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert (plan.dp, plan.microbatches, plan.replicas[0].stages[0].tp) == (1, (8,), 2)
    assert "at TP 2 from the newest checkpoint" in _events(tmp_path, "replan")[-1]["explain"]
    # One device left: no TP group of 2; device 0 runs TP 1 computing as TP 2 (the launch
    # plan's bits, `unbroken.engine.emulate`), from the newest checkpoint.
    adapt.note_lost(2, "lost")
    world = adapt.next_world()
    assert world.devices == (0,) and adapt.relayout
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert (plan.dp, plan.microbatches, plan.replicas[0].stages[0].tp) == (1, (8,), 1)
    assert "at TP 1, computing as TP 2" in _events(tmp_path, "replan")[-1]["explain"]
    adapt.note_lost(0, "lost")
    with pytest.raises(NoPlanError, match="every device of the pipeline is lost"):
        adapt.next_world()


def test_a_tp_4_job_below_its_degree_runs_smaller_groups_whose_change_is_replayed(tmp_path):
    """A left fold of four TP positions is not the collective's order: no TP-1 emulation of
    TP 4. Below its degree the job runs the largest TP group its survivors hold, from the
    checkpoint, and marks the change replayed ([Note: replayed plan change]); the scheduler's
    plans keep the new degree's bits from then on, and the launch plan is reached back from
    the checkpoint, replayed again."""
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    adapt = PipelineAdaptation(make_plan(1, 1, 4, 4, 4), events, lambda _: None)
    for d in (1, 2):
        adapt.note_lost(d, "lost")
    world = adapt.next_world()
    assert world.devices == (0, 3) and adapt.relayout and adapt.replay_next
    plan = ParallelPlan.from_dict(adapt.spec_fields()["plan"])
    assert plan.replicas[0].stages[0].tp == 2 and adapt.bits_tp == 2
    replan = _events(tmp_path, "replan")[-1]
    assert replan["replayed"] is True and "bits change" in replan["explain"]
    # One survivor: TP 1 computes as the launch degree (4), not as the TP-2 group: replayed.
    adapt.note_lost(3, "lost")
    world = adapt.next_world()
    assert world.devices == (0,) and adapt.replay_next and adapt.bits_tp == 1
    # Every device back: the launch plan from the checkpoint, its bits again (replayed).
    adapt.note_returned([1, 2, 3], "back")
    world = adapt.next_world()
    assert world.devices == (0, 1, 2, 3) and adapt.relayout and adapt.replay_next
    assert adapt.bits_tp == 4 and _events(tmp_path, "replan")[-1]["replayed"] is True
    # A later world that keeps the bits is not replayed.
    adapt.note_lost(3, "lost")
    adapt.next_world()
    assert adapt.replay_next and adapt.bits_tp == 2
    adapt.note_lost(1, "lost")  # device 2, the standby, joins device 0 in a TP-2 group
    world = adapt.next_world()
    assert world.devices == (0, 2) and not adapt.replay_next and adapt.bits_tp == 2
    assert _events(tmp_path, "replan")[-1]["replayed"] is False


def test_a_dp_x_pp_job_empties_a_replica_too_slow_for_one_microbatch_and_refills_it(tmp_path):
    # [Note: empty replica]: rank 3 (replica 1's last stage) 20x slow: one micro-batch there
    # takes longer than all eight on replica 0. Ours empties replica 1 (its ranks keep their
    # layers and state, and probe: `unbroken.engine.probe`); its return to full speed gives
    # the micro-batches back. Greyhound's policy keeps one micro-batch per replica.
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    adapt = PipelineAdaptation(make_plan(2, 2, 1, 4, 4), events, lambda _: None)
    assert adapt.on_fail_slow(_slow(3, factor=20.0), iter_s=0.2) is True
    assert adapt.plan.microbatches == (8, 0) and adapt.plan.ranks == (0, 1, 2, 3)
    assert adapt.plan.actions[3][-2:] == adapt.plan.actions[2]  # REDUCE_GRAD, OPT_STEP only
    assert adapt.on_recovered(3, 1.03, iter_s=0.2) is True
    assert adapt.plan.microbatches == (4, 4)
    grey = PipelineAdaptation(
        make_plan(2, 2, 1, 4, 4),
        JsonlLog(tmp_path / "grey.jsonl", run="t"),
        lambda _: None,
        adapt=AdaptConfig(enabled=True, policy="greyhound"),
    )
    assert grey.on_fail_slow(_slow(3, factor=20.0)) is True
    assert min(grey.plan.microbatches) == 1


def _tiny_cpu_fit(plan: ParallelPlan) -> PlanFit:
    """A warm-up fit shaped like the tiny CPU model's PP2 x DP2 bench job (stop 42's
    timings): a micro-batch's F + B ~4.5 ms per stage, its two stages alike, and an optimizer
    step of 20 ms on every rank — the step costs as much as four micro-batches' compute."""
    shares = {
        (d, s, kind): share
        for d in range(2)
        for s in range(2)
        for kind, share in (("F", 1 / 6), ("B", 1 / 3))
    }
    schedule = PlanSchedule(plan=plan, shares=shares, opt_step_s=0.02)
    predictor = WorkloadPredictor(mb=MicroBatchModel(alpha=1e-4, beta=0.0), schedule=schedule)
    return PlanFit(predictor=predictor, busy_scale={}, mb_s=0.009, step_s=0.02)


def test_a_measured_step_is_waited_for_at_the_boundary_and_a_replica_empties_past_it(tmp_path):
    # Priced with the job's measured costs (`calibrate`), a slow device steps its stage slowly
    # and every rank of a live job waits for that step at the boundary (`Workload.
    # boundary_sync`, [Note: step lead]): the step ends the iteration whatever the counts, so
    # the micro-batches only even out the compute. At 6x one micro-batch's 27 ms there ends
    # before replica 0's seven ([7, 1]); at 12x it outlasts replica 0's eight ([8, 0]).
    plan = make_plan(2, 2, 1, 4, 4)
    counts = {}
    for factor in (6.0, 12.0):
        events = JsonlLog(tmp_path / f"events{factor:.0f}.jsonl", run="t")
        adapt = PipelineAdaptation(plan, events, lambda _: None)
        adapt.calibrate(_tiny_cpu_fit(plan))
        assert adapt.calibrated
        assert adapt.on_fail_slow(_slow(3, factor=factor)) is True
        counts[factor] = adapt.plan.microbatches
    assert counts == {6.0: (7, 1), 12.0: (8, 0)}
    # The prediction holds the slow step: 12x of a 20 ms step on a ~72 ms compute path.
    replan = [e for e in read_jsonl(tmp_path / "events12.jsonl") if e["kind"] == "replan"][-1]
    assert replan["predicted_after"] > 2.5 * adapt.healthy_s
    costs = [e for e in read_jsonl(tmp_path / "events12.jsonl") if e["kind"] == "replan_costs"]
    (costs,) = costs
    assert costs["layer_forward_s"] == pytest.approx(0.009 / 6 / 2)  # per layer, 2 per stage
    assert costs["backward_ratio"] == pytest.approx(2.0) and costs["step_s"] == 0.02
    # Once: a later fit (a warm-up on the re-planned job, its slow device in it) changes nothing.
    adapt.calibrate(_tiny_cpu_fit(adapt.plan))
    assert (
        len([e for e in read_jsonl(tmp_path / "events12.jsonl") if e["kind"] == "replan_costs"])
        == 1
    )


def _excluding(tmp_path, name="events", **adapt):
    plan = make_plan(2, 2, 1, 4, 4)
    events = JsonlLog(tmp_path / f"{name}.jsonl", run="t")
    said: list[str] = []
    a = PipelineAdaptation(
        plan,
        events,
        said.append,
        adapt=AdaptConfig(enabled=True, readmit_after=20, **adapt),
        moves_layers=True,
    )
    a.calibrate(_tiny_cpu_fit(plan))
    return a, said


def test_a_dp_x_pp_job_takes_a_device_too_slow_for_its_own_step_out_and_readmits_it(tmp_path):
    # [Note: slow device excluded]: 6x, emptied of micro-batches, device 3 still steps its
    # stage 6x slower (the measured 20 ms step: 100 ms more) and rank 1's reduction waits for
    # it; dissolving its replica is predicted a quarter faster than the best plan that keeps it
    # (its replica's layers moved off it alone, and micro-batches). It leaves at a planned stop, the
    # survivors keep their layers (in place), device 2 stands by; after `readmit_after` the
    # launch world comes back on trial, both devices filled from replica 0.
    adapt, said = _excluding(tmp_path)
    assert adapt.on_fail_slow(_slow(3, 6.0), iter_s=0.1) is True
    assert adapt.excluding and adapt.restarts and not adapt.grows
    (ex,) = _events(tmp_path, "device_excluded")
    assert ex["device"] == 3 and ex["readmit_at"] == 5 + 20
    assert ex["predicted_without"] < 0.8 * ex["predicted_with"]
    world = adapt.next_world(0.1)
    assert world.devices == (0, 1) and not world.trial and not adapt.relayout
    assert adapt.plan.microbatches == (8,) and not adapt.restarts
    (replan,) = _events(tmp_path, "replan")
    assert replan["trigger"]["excluded"] and replan["restore"] == "in_place"
    assert replan["predicted_after"] < replan["predicted_before"]
    assert "slow device [3] out" in said[-1] and "in place, no checkpoint" in said[-1]
    assert adapt.readmit_due(24) is False and adapt.readmit_due(25) is True
    assert adapt.grows and adapt.restarts
    world = adapt.next_world(0.1)
    assert world.devices == (0, 1, 2, 3) and world.trial == (3,) and not adapt.relayout
    assert adapt.plan == adapt.launch and adapt.next_world() is None
    # Still slow on trial: out again, waiting twice as long.
    assert adapt.on_fail_slow(_slow(3, 6.0), iter_s=0.1) is True
    assert _events(tmp_path, "device_excluded")[-1]["readmit_at"] == 5 + 40
    assert adapt.replans == 2


def test_a_dp_x_pp_job_keeps_a_moderately_slow_device_and_moves_its_layers(tmp_path):
    # 3x: the device's step is waited for at the boundary ([Note: step lead]); moving layers
    # off it (replica 1's split alone: [0, 3], [3, 4]) shrinks that step to no longer than the
    # healthy ones, which beats dissolving its replica: it stays, its layers move at a planned
    # stop.
    adapt, _ = _excluding(tmp_path)
    assert adapt.on_fail_slow(_slow(3, 3.0), iter_s=0.1) is True
    assert not adapt.excluding and adapt.restarts and _events(tmp_path, "device_excluded") == []
    world = adapt.next_world(0.1)
    assert world.devices == (0, 1, 2, 3) and adapt.reshard == adapt.launch
    assert _layouts(adapt.plan) == [[(0, 2), (2, 4)], [(0, 3), (3, 4)]]


@pytest.mark.parametrize(
    ("adapt_kw", "moves"),
    [({"readmit_after": 0}, True), ({}, False), ({"policy": "greyhound"}, True)],
    ids=["readmit_after=0", "no retained state", "greyhound"],
)
def test_a_dp_x_pp_job_excludes_only_under_ours_with_retained_state(tmp_path, adapt_kw, moves):
    plan = make_plan(2, 2, 1, 4, 4)
    adapt = PipelineAdaptation(
        plan,
        JsonlLog(tmp_path / "events.jsonl", run="t"),
        lambda _: None,
        adapt=AdaptConfig(enabled=True, **{"readmit_after": 20, **adapt_kw}),
        moves_layers=moves and adapt_kw.get("policy", "resihp") == "resihp",
    )
    adapt.calibrate(_tiny_cpu_fit(plan))
    assert adapt.on_fail_slow(_slow(3, 6.0)) is True  # planned around live instead
    assert not adapt.excluding and adapt.plan.ranks == (0, 1, 2, 3)


def test_an_excluded_device_is_not_readmitted_past_max_replans_or_while_another_is_lost(tmp_path):
    adapt, _ = _excluding(tmp_path, max_replans=1)
    assert adapt.on_fail_slow(_slow(3, 6.0)) is True
    adapt.next_world()
    assert adapt.readmit_due(100) is False  # no room to exclude it again
    adapt, _ = _excluding(tmp_path, "lost")
    assert adapt.on_fail_slow(_slow(3, 6.0)) is True
    adapt.next_world()
    adapt.note_lost(1, "device 1 lost")
    assert adapt.readmit_due(100) is True and not adapt.grows  # waits for the lost device


def test_a_device_lost_before_the_exclusion_runs_keeps_the_slow_device_in_the_world(tmp_path):
    # Device 3 (replica 1) is to leave; device 1 (replica 0) is lost before the next
    # generation: no replica is whole without both, so the exclusion is dropped (logged) and
    # replica 0 is dissolved around the lost device, device 3 still in the world.
    adapt, _ = _excluding(tmp_path)
    assert adapt.on_fail_slow(_slow(3, 6.0)) is True
    adapt.note_lost(1, "device 1 lost")
    world = adapt.next_world()
    assert world.devices == (2, 3) and not adapt.relayout and not adapt.excluded
    (skip,) = _events(tmp_path, "replan_skipped")
    assert "device 3 stays" in skip["reason"] and skip["trigger"]["excluded"]
    assert _events(tmp_path, "replan")[-1]["trigger"]["kind"] == "device_lost"


def test_a_slow_stage_of_the_replica_left_is_swapped_for_a_standby_from_the_checkpoint(tmp_path):
    # PP2 x DP2 lost device 1: replica 0 dissolved, device 0 stands by, devices 2 and 3 run
    # the one replica. Device 3 (rank 1 there) 6x slow: no replica to move micro-batches to
    # and no layers to spare (one per stage), so the running plan on the standby instead is
    # the best: at a planned stop, from the newest checkpoint (no other replica holds the
    # stages). Without a standby the answer is the layer move (two layers per stage here).
    adapt, said = _excluding(tmp_path)
    adapt.note_lost(1, "device 1 lost")
    assert adapt.next_world().devices == (2, 3)
    assert adapt.on_fail_slow(_slow(1, 6.0)) is True
    assert adapt.excluding and adapt.restarts
    assert "standby device 0 takes its stage" in said[-1]
    world = adapt.next_world()
    assert world.devices == (0, 2) and adapt.relayout  # every rank loads the checkpoint
    swap = _events(tmp_path, "replan")[-1]
    assert swap["trigger"]["excluded"] and swap["restore"] == "checkpoint"
    assert swap["predicted_after"] < swap["predicted_before"]
    plain, plain_said = _excluding(tmp_path, "plain")
    plain.note_lost(1, "device 1 lost")
    plain.note_lost(0, "device 0 lost")
    plain.next_world()
    assert plain.on_fail_slow(_slow(1, 6.0)) is True and not plain.excluding
    assert plain.restarts and "moves layers" in plain_said[-1]


def _evicting(tmp_path, plan: ParallelPlan) -> PipelineAdaptation:
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    return PipelineAdaptation(
        plan, events, lambda _: None, adapt=AdaptConfig(enabled=True, policy="evict")
    )


def test_a_pipeline_job_under_evict_restarts_on_an_even_pipeline_from_the_checkpoint(tmp_path):
    # Evict-and-restart (Oobleck-like): the slow device leaves the job for good, and the next
    # generation is one even pipeline on the others from the newest checkpoint — retained
    # state and the other replica are not used (ours would keep the survivors in place).
    adapt = _evicting(tmp_path, make_plan(2, 2, 1, 4, 4))
    assert adapt.evicts and adapt.on_fail_slow(_slow(3, 6.0)) is True
    (evicted,) = _events(tmp_path, "device_evicted")
    assert evicted["device"] == 3 and 3 in adapt.lost
    world = adapt.next_world()
    assert adapt.relayout and adapt.plan.dp == 1  # from the checkpoint, one pipeline
    assert 3 not in world.devices and _events(tmp_path, "replan")[-1]["restore"] == "checkpoint"
    assert adapt.readmit_due(10**6) is False and not adapt.grows  # out for the rest of the run


def test_a_lost_device_under_evict_is_a_checkpoint_restart_on_an_even_pipeline(tmp_path):
    # The recovery machine loads the checkpoint for every loss under evict; the plan is the
    # fresh even one and the event says "checkpoint" (it said "in_place" before stop 49).
    adapt = _evicting(tmp_path, make_plan(2, 1, 2, 4, 4))
    adapt.note_lost(1, "lost")
    world = adapt.next_world()
    assert adapt.relayout and world.devices == (0, 2)
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "checkpoint" and "from the newest checkpoint" in replan["explain"]


def _groups(plan: ParallelPlan) -> list[tuple[tuple[int, ...], int]]:
    return [(g.ranks, g.tp) for rep in plan.replicas for g in rep.stages]


def test_a_dp_x_tp_job_shrinks_a_slow_devices_tp_group_and_readmits_it_on_trial(tmp_path):
    # ResiHP §6.1: device 0 of replica 0's TP-2 group at 1/6 speed holds its peer at every
    # layer; k x min p scores TP 1 on device 1 at 1, TP 2 at 1/3. Decided now, adopted at a
    # planned stop with the state moved (RESHARD); device 0 stays in the world as a rank of no
    # stage, and after `readmit_after` the launch plan comes back the same way, on trial.
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    said: list[str] = []
    launch = make_plan(2, 1, 2, 4, 4)
    adapt = PipelineAdaptation(
        launch,
        events,
        said.append,
        adapt=AdaptConfig(enabled=True, readmit_after=20),
        moves_layers=True,
    )
    assert adapt.on_fail_slow(_slow(0, 6.0), iter_s=0.2) is True
    assert adapt.restarts and not adapt.excluding and "moves layers" in said[-1]
    (benched,) = _events(tmp_path, "device_excluded")
    assert benched["device"] == 0 and benched["readmit_at"] == 5 + 20
    world = adapt.next_world()
    assert world.devices == (0, 1, 2, 3) and adapt.reshard == launch and not adapt.relayout
    assert _groups(adapt.plan) == [((1,), 1), ((2, 3), 2)]
    assert adapt.plan.microbatches[0] < adapt.plan.microbatches[1]
    (replan,) = _events(tmp_path, "replan")
    assert replan["restore"] == "reshard" and "exclusion" in replan["explain"]
    adapt.reshard = None  # read by the coordinator
    assert adapt.readmit_due(24) is False and adapt.readmit_due(25) is True
    assert adapt.restarts
    world = adapt.next_world()
    assert world.trial == (0,) and adapt.plan == launch
    assert _events(tmp_path, "replan")[-1]["trigger"]["kind"] == "readmit_trial"
    assert adapt.replans == 1  # the trial is not counted; a device still slow is benched again
    assert adapt.on_fail_slow(_slow(0, 6.0), iter_s=0.2) is True
    assert _events(tmp_path, "device_excluded")[-1]["readmit_at"] == 5 + 40


def test_a_benched_devices_trial_waits_while_the_launch_plan_is_not_faster(tmp_path):
    """At its trial another device runs slow (the launch plan is not predicted faster): the
    benched device stays benched, still marked slow, its next wait doubled — it used to be
    dropped for good (never probed again)."""
    events = JsonlLog(tmp_path / "events.jsonl", run="t")
    adapt = PipelineAdaptation(
        make_plan(2, 1, 2, 4, 4),
        events,
        lambda _: None,
        adapt=AdaptConfig(enabled=True, readmit_after=20),
        moves_layers=True,
    )
    assert adapt.on_fail_slow(_slow(0, 6.0), iter_s=0.2) is True
    adapt.next_world()
    adapt.reshard = None  # read by the coordinator
    adapt.state = adapt.state.with_slow(3, speed=0.5)  # as a report validated since would mark it
    assert adapt.readmit_due(25) is False and not adapt.restarts
    assert adapt.benched[0].readmit_at == 25 + 40 and adapt.state.device(0).speed < 1
    (postponed,) = _events(tmp_path, "readmit_postponed")
    assert postponed["device"] == 0 and postponed["readmit_at"] == 65
    assert adapt.readmit_due(64) is False
    adapt.state = adapt.state.with_healthy(3)
    assert adapt.readmit_due(65) is True and adapt.restarts


def test_a_tp_group_shrinks_live_only_where_the_stage_keeps_the_launch_bits():
    """`emulates`: TP 2 -> 1 (a left fold of two positions is the all-reduce); not TP 4 -> 2
    or 1 (another summation order than the collective's), nor a plan beyond the world."""
    tp2, tp4 = make_plan(2, 1, 2, 4, 4), make_plan(1, 1, 4, 4, 4)
    one = plan_for(
        [Replica((StageGroup((1,), (0, 4)),)), Replica((StageGroup((2, 3), (0, 4)),))],
        (2, 6),
        "1f1b",
    )
    assert emulates(tp2, one, 4) and not emulates(tp2, one, 3)
    assert not emulates(tp4, make_plan(1, 1, 2, 4, 4), 4)
    assert not emulates(tp4, make_plan(1, 1, 1, 4, 4), 4)
