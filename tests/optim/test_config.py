"""`train.optimizer` and its hyper-parameters: the rule each name selects, and one clear line
for each bad value (in a TOML file: a user error naming the key, no traceback)."""

from __future__ import annotations

import pytest

from unbroken.config import JobConfig, TrainConfig
from unbroken.config.loader import config_from_dict
from unbroken.errors import UserError
from unbroken.update.adamw import AdamWRule
from unbroken.update.elementwise import LionRule, SGDRule
from unbroken.update.muon import MuonRule

from ._rig import built


@pytest.mark.parametrize(
    ("name", "cls", "slots"),
    [
        ("adamw", AdamWRule, ("exp_avg", "exp_avg_sq")),
        ("sgd", SGDRule, ("momentum_buffer",)),
        ("lion", LionRule, ("exp_avg",)),
        ("muon", MuonRule, ("exp_avg", "exp_avg_sq")),
    ],
)
def test_each_name_selects_its_rule(name, cls, slots):
    rule = built(name).step.rule
    assert isinstance(rule, cls) and rule.name == name and rule.slots == slots


def test_muon_leaves_embeddings_and_vectors_to_adamw():
    b = built("muon")
    offsets = {m.offset for m in b.step.rule.matrices}
    for s in b.state.layout.stored:
        is_muon = s.offset in offsets
        assert is_muon == (len(s.shape) == 2 and "embed" not in s.name and "head" not in s.name)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"optimizer": "sgd", "momentum": -0.1}, "train.momentum must be >= 0"),
        ({"optimizer": "sgd", "nesterov": True, "momentum": 0.0}, "train.nesterov needs"),
        ({"optimizer": "lion", "lion_beta2": 1.0}, "train.lion_beta2 must be in [0, 1)"),
        ({"optimizer": "muon", "muon_momentum": 1.5}, "train.muon_momentum must be in [0, 1)"),
        ({"optimizer": "muon", "muon_ns_steps": 0}, "train.muon_ns_steps must be in [1, 100)"),
        ({"optimizer": "adamw", "beta2": -0.5}, "train.beta2 must be in [0, 1)"),
    ],
)
def test_bad_hyper_parameters_are_one_clear_line(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(")", r"\)")):
        TrainConfig(**fields)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"optimizer": "adam"}, "key 'train.optimizer' is 'adam'; choose one of 'adamw', 'sgd'"),
        ({"optimizer": "lion", "lion_beta1": 2.0}, "train.lion_beta1 must be in [0, 1)"),
    ],
)
def test_bad_values_in_a_config_are_user_errors(train, message):
    with pytest.raises(UserError) as err:
        config_from_dict(JobConfig, {"train": train}, "job.toml")
    assert message in str(err.value) and "\n" not in str(err.value)
