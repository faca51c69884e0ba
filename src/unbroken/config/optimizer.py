"""The `optimizer=` argument of `unbroken.run_job`: what it accepts today and how it becomes the
job's `TrainConfig`.

The resumable updater runs one optimizer today: AdamW (`unbroken.train.optim.AdamW`, the
arithmetic of `torch.optim.AdamW` term by term, over chunk ranges of the flat state). So
`optimizer=` accepts AdamW settings only, in any of these spellings:

    optimizer="adamw"                                   # the config's settings
    optimizer={"name": "adamw", "lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
    optimizer=functools.partial(torch.optim.AdamW, lr=3e-4, betas=(0.9, 0.95))
    optimizer=torch.optim.AdamW                          # the config's settings

The settings named override `train.lr` (the peak of the schedule: warm-up and cosine stay the
config's), `train.beta1`/`beta2`, `train.eps`, `train.weight_decay` (applied to matrices, not
norm weights) and, in the dict form only, `train.grad_clip`. Anything else — another optimizer,
or a torch AdamW option that changes the arithmetic (`amsgrad`, `maximize`) — is refused with
one line, until more optimizers exist under the resumable updater.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

from unbroken.config.job import TrainConfig
from unbroken.errors import UserError

__all__ = ["OPTIMIZER_KEYS", "apply_optimizer"]

OPTIMIZER_KEYS = ("lr", "betas", "beta1", "beta2", "eps", "weight_decay", "grad_clip")
"""Settings `optimizer=` may name (AdamW's)."""

_ONLY = (
    "only AdamW runs under the resumable updater today (its settings: lr, betas, eps, "
    "weight_decay, grad_clip); other optimizers are not built yet"
)
_TORCH_NEUTRAL = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}
"""torch.optim.AdamW options that change how torch computes, not what: accepted at these values."""


def _is_torch_adamw(obj: Any) -> bool:
    return (
        isinstance(obj, type)
        and obj.__name__ == "AdamW"
        and obj.__module__.startswith("torch.optim")
    )


def _settings(optimizer: Any) -> dict[str, Any]:
    """The named settings of any accepted spelling."""
    if isinstance(optimizer, str):
        if optimizer.lower() != "adamw":
            raise UserError(f"optimizer={optimizer!r}: {_ONLY}")
        return {}
    if isinstance(optimizer, Mapping):
        settings = dict(optimizer)
        name = str(settings.pop("name", "adamw"))
        if name.lower() != "adamw":
            raise UserError(f"optimizer name {name!r}: {_ONLY}")
        return settings
    if _is_torch_adamw(optimizer):
        return {}
    if isinstance(optimizer, partial) and _is_torch_adamw(optimizer.func):
        if optimizer.args:
            raise UserError(
                "optimizer=partial(torch.optim.AdamW, ...): pass settings by keyword (the "
                "parameters are unbroken's flat state)"
            )
        settings = dict(optimizer.keywords)
        for key, neutral in _TORCH_NEUTRAL.items():
            if key in settings and settings[key] in (neutral, False, None):
                settings.pop(key)
        if settings.pop("amsgrad", False) or settings.pop("maximize", False):
            raise UserError("optimizer: amsgrad and maximize are not supported; " + _ONLY)
        if "grad_clip" in settings:
            raise UserError("optimizer: torch's AdamW has no grad_clip; set train.grad_clip")
        return settings
    name = getattr(optimizer, "__name__", type(optimizer).__name__)
    raise UserError(f"optimizer={name}: {_ONLY}")


def apply_optimizer(train: TrainConfig, optimizer: Any) -> TrainConfig:
    """`train` with the AdamW settings `optimizer` names (None: unchanged).

    Raises:
        UserError: not AdamW, an unknown setting, or a value out of range; one line.
    """
    if optimizer is None:
        return train
    settings = _settings(optimizer)
    unknown = sorted(set(settings) - set(OPTIMIZER_KEYS))
    if unknown:
        raise UserError(
            f"optimizer: unknown AdamW setting(s) {unknown}; use {', '.join(OPTIMIZER_KEYS)}"
        )
    changes: dict[str, float] = {}
    if "betas" in settings:
        betas = settings.pop("betas")
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise UserError(f"optimizer: betas must be two numbers, got {betas!r}")
        settings["beta1"], settings["beta2"] = betas
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"optimizer: {key} must be a number, got {value!r}")
        changes[key] = float(value)
    for beta in ("beta1", "beta2"):
        if beta in changes and not 0.0 <= changes[beta] < 1.0:
            raise UserError(f"optimizer: {beta} must be in [0, 1), got {changes[beta]}")
    if changes.get("eps", 1.0) <= 0 or changes.get("weight_decay", 0.0) < 0:
        raise UserError("optimizer: eps must be > 0 and weight_decay >= 0")
    if changes.get("grad_clip", 0.0) < 0:
        raise UserError("optimizer: grad_clip must be >= 0 (0 disables clipping)")
    try:
        return dataclasses.replace(train, **changes)
    except ValueError as exc:
        raise UserError(f"optimizer: {exc}") from None
