"""The `optimizer=` argument of `unbroken.run_job`: what it accepts and how it becomes the job's
`TrainConfig`.

The resumable updater runs the rules of `train.optimizer` (docs/optimizers.md): AdamW, SGD with
momentum, Lion and Muon. `optimizer=` names one of them and its settings, in any of these
spellings:

    optimizer="sgd"                                     # that rule, the config's settings
    optimizer={"name": "lion", "lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 1.0}
    optimizer=functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)
    optimizer=torch.optim.AdamW                         # AdamW, the config's settings

torch's own classes are accepted where the updater runs the same arithmetic: `torch.optim.AdamW`,
`torch.optim.SGD` and `torch.optim.Muon` (Lion has no torch class: name it). The settings named
override the config's: `lr` is the peak of the schedule (warm-up and cosine stay the config's),
`weight_decay` and, in the dict form only, `grad_clip`, plus each rule's own (`SETTINGS` maps
them onto `TrainConfig` fields); a setting not named keeps the config's value, also under a torch
class (torch's own defaults are not applied). A setting the rule does not have, or a torch
option that changes the arithmetic (`amsgrad`, `maximize`, Muon's `ns_coefficients` or `eps`
other than torch's defaults), is refused with one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

from unbroken.config.job import TrainConfig
from unbroken.errors import UserError

__all__ = ["OPTIMIZER_KEYS", "SETTINGS", "apply_optimizer"]

_COMMON = {"lr": "lr", "weight_decay": "weight_decay", "grad_clip": "grad_clip"}
SETTINGS: dict[str, dict[str, str]] = {
    "adamw": {**_COMMON, "beta1": "beta1", "beta2": "beta2", "eps": "eps"},
    "sgd": {**_COMMON, "momentum": "momentum", "dampening": "dampening", "nesterov": "nesterov"},
    "lion": {**_COMMON, "beta1": "lion_beta1", "beta2": "lion_beta2"},
    "muon": {
        **_COMMON,
        "momentum": "muon_momentum",
        "nesterov": "muon_nesterov",
        "ns_steps": "muon_ns_steps",
        "adjust_lr_fn": "muon_adjust_lr",
        "beta1": "beta1",  # of the AdamW that runs the non-matrix parameters
        "beta2": "beta2",
    },
}
"""Per rule: setting name in `optimizer=` -> `TrainConfig` field (`betas` is beta1, beta2)."""

OPTIMIZER_KEYS = (*SETTINGS["adamw"], "betas")
"""AdamW's settings (the default rule)."""

_TORCH = {"AdamW": "adamw", "SGD": "sgd", "Muon": "muon"}
"""torch.optim classes whose arithmetic a rule of the updater runs."""
_TORCH_NEUTRAL = {
    "foreach": (None, False),
    "fused": (None, False),
    "capturable": (False,),
    "differentiable": (False,),
    "amsgrad": (False,),
    "maximize": (False,),
    "ns_coefficients": ((3.4445, -4.775, 2.0315),),
    "eps@muon": (1e-7,),
}
"""torch options that change how torch computes, not what (or that the updater runs only at
torch's default): accepted at these values, refused otherwise."""


def _torch_rule(obj: Any) -> str | None:
    if isinstance(obj, type) and obj.__module__.startswith("torch.optim"):
        return _TORCH.get(obj.__name__)
    return None


def _from_torch(optimizer: partial, rule: str) -> dict[str, Any]:
    if optimizer.args:
        raise UserError(
            f"optimizer=partial(torch.optim.{optimizer.func.__name__}, ...): pass settings by "
            "keyword (the parameters are unbroken's flat state)"
        )
    settings = dict(optimizer.keywords)
    for key in list(settings):
        neutral = _TORCH_NEUTRAL.get(f"{key}@{rule}", _TORCH_NEUTRAL.get(key))
        if neutral is None:
            continue
        if settings[key] not in neutral:
            raise UserError(
                f"optimizer: {key}={settings[key]!r} is not supported by the resumable updater's "
                f"{rule} (accepted: {neutral[0]!r})"
            )
        settings.pop(key)
    if "grad_clip" in settings:
        raise UserError("optimizer: torch's optimizers have no grad_clip; set train.grad_clip")
    if rule == "muon" and "adjust_lr_fn" in settings:  # torch reads None as "original"
        settings["adjust_lr_fn"] = settings["adjust_lr_fn"] or "original"
    return settings


def _named(name: Any) -> str:
    rule = str(name).lower()
    if rule not in SETTINGS:
        raise UserError(
            f"optimizer {name!r}: use one of {', '.join(SETTINGS)} (docs/optimizers.md)"
        )
    return rule


def _rule_and_settings(optimizer: Any) -> tuple[str, dict[str, Any]]:
    """(rule, named settings) of any accepted spelling."""
    if isinstance(optimizer, str):
        return _named(optimizer), {}
    if isinstance(optimizer, Mapping):
        settings = dict(optimizer)
        return _named(settings.pop("name", "adamw")), settings
    rule = _torch_rule(optimizer)
    if rule is not None:
        return rule, {}
    if isinstance(optimizer, partial):
        rule = _torch_rule(optimizer.func)
        if rule is not None:
            return rule, _from_torch(optimizer, rule)
    name = getattr(optimizer, "__name__", type(optimizer).__name__)
    raise UserError(
        f"optimizer={name}: the resumable updater runs {', '.join(SETTINGS)} "
        "(a name, a dict with 'name', or torch.optim.AdamW / SGD / Muon)"
    )


def _value(key: str, value: Any) -> Any:
    if key == "nesterov":
        if not isinstance(value, bool):
            raise UserError(f"optimizer: {key} must be true or false, got {value!r}")
        return value
    if key == "adjust_lr_fn":
        return value
    if key == "ns_steps":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"optimizer: {key} must be an integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UserError(f"optimizer: {key} must be a number, got {value!r}")
    return float(value)


def apply_optimizer(train: TrainConfig, optimizer: Any) -> TrainConfig:
    """`train` running the rule `optimizer` names, with its settings (None: unchanged).

    Raises:
        UserError: a rule the updater does not run, a setting the rule does not have, or a value
            out of range; one line.
    """
    if optimizer is None:
        return train
    rule, settings = _rule_and_settings(optimizer)
    if "betas" in settings:
        betas = settings.pop("betas")
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise UserError(f"optimizer: betas must be two numbers, got {betas!r}")
        settings["beta1"], settings["beta2"] = betas
    fields = SETTINGS[rule]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        known = ", ".join(fields) + (", betas" if "beta1" in fields else "")
        raise UserError(f"optimizer: unknown {rule} setting(s) {unknown}; use {known}")
    changes: dict[str, Any] = {"optimizer": rule}
    for key, value in settings.items():
        changes[fields[key]] = _value(key, value)
    try:
        return dataclasses.replace(train, **changes)
    except ValueError as exc:
        raise UserError(f"optimizer: {exc}") from None
