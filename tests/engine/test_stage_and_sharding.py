"""Single-process pieces of the engine: the stage model, sharding by name, plan checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.engine.harness import ENGINE_MODEL, engine_job, one_thread
from unbroken.config import ParallelConfig
from unbroken.engine import StageModel, TPGroup, shard_of, split_dim, unshard
from unbroken.engine.build import build_worker, plan_from_config
from unbroken.engine.dp_sync import holders
from unbroken.engine.groups import PlanGroups, same_layouts
from unbroken.engine.transfer import _tag
from unbroken.errors import UserError
from unbroken.model import build_model, resolve_args
from unbroken.parallel import Replica, StageGroup, make_plan, plan_for

ARGS = resolve_args(ENGINE_MODEL)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shards_have_the_reference_names_and_cover_each_tensor_once(tp):
    ref = dict(build_model(ARGS, "meta").named_parameters())
    full = {n: torch.randn(p.shape) for n, p in ref.items()}
    per_position = []
    for r in range(tp):
        stage = StageModel(ARGS, [(0, 2), (2, 4)], TPGroup(tp, r))
        shapes = {n: tuple(p.shape) for n, p in stage.named_parameters()}
        assert shapes.keys() == ref.keys()
        for n, shape in shapes.items():
            assert shape == tuple(shard_of(full[n], n, tp, r).shape)
        per_position.append({n: shard_of(full[n], n, tp, r) for n in shapes})
    for n in full:
        assert torch.equal(unshard(n, [p[n] for p in per_position]), full[n])


def test_split_dims_follow_megatron():
    assert split_dim("embed.weight") == 0 and split_dim("head.weight") == 0
    assert split_dim("layers.3.attn.wk.weight") == 0 and split_dim("layers.0.ffn.w3.weight") == 0
    assert split_dim("layers.1.attn.wo.weight") == 1 and split_dim("layers.2.ffn.w2.weight") == 1
    assert split_dim("layers.1.attn_norm.weight") is None and split_dim("norm.weight") is None


def test_a_partial_stage_holds_only_its_layers():
    first = StageModel(ARGS, [(0, 1)], TPGroup())
    last = StageModel(ARGS, [(3, 4)], TPGroup())
    assert {n.split(".")[0] for n, _ in first.named_parameters()} == {"embed", "layers"}
    assert {n.split(".")[0] for n, _ in last.named_parameters()} == {"layers", "norm", "head"}
    assert sorted(last.layers) == ["3"]


def test_tp_degree_must_divide_heads_and_kv_groups():
    with pytest.raises(ValueError, match="n_heads=16 is not divisible by the TP degree 32"):
        StageModel(ARGS, [(0, 4)], TPGroup(32, 0))
    gqa = resolve_args(ENGINE_MODEL.__class__(preset="tiny"))  # 4 heads, 2 kv-groups
    with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by the TP degree 4"):
        StageModel(gqa, [(0, 2)], TPGroup(4, 0))


def test_tags_pair_each_send_with_its_receive():
    plan = make_plan(1, 3, [2, 1, 4], 4, 3, "1f1b")
    sends, recvs = {}, {}
    for rank, acts in plan.actions.items():
        for a in acts:
            if a.is_comm:
                key = (rank, a.peer) if a.is_send else (a.peer, rank)
                book = sends if a.is_send else recvs
                tag = _tag(a, plan.num_stages, plan.total_microbatches)
                assert (key, tag) not in book, f"{a}: tag not unique on its link"
                book[(key, tag)] = a
    assert sends.keys() == recvs.keys()
    for k, a in sends.items():
        assert (a.microbatch, a.chunk, a.num_chunks) == (
            recvs[k].microbatch,
            recvs[k].chunk,
            recvs[k].num_chunks,
        )


def test_fine_pieces_of_replicas_with_different_tp_degrees():
    g = StageGroup
    plan = plan_for([Replica((g((0, 1), (0, 4)),)), Replica((g((2,), (0, 4)),))], [2, 2], "1f1b")
    pieces = holders(plan, ARGS)
    assert sorted(pieces) == [(0, 2), (1, 2)]
    wq = [p for p in pieces[(1, 2)][2] if p.name == "layers.0.attn.wq.weight"]
    assert [(p.dim, p.start, p.length) for p in wq] == [(0, 32, 32)]  # second half of 64 rows
    wo = [p for p in pieces[(1, 2)][1] if p.name == "layers.0.attn.wo.weight"]
    assert [(p.dim, p.start, p.length) for p in wo] == [(1, 0, 32)]  # all of r1's half
    norms = [p.name for p in pieces[(0, 2)][0] if p.dim is None]
    assert "norm.weight" in norms and not [p for p in pieces[(1, 2)][1] if p.dim is None]


def test_different_layouts_need_the_model_to_sync():
    g = StageGroup
    plan = plan_for([Replica((g((0, 1), (0, 4)),)), Replica((g((2,), (0, 4)),))], [2, 2], "1f1b")
    assert not same_layouts(plan)
    with pytest.raises(ValueError, match="need the model args"):
        PlanGroups.build(plan, None)


def test_plan_micro_batches_must_match_the_data_config():
    with pytest.raises(UserError, match=r"the plan gives replicas \[3\] micro-batches"):
        build_worker(engine_job(), make_plan(1, 2, 1, 4, 3, "1f1b"), None, device="cpu")


def test_the_config_plan_is_what_trainers_and_the_watch_build():
    # parallel.schedule = "interleaved" is the plan IR's "interleaved_1f1b".
    cfg = dataclasses.replace(
        engine_job(),
        parallel=ParallelConfig(world_size=2, pp=2, schedule="interleaved", virtual_stages=2),
    )
    plan = plan_from_config(cfg)
    assert plan == make_plan(1, 2, 1, 4, 4, "interleaved_1f1b", virtual_stages=2)


def test_single_device_bench_runs_both_loops_on_the_cpu():
    """The `bench engine --device cuda` code path, on the CPU with gloo (a smoke test: it
    asserts the two loops ran and were timed, never their speed)."""
    from unbroken.bench.engine_gpu import run_gpu

    with one_thread():
        r = run_gpu("tiny", 32, 2, warmup=1, block=1, rounds=2, device=torch.device("cpu"))
    assert r["plan"] == "tp=1 pp=1 dp=1 (cpu)"
    assert r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0


def test_reshard_routes_cover_every_element_once_and_avoid_dead_ranks():
    from unbroken.engine.reshard import routes

    old = make_plan(2, 1, [[2], [1]], 4, 2)  # replica 0 on ranks 0, 1 (TP 2); replica 1 on 2
    new = make_plan(1, 2, [1, 4], 4, 2)  # ranks 0 | 1, 2, 3, 4
    table = routes(old, new, ARGS, alive=[0, 1])
    assert {r.src for r in table} <= {0, 1}
    wq = [r for r in table if r.name == "layers.3.attn.wq.weight"]
    assert [(r.src, r.dst, r.src_start, r.dst_start) for r in wq] == [
        (0, 1, 0, 0),
        (0, 2, 16, 0),
        (1, 3, 0, 0),
        (1, 4, 16, 0),
    ]
    assert routes(old, new, ARGS, alive=[2])[0].src == 2  # replica 1 serves everything
    with pytest.raises(ValueError, match="every replica of the old plan lost a holder"):
        routes(old, new, ARGS, alive=[1])


def _loss_and_grads(emulate: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from unbroken.engine import MicroBatchInputs

    stage = StageModel(ARGS, [(0, 4)], TPGroup(), device="cpu", emulate=emulate)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in stage.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    tokens = torch.randint(0, ARGS.vocab_size, (33,), generator=gen)
    t = 32
    inputs = MicroBatchInputs(
        tokens[:t], tokens[1:], torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril()
    )
    with one_thread():
        loss = stage((0, 4), None, inputs)
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in stage.named_parameters()}


def test_a_tp_1_stage_computing_as_tp_2_takes_other_arithmetic_to_the_same_values():
    """The control for `tests/engine/test_ordered_plans.py` "tp-excluded": emulating the TP-2
    group changes the bits of a TP-1 stage (so matching the TP-2 launch plan bit for bit there
    is the emulation's doing), and only by rounding."""
    ref_loss, ref = _loss_and_grads(1)
    loss, got = _loss_and_grads(2)
    assert ref.keys() == got.keys()
    assert not (torch.equal(loss, ref_loss) and all(torch.equal(ref[n], got[n]) for n in ref))
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for n in ref:
        assert torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-6), n


def test_only_a_tp_1_stage_computes_as_a_wider_group():
    with pytest.raises(ValueError, match="a TP-2 stage cannot compute as TP 4"):
        StageModel(ARGS, [(0, 4)], TPGroup(2, 0), emulate=4)
