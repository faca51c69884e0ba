"""`train.optimizer` → its `ChunkRule`: the one place that maps a config onto a rule (adding an
optimizer: docs/optimizers.md)."""

from __future__ import annotations

from unbroken.config import TrainConfig
from unbroken.model.flat import FlatLayout
from unbroken.train.optim import AdamW
from unbroken.update.adamw import AdamWRule
from unbroken.update.elementwise import LionRule, SGDRule
from unbroken.update.geometry import StateGeometry
from unbroken.update.muon import MuonRule, muon_matrices
from unbroken.update.rule import MAX_SLOTS, ChunkRule

__all__ = ["OPTIMIZERS", "rule_for"]

OPTIMIZERS = ("adamw", "sgd", "lion", "muon")


def rule_for(cfg: TrainConfig, layout: FlatLayout, geometry: StateGeometry) -> ChunkRule:
    """The update rule `cfg.optimizer` names, with its hyper-parameters.

    Raises:
        ValueError: an optimizer this module does not know (the config validates the name).
    """
    wd = cfg.weight_decay
    rule: ChunkRule
    if cfg.optimizer == "adamw":
        rule = AdamWRule(AdamW.from_config(cfg), geometry.padded_numel)
    elif cfg.optimizer == "sgd":
        rule = SGDRule(
            momentum=cfg.momentum, dampening=cfg.dampening, nesterov=cfg.nesterov, weight_decay=wd
        )
    elif cfg.optimizer == "lion":
        rule = LionRule(beta1=cfg.lion_beta1, beta2=cfg.lion_beta2, weight_decay=wd)
    elif cfg.optimizer == "muon":
        rule = MuonRule(
            AdamW.from_config(cfg),
            muon_matrices(layout, cfg.muon_adamw, cfg.muon_adjust_lr),
            geometry,
            momentum=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            ns_steps=cfg.muon_ns_steps,
            weight_decay=wd,
        )
    else:
        raise ValueError(f"train.optimizer={cfg.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if len(rule.slots) > MAX_SLOTS:
        raise ValueError(
            f"optimizer {rule.name} declares {len(rule.slots)} state slots > {MAX_SLOTS}"
        )
    return rule
