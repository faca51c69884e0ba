"""Assemble one data-parallel replica from a `JobConfig`: model, flat state, data source, loss
and the update's chunk step — the data-parallel counterpart of `unbroken.engine.build` (one
rank of a plan). It composes model, data, train and update, so it lives here, above them.

The reference model is built on the meta device and initialized into flat storage
(`init_parameters`). A user model (`model.factory = "module:function"`) is built by the user's
factory under a fixed seed, then its initial values are copied into flat storage, so the user
keeps their init and the run stays deterministic. See docs/own-model.md.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unbroken.config import JobConfig
from unbroken.config.presets import BYTE_VOCAB
from unbroken.data import PackedStream, Sampler, corpus_for
from unbroken.errors import UserError
from unbroken.model import FlatLayout, build_model, init_parameters, materialize, resolve_args
from unbroken.model.flat import bind_grads
from unbroken.train.loop import BatchSource, LossFn, reference_loss
from unbroken.train.state import TrainState
from unbroken.update import ChunkStep, StateGeometry

__all__ = [
    "Built",
    "build_training",
    "factory_kwargs",
    "import_object",
    "state_geometry",
    "user_loss",
    "user_model",
]


@dataclass(slots=True)
class Built:
    model: nn.Module
    state: TrainState
    source: BatchSource
    loss_fn: LossFn
    geometry: StateGeometry
    step: ChunkStep


def state_geometry(cfg: JobConfig, numel: int, cuda: bool = False) -> StateGeometry:
    """The state's page/group/chunk geometry; unset protection sizes take the defaults of the
    device (`cuda`: the trainers compute on a GPU). Jobs started through `unbroken.api` carry
    sizes resolved there already, so every process of a job cuts the state alike."""
    p = cfg.protection.resolved(cuda)
    return StateGeometry(
        numel=numel,
        page_bytes=p.page_bytes,
        stripe_pages=p.stripe_pages,
        chunk_bytes=p.chunk_bytes,
    )


def import_object(path: str, what: str, search: Iterable[str] = ()) -> Any:
    """Import "module:attr", trying `search` dirs first.

    Raises:
        UserError: the module or attribute does not exist.
    """
    for d in search:
        if d and d not in sys.path:
            sys.path.insert(0, d)
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{what} {path!r}: cannot import module {module_name!r} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from None


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def user_loss(model: nn.Module, mb: Any, device: torch.device) -> torch.Tensor:
    """Loss of a user model: its forward takes the micro-batch and returns the mean loss."""
    return model(_to_device(mb, device))


def _takes(factory: Any, name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def factory_kwargs(cfg: JobConfig, factory: Any) -> dict[str, Any]:
    """The keyword arguments of the user's model factory: `model.factory_args`, plus the job's
    vocabulary as `vocab_size` when the factory has a parameter of that name and the args do
    not set it (`model.vocab_size`, else the tokenizer's: `data.vocab_size`, or 256 bytes)."""
    args = dict(cfg.model.factory_args)
    if "vocab_size" not in args and _takes(factory, "vocab_size"):
        args["vocab_size"] = cfg.model.vocab_size or cfg.data.vocab_size or BYTE_VOCAB
    return args


def user_model(cfg: JobConfig, search: Iterable[str] = ()) -> nn.Module:
    """The user's full model, built by their factory under the job's seed (their init kept):
    the same weights in every process, for data-parallel and pipeline-parallel builds alike.

    Raises:
        UserError: the factory cannot be imported or returns no `torch.nn.Module`.
    """
    factory = import_object(cfg.model.factory, "model.factory", search)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        model = factory(**factory_kwargs(cfg, factory))
    if not isinstance(model, nn.Module):
        raise UserError(f"model.factory {cfg.model.factory!r} must return a torch.nn.Module")
    return model


def _user_model(cfg: JobConfig, search: list[str], make_state):
    """The user's model (`user_model`) with its layout and state:
    (model, layout, (state, fresh, geometry))."""
    model = user_model(cfg, search)
    layout = FlatLayout.of(model, no_decay=cfg.train.no_decay)
    return model, layout, make_state(layout)


def _source(cfg: JobConfig, n_shards: int, search: list[str]) -> BatchSource:
    """The job's micro-batch source with `n_shards` data shards (the user's dataset, or the
    packed corpus)."""
    if cfg.data.dataset:
        cls = import_object(cfg.data.dataset, "data.dataset", search)
        return cls(cfg.data, n_shards)
    corpus = corpus_for(cfg.data)
    try:
        stream = PackedStream(corpus, cfg.data.tokens_per_microbatch, cfg.data.seed)
    except ValueError as exc:
        raise UserError(f"data: {exc}") from None
    return Sampler(stream, n_shards, cfg.data.microbatches)


def build_training(
    cfg: JobConfig,
    *,
    n_shards: int,
    device: torch.device,
    search: Iterable[str] = (),
    allocate=None,
) -> Built:
    """Build the model in flat storage, the state buffers and the data source.

    Args:
        allocate: `(layout, geometry, device) -> (TrainState, fresh)` providing the buffers
            (the state manager's retained memory); default: fresh local tensors. When the
            buffers are not fresh (a replacement trainer reattaching), nothing is initialized.
    """
    search = list(search)

    def make_state(layout: FlatLayout) -> tuple[TrainState, bool, StateGeometry]:
        geometry = state_geometry(cfg, layout.numel, torch.device(device).type == "cuda")
        if allocate is None:
            return TrainState.allocate(layout, device, geometry.padded_numel), True, geometry
        state, fresh = allocate(layout, geometry, device)
        return state, fresh, geometry

    if cfg.model.factory:
        model, layout, (state, fresh, geometry) = _user_model(cfg, search, make_state)
        if fresh:
            views = layout.views(state.params)
            with torch.no_grad():
                for name, p in model.named_parameters():  # one name per shared parameter
                    views[name].copy_(p.detach())
        model.to(device)
        loss_fn: LossFn = user_loss
    else:
        args = resolve_args(cfg.model)
        model = build_model(args, device="meta")
        layout = FlatLayout.of(model, no_decay=cfg.train.no_decay, tied=args.tied)
        state, fresh, geometry = make_state(layout)
        if fresh:
            init_parameters(layout, state.params, std=cfg.train.init_std, seed=cfg.train.seed)
        loss_fn = reference_loss
    materialize(model, layout, state.params)
    bind_grads(model, layout, state.grads)
    source = _source(cfg, n_shards, search)
    step = ChunkStep.for_job(geometry, cfg.train, layout)
    return Built(
        model=model, state=state, source=source, loss_fn=loss_fn, geometry=geometry, step=step
    )
