"""Pipeline stages of an own model: the protocol a model factory implements so the plan engine
can split its model, and the engine's reading of a job's factory through it.

A factory (`model.factory = "module:function"`) offers pipeline stages by carrying a `pipeline`
attribute, a `StageSource` (`unbroken.integrations.hf.HFPipeline` is the Hugging Face one):

- `num_layers(**factory_kwargs) -> int`: the model's layer count from the factory's own
  arguments, without building it; every process cuts the plan from it (the trainers, the
  coordinator's fail-slow watch, the pre-launch checks).
- `stage(model, layer_ranges) -> nn.Module`: the part of a full model (as the factory built it)
  one rank runs, taking its modules from `model`, with the interface
  `unbroken.engine.interpreter.PlanWorker` drives: `forward(layers, x, inputs)` (x None on the
  stage holding layer 0; the mean loss from the stage holding the last layer), `args.dim`,
  `args.n_layers`, `wgrad` (a `WeightGradSink`), `layer_ranges`, and `tied`: groups of the full
  model's names that are one parameter, the first stage's name first (`FlatLayout.of`'s
  `tied`; at most one group, the embedding and the head). Parameter names are the full model's.

What the engine settles itself, the same for every factory: the full model is built by the
factory under `train.seed` exactly as data-parallel training builds it
(`unbroken.engine.replica.user_model`), so a pipeline run and a data-parallel run of one config
start from the same weights, and a stage's initial values are the full model's by name
(`full_factory_params`). Tensor parallelism is not offered to own models.

The engine never imports a factory's package: it reaches it through `import_object` on the
config's path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from unbroken.config import JobConfig
from unbroken.engine.replica import factory_kwargs, import_object, user_model
from unbroken.errors import UserError

__all__ = [
    "StageSource",
    "factory_layers",
    "factory_stage",
    "full_factory_params",
    "stage_source",
]


@runtime_checkable
class StageSource(Protocol):
    """What a model factory's `pipeline` attribute provides (see the module docstring)."""

    def num_layers(self, **factory_kwargs: Any) -> int:
        """The model's layer count from the factory's keyword arguments."""
        ...

    def stage(self, model: nn.Module, layer_ranges: Sequence[tuple[int, int]]) -> nn.Module:
        """The part of the full `model` that runs `layer_ranges`."""
        ...


def stage_source(cfg: JobConfig, search: Iterable[str] = ()) -> tuple[Any, StageSource]:
    """The job's factory and its stage source.

    Raises:
        UserError: the factory cannot be imported or has no `pipeline` stage source.
    """
    factory = import_object(cfg.model.factory, "model.factory", search)
    source = getattr(factory, "pipeline", None)
    if not isinstance(source, StageSource):
        raise UserError(
            f"model.factory {cfg.model.factory!r} provides no pipeline stages (a `pipeline` "
            "attribute, docs/own-model.md); set parallel.pp = 1 to train it data-parallel"
        )
    return factory, source


def factory_layers(cfg: JobConfig, search: Iterable[str] = ()) -> int:
    """The own model's layer count, from its stage source (no model is built).

    Raises:
        UserError: no stage source, or the source refuses the model (it does not split).
    """
    factory, source = stage_source(cfg, search)
    try:
        return int(source.num_layers(**factory_kwargs(cfg, factory)))
    except ValueError as exc:
        raise UserError(f"model.factory {cfg.model.factory!r}: {exc}") from None


def factory_stage(
    cfg: JobConfig, layer_ranges: Sequence[tuple[int, int]], search: Iterable[str] = ()
) -> nn.Module:
    """The stage model of `layer_ranges` (none for a standby), cut from the full model the
    factory builds under the job's seed; its parameters still hold their initial values.

    Raises:
        UserError: no stage source, or the source refuses the ranges.
    """
    search = list(search)
    _, source = stage_source(cfg, search)
    try:
        return source.stage(user_model(cfg, search), list(layer_ranges))
    except ValueError as exc:
        raise UserError(f"plan: {exc}") from None


def full_factory_params(cfg: JobConfig, search: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """The own model's initial parameters by name, every name of a shared parameter included
    (as data-parallel training initializes them: `unbroken.engine.replica.user_model`)."""
    model = user_model(cfg, search)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
