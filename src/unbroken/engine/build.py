"""Assemble one rank's engine from a `JobConfig` and a `ParallelPlan`.

The counterpart of `unbroken.engine.replica.build_training` for a plan: the rank's `StageModel`
on "meta", its `FlatLayout`, the flat state (fresh, or the caller's retained buffers through
`allocate`), initial values cut from the reference model's deterministic init (so every plan
starts from the same full model as the single-process trainer), the data source with one
shard per replica, the plan's groups and the updater.

An own model (`model.factory`) whose factory provides pipeline stages
(`unbroken.engine.own_stages`, e.g. a Hugging Face causal LM) is built the same way from its
stage source: its layer count sizes the plan, its stage model replaces `StageModel`, its full
model's initial values (the data-parallel build's) are cut by name, and its stage's `tied`
names the embedding pair. Pipeline parallelism only: tensor parallelism needs the reference
model's layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from unbroken.config import JobConfig
from unbroken.data import PackedStream, Sampler, corpus_for
from unbroken.engine.groups import PlanGroups
from unbroken.engine.interpreter import PlanWorker
from unbroken.engine.ordered_plan import PlanOrderedGradients, check_ordered_plan
from unbroken.engine.own_stages import factory_layers, factory_stage, full_factory_params
from unbroken.engine.replica import state_geometry
from unbroken.engine.sharding import load_from_full
from unbroken.engine.stage import StageModel
from unbroken.engine.tied import TiedGradReduction
from unbroken.errors import UserError
from unbroken.model import (
    FlatLayout,
    TransformerArgs,
    build_model,
    init_parameters,
    materialize,
    resolve_args,
)
from unbroken.model.flat import bind_grads
from unbroken.model.meta import skip_meta_init
from unbroken.parallel import ParallelPlan, make_plan
from unbroken.train import BatchSource, TrainState
from unbroken.update import ChunkStep, PlainUpdater, StateGeometry

__all__ = [
    "EngineRank",
    "build_worker",
    "emulated_tp",
    "full_initial_params",
    "job_plan",
    "make_source",
    "model_layers",
    "plan_from_config",
    "stage_layers",
    "switch_plan",
]


@dataclass(slots=True)
class EngineRank:
    """What `build_worker` made for one rank."""

    worker: PlanWorker
    model: StageModel | torch.nn.Module
    """The stage model (an own model's stage for `model.factory`)."""
    state: TrainState
    groups: PlanGroups
    geometry: StateGeometry
    """Pages, groups and chunks of this rank's flat state (its own layout's size)."""


_SCHEDULE_NAMES = {"interleaved": "interleaved_1f1b"}
"""Config schedule names that differ from the plan IR's (`unbroken.parallel.SCHEDULES`)."""


def model_layers(cfg: JobConfig, search: Iterable[str] = ()) -> int:
    """The job model's layer count: the reference preset's, or an own model's stage source's.

    Raises:
        UserError: a bad preset, or an own model without pipeline stages.
    """
    if cfg.model.factory:
        return factory_layers(cfg, search)
    return resolve_args(cfg.model).n_layers


def plan_from_config(cfg: JobConfig, search: Iterable[str] = ()) -> ParallelPlan:
    """The job's plan from `parallel.*` (uniform degrees): what every trainer rank runs and
    what the coordinator's fail-slow watch simulates. A pure function of the config (and, for
    an own model, of its factory's stage source, found through `search`)."""
    p = cfg.parallel
    return make_plan(
        dp=p.dp,
        pp=p.pp,
        tp=p.tp,
        num_layers=model_layers(cfg, search),
        microbatches=cfg.data.microbatches,
        schedule=_SCHEDULE_NAMES.get(p.schedule, p.schedule),
        virtual_stages=p.virtual_stages,
    )


def job_plan(cfg: JobConfig, search: Iterable[str] = ()) -> ParallelPlan | None:
    """The plan the job runs: `plan_from_config` when `parallel.tp`/`pp` > 1, else None (the
    data-parallel trainer). The one reading of `parallel.planned` for building and watching a
    job (trainers, the coordinator's fail-slow watch)."""
    return plan_from_config(cfg, search) if cfg.parallel.planned else None


def make_source(cfg: JobConfig, replicas: int) -> Sampler:
    """The reference data source with one shard per replica, as `build_training` builds it."""
    corpus = corpus_for(cfg.data)
    stream = PackedStream(corpus, cfg.data.tokens_per_microbatch, cfg.data.seed)
    return Sampler(stream, replicas, cfg.data.microbatches)


def full_initial_params(cfg: JobConfig, search: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The job model's initial parameters by name, tied names included (as `build_training`
    initializes: the reference init, or an own model's factory under the job's seed)."""
    if cfg.model.factory:
        return full_factory_params(cfg, search)
    args = resolve_args(cfg.model)
    layout = FlatLayout.of(build_model(args, device="meta"), tied=args.tied)
    flat = torch.zeros(layout.numel)
    init_parameters(layout, flat, std=cfg.train.init_std, seed=cfg.train.seed)
    return layout.views(flat)


def _check_fits(cfg: JobConfig, plan: ParallelPlan, search: list[str]) -> TransformerArgs | None:
    """The reference model's arguments (None for an own model), once `plan` is known to fit
    the job.

    Raises:
        UserError: an own model under tensor parallelism or without pipeline stages, or a plan
            with other layers or micro-batch counts.
    """
    args = None
    if cfg.model.factory:
        if any(g.tp > 1 for rep in plan.replicas for g in rep.stages):
            raise UserError(
                "tensor parallelism runs the reference model only (model.factory set); "
                "set parallel.tp = 1"
            )
        layers = factory_layers(cfg, search)
    else:
        args = resolve_args(cfg.model)
        layers = args.n_layers
    if plan.num_layers != layers:
        raise UserError(f"the plan has {plan.num_layers} layers, the model {layers}")
    shards, m = cfg.parallel.dp, cfg.data.microbatches
    # Every replica owns one shard's micro-batches, or (a plan re-planned around a dissolved
    # replica) the plan covers the job's global batch of parallel.dp shards.
    if any(n != m for n in plan.microbatches) and plan.total_microbatches != shards * m:
        raise UserError(
            f"the plan gives replicas {list(plan.microbatches)} micro-batches; data.microbatches "
            f"is {m} per replica and the job's global batch {shards} x {m}"
        )
    if cfg.ordered_reduction:
        try:
            check_ordered_plan(plan)
        except ValueError as exc:
            raise UserError(f'parallel.reduce = "ordered" (or adapt.enabled): {exc}') from None
    return args


def stage_layers(plan: ParallelPlan, rank: int) -> list[tuple[int, int]]:
    """The layer ranges of every virtual stage `rank` holds (none for a standby)."""
    if not plan.actions.get(rank):
        return []
    d, s = plan.locate(rank)
    stages = plan.replicas[d].stages
    return [g.layers for k, g in enumerate(stages) if k % plan.pp == s]


def emulated_tp(cfg: JobConfig) -> int:
    """The TP degree a TP-1 stage computes as (`unbroken.engine.emulate`): the launch plan's
    under the ordered reduction, where a group shrunk to one device must keep its bits; else 1
    (the reference model's arithmetic)."""
    return cfg.parallel.tp if cfg.ordered_reduction and not cfg.model.factory else 1


def _plan_groups(
    plan: ParallelPlan,
    world: dist.ProcessGroup,
    args: TransformerArgs | None,
    model: torch.nn.Module | None,
) -> PlanGroups:
    """The plan's groups (collective): the reference model's from its `args`, an own model's
    with its stage's tied names."""
    if args is not None:
        return PlanGroups.build(plan, world, args)
    tied = getattr(model, "tied", ())
    return PlanGroups.build(plan, world, tied=tuple(tied[0]) if tied else ())


def _stage_and_groups(
    cfg: JobConfig,
    plan: ParallelPlan,
    world: dist.ProcessGroup,
    args: TransformerArgs | None,
    search: list[str],
) -> tuple[torch.nn.Module, PlanGroups, dict[str, torch.Tensor] | None]:
    """This rank's stage model, its groups, and (own models) the stage's initial values by
    name. The reference stage is on "meta" and initialized from `full_initial_params`; an own
    model's is cut from the factory's full model, whose values it still holds."""
    if args is None:
        model = factory_stage(cfg, stage_layers(plan, dist.get_rank(world)), search)
        initial = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
        return model, _plan_groups(plan, world, None, model), initial
    groups = _plan_groups(plan, world, args, None)
    emulate = emulated_tp(cfg) if groups.tp.size == 1 else 1
    try:
        with skip_meta_init():
            layers = stage_layers(plan, groups.rank)
            model = StageModel(args, layers, groups.tp, device="meta", emulate=emulate)
    except ValueError as exc:
        raise UserError(f"plan: {exc}") from None
    return model, groups, None


def _reductions(
    cfg: JobConfig, plan: ParallelPlan, groups: PlanGroups, state: TrainState
) -> tuple[PlanGroups, PlanOrderedGradients | None]:
    """The gradient reduction over `state.grads`: the ordered one (`cfg.ordered_reduction`),
    or the groups' own, with the DP average plus the tied-embedding sum (engine.tied)."""
    if cfg.ordered_reduction:
        views = state.layout.views(state.grads)
        tied = None
        if groups.tie is not None:
            tied = (groups.tie, views[groups.tie_name])
        ordered = PlanOrderedGradients(
            plan, groups, state.grads, cfg.data.microbatches, tied, views=views
        )
        return groups, ordered
    if groups.tie is not None:
        fine = TiedGradReduction(
            state.grads, groups.dp, groups.dp_size, groups.tie, groups.tie_name
        )
        groups = dataclasses.replace(groups, fine=fine)
    return groups, None


def switch_plan(
    cfg: JobConfig,
    rank: EngineRank,
    plan: ParallelPlan,
    world: dist.ProcessGroup,
    search: Iterable[str] = (),
) -> None:
    """Run `plan` from the next iteration on (a live re-plan that moves micro-batches between
    replicas, never layers: each rank keeps its stage and its state). Collective over `world`
    (process groups are created): every rank calls it at the same iteration boundary.

    Raises:
        UserError: the plan does not fit the job.
        ValueError: the plan gives a rank other layers.
    """
    args = _check_fits(cfg, plan, list(search))
    groups = _plan_groups(plan, world, args, rank.model)
    groups, ordered = _reductions(cfg, plan, groups, rank.state)
    rank.worker.set_plan(plan, groups, ordered)
    rank.groups = groups


# Long: a 24-line docstring for its 10 parameters and a 13-line signature; the body is 40 lines.
def build_worker(
    cfg: JobConfig,
    plan: ParallelPlan,
    world: dist.ProcessGroup,
    *,
    device: torch.device,
    allocate=None,
    hooks=(),
    source: BatchSource | None = None,
    autocast_dtype: torch.dtype | None = None,
    make_updater=PlainUpdater,
    search: Iterable[str] = (),
) -> EngineRank:
    """Build this rank's stage model in flat storage, its groups and its `PlanWorker`.

    Collective over the default group (process groups are created); every rank calls it.

    Args:
        cfg: the job: the reference model, or an own model whose factory provides pipeline
            stages (`unbroken.engine.own_stages`).
        plan: the plan every rank derived.
        world: the group whose ranks are the plan's ranks.
        device: where to compute.
        allocate: `(layout, geometry, device) -> (TrainState, fresh)` for retained buffers;
            default fresh tensors. Nothing is initialized when the buffers are not fresh.
        hooks: phase hooks for the worker.
        source: the micro-batch source (one shard per replica); default: `make_source`.
        autocast_dtype: bf16 for GPU runs (as the trainer), None for fp32.
        make_updater: `(state, geometry, step) -> updater`; default `PlainUpdater`. In-place
            recovery passes a factory of `ResumableUpdater` over its retained tensors, as
            `unbroken.launch.trainer` does for the single-stage trainer.
        search: directories for an own model's factory module.

    Raises:
        UserError: an own model without pipeline stages, or a plan that does not fit the model.
    """
    search = list(search)
    args = _check_fits(cfg, plan, search)
    model, groups, initial = _stage_and_groups(cfg, plan, world, args, search)
    layout = FlatLayout.of(model, no_decay=cfg.train.no_decay, tied=model.tied)
    geometry = state_geometry(cfg, max(layout.numel, 1), torch.device(device).type == "cuda")
    if allocate is None:
        state, fresh = TrainState.allocate(layout, device, geometry.padded_numel), True
    else:
        state, fresh = allocate(layout, geometry, device)
    if fresh:
        full = initial if initial is not None else full_initial_params(cfg)
        load_from_full(full, layout, state.params, groups.tp.size, groups.tp.rank)
    if initial is not None:
        model.to(device)  # its buffers (rotary frequencies); the parameters are replaced next
    materialize(model, layout, state.params)
    bind_grads(model, layout, state.grads)
    groups, ordered = _reductions(cfg, plan, groups, state)
    if source is None:  # logical shards: the launch plan's replicas, whatever runs them now
        source = make_source(cfg, plan.total_microbatches // cfg.data.microbatches)
    if cfg.train.optimizer == "muon" and groups.tp.size > 1:
        raise UserError(
            "train.optimizer = 'muon' orthogonalizes whole weight matrices, which tensor "
            "parallelism shards: set parallel.tp = 1 or pick another optimizer"
        )
    step = ChunkStep.for_job(geometry, cfg.train, layout)
    worker = PlanWorker(
        plan=plan,
        model=model,
        state=state,
        source=source,
        cfg=cfg.train,
        groups=groups,
        updater=make_updater(state, geometry, step),
        device=device,
        hooks=hooks,
        autocast_dtype=autocast_dtype,
        ordered=ordered,
        shard_microbatches=cfg.data.microbatches,
        probe_every=cfg.adapt.probe_every,
        norm_tp=emulated_tp(cfg),
    )
    return EngineRank(worker=worker, model=model, state=state, groups=groups, geometry=geometry)
