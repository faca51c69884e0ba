"""The Python API's arguments without running a job: which objects can reach the trainer
processes and under what name ([Note: user objects travel by reference]), what `optimizer=`
accepts, and the typed summary's JSON form."""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import unbroken
from unbroken.config import TrainConfig
from unbroken.config.objects import factory_reference, pickle_dataset, pickled_dataset, reference
from unbroken.config.optimizer import apply_optimizer
from unbroken.errors import UserError
from unbroken.metrics.run_summary import RunSummary

from . import _objects
from ._objects import CountingDataset, build

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "sim" / "fixtures" / "timings" / "pp2-1f1b"
"""A recorded run (reference + faulty, with recoveries and a fail-slow report)."""


def _summary_of_recorded_run() -> dict:
    """`build_summary` of the recorded run's logs, as `run_job` builds it."""
    from unbroken.metrics import read_jsonl
    from unbroken.metrics.summary import build_summary

    metrics, events = read_jsonl(RECORDED / "metrics.jsonl"), read_jsonl(RECORDED / "events.jsonl")

    def outcome(run: str) -> dict:
        done = [e for e in events if e["run"] == run and e["kind"] == "trainer_done"][-1]
        return {
            "metrics": [m for m in metrics if m["run"] == run],
            "events": [e for e in events if e["run"] == run],
            "final_state_hash": done["final_state_hash"],
            "rank_hashes": done.get("rank_hashes"),
            "state": "done",
            "reason": "",
        }

    config = json.loads((RECORDED / "config.json").read_text())
    summary = build_summary(outcome("reference"), outcome("faulty"), config)
    summary["run_dir"] = str(RECORDED)
    return summary


def test_top_level_functions_and_classes_travel_by_module_and_name():
    ref = reference(build, "model_factory")
    assert ref.path == "tests.metrics._objects:build"
    assert ref.search_dir == str(REPO)  # the trainers import `tests...` from the repo root
    assert reference(CountingDataset, "dataset").path == "tests.metrics._objects:CountingDataset"
    ref, kwargs = factory_reference(functools.partial(build, hidden=7))
    assert (ref.path, kwargs) == ("tests.metrics._objects:build", {"hidden": 7})


def test_what_has_no_importable_name_is_refused_naming_the_fix():
    def local() -> None: ...

    class Local: ...

    cases = {
        lambda: None: "a lambda cannot reach the trainer processes",
        local: "nested function, closure or method",
        Local: "nested function, closure or method",
        CountingDataset.iteration: "nested function, closure or method",
        42: "not a function or class",
    }
    for obj, message in cases.items():
        with pytest.raises(UserError, match=message) as info:
            reference(obj, "model_factory")
        assert "define it with def at the top level of a module" in str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="positional arguments"):
        factory_reference(functools.partial(build, 32))


def test_the_running_script_is_imported_by_its_file_name(tmp_path):
    script = tmp_path / "train_mine.py"
    script.write_text(
        textwrap.dedent(
            """
            from unbroken.config.objects import reference

            def make_model():
                return None

            if __name__ == "__main__":
                ref = reference(make_model, "model_factory")
                print(ref.path, ref.search_dir)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_JOB_SECRET"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["train_mine:make_model", str(tmp_path)]


def test_a_dataset_object_is_pickled_once_and_every_trainer_unpickles_the_same(tmp_path):
    data = CountingDataset(seed=3, rows=4, microbatches=2)
    ref, folders = pickle_dataset(data, tmp_path / "objects")
    module, _, name = ref.path.partition(":")
    assert name == "dataset" and module.startswith("unbroken_dataset_")
    assert str((tmp_path / "objects").resolve()) in folders and str(REPO) in folders
    loader = pickled_dataset(str(tmp_path / "objects" / f"{module}.py"), f"{module[17:]}.pkl")
    # the generated module names the blob; what it returns equals the original, per call
    text = (tmp_path / "objects" / f"{module}.py").read_text()
    blob = text.split('pickled_dataset(__file__, "')[1].split('"')[0]
    got = pickled_dataset(str(tmp_path / "objects" / f"{module}.py"), blob)(None, 2)
    assert got is not data and vars(got) == vars(data)
    assert all(
        (a["x"] == b["x"]).all()
        for a, b in zip(got.iteration(5, 1), data.iteration(5, 1), strict=True)
    )
    del loader
    with pytest.raises(UserError, match="cannot be pickled"):
        pickle_dataset(CountingDataset(seed=lambda: 0, rows=1, microbatches=1), tmp_path / "o")  # type: ignore[arg-type]


def test_a_script_class_inside_a_pickled_dataset_is_pickled_by_its_import_name(tmp_path):
    script = tmp_path / "job_script.py"
    script.write_text(
        textwrap.dedent(
            """
            import pathlib, pickle, sys
            from unbroken.config.objects import pickle_dataset

            class Data:
                def __init__(self, n):
                    self.n = n
                def iteration(self, iteration, shard):
                    return []

            if __name__ == "__main__":
                ref, folders = pickle_dataset(Data(5), pathlib.Path(sys.argv[1]))
                print(ref.path)
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_JOB_SECRET"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "objects")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    (blob,) = (tmp_path / "objects").glob("*.pkl")
    # another process (not the script) unpickles it: the class comes from `job_script`
    obj = pickle.loads(blob.read_bytes())
    assert type(obj).__module__ == "job_script" and obj.n == 5


def test_run_job_refuses_to_run_inside_a_job_process(monkeypatch):
    monkeypatch.setenv("UNBROKEN_JOB_SECRET", "00")
    with pytest.raises(UserError, match='if __name__ == "__main__"'):
        unbroken.run_job(None, "unused")


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (None, {}),
        ("adamw", {}),
        (
            {"name": "adamw", "lr": 1e-3, "betas": (0.8, 0.9)},
            {"lr": 1e-3, "beta1": 0.8, "beta2": 0.9},
        ),
        (
            {"weight_decay": 0.0, "eps": 1e-6, "grad_clip": 0.5},
            {"weight_decay": 0.0, "eps": 1e-6, "grad_clip": 0.5},
        ),
    ],
)
def test_optimizer_settings_override_the_config(optimizer, expected):
    base = TrainConfig()
    got = apply_optimizer(base, optimizer)
    for key, value in expected.items():
        assert getattr(got, key) == value
    for key in {"lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip"} - set(expected):
        assert getattr(got, key) == getattr(base, key)


def test_torch_adamw_as_users_write_it():
    import torch

    got = apply_optimizer(
        TrainConfig(),
        functools.partial(torch.optim.AdamW, lr=5e-4, betas=(0.9, 0.99), foreach=None),
    )
    assert (got.lr, got.beta1, got.beta2) == (5e-4, 0.9, 0.99)
    assert apply_optimizer(TrainConfig(), torch.optim.AdamW) == TrainConfig()


def test_every_rule_of_the_updater_by_name_dict_or_torch_class():
    import torch

    got = apply_optimizer(TrainConfig(), "sgd")
    assert got.optimizer == "sgd" and got.momentum == TrainConfig().momentum
    got = apply_optimizer(
        TrainConfig(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.8, nesterov=True)
    )
    assert (got.optimizer, got.lr, got.momentum, got.nesterov) == ("sgd", 0.1, 0.8, True)
    got = apply_optimizer(TrainConfig(), {"name": "lion", "lr": 1e-4, "betas": (0.95, 0.98)})
    assert (got.optimizer, got.lr, got.lion_beta1, got.lion_beta2) == ("lion", 1e-4, 0.95, 0.98)
    assert (got.beta1, got.beta2) == (TrainConfig().beta1, TrainConfig().beta2)  # AdamW's
    got = apply_optimizer(
        TrainConfig(),
        functools.partial(torch.optim.Muon, lr=0.02, momentum=0.9, ns_steps=4, adjust_lr_fn=None),
    )
    assert (got.optimizer, got.lr, got.muon_momentum, got.muon_ns_steps) == ("muon", 0.02, 0.9, 4)
    assert got.muon_adjust_lr == "original"  # torch reads None as the original adjustment
    assert apply_optimizer(TrainConfig(), torch.optim.Muon).optimizer == "muon"


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ("adagrad", "optimizer 'adagrad': use one of adamw, sgd, lion, muon"),
        ({"name": "rmsprop"}, "use one of adamw, sgd, lion, muon"),
        ({"momentum": 0.9}, r"unknown adamw setting\(s\) \['momentum'\]"),
        ({"name": "sgd", "eps": 1e-8}, r"unknown sgd setting\(s\) \['eps'\]"),
        ({"name": "sgd", "nesterov": 1}, "nesterov must be true or false"),
        ({"name": "sgd", "nesterov": True, "momentum": 0.0}, "nesterov needs train.momentum"),
        ({"name": "muon", "adjust_lr_fn": "fast"}, "muon_adjust_lr='fast'"),
        ({"name": "muon", "ns_steps": 2.5}, "ns_steps must be an integer"),
        ({"betas": 0.9}, "betas must be two numbers"),
        ({"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ({"name": "lion", "betas": (0.9, 1.0)}, r"lion_beta2 must be in \[0, 1\)"),
        ({"lr": "fast"}, "lr must be a number"),
        ({"lr": -1.0}, "train.lr must be positive"),
        ({"grad_clip": -1.0}, "grad_clip must be >= 0"),
    ],
)
def test_what_the_resumable_updater_cannot_run_is_refused(optimizer, message):
    with pytest.raises(UserError, match=message):
        apply_optimizer(TrainConfig(), optimizer)


def test_other_torch_optimizers_and_arithmetic_changing_options_are_refused():
    import torch

    with pytest.raises(UserError, match="optimizer=Adam: the resumable updater runs"):
        apply_optimizer(TrainConfig(), torch.optim.Adam)
    with pytest.raises(UserError, match="amsgrad=True is not supported"):
        apply_optimizer(TrainConfig(), functools.partial(torch.optim.AdamW, amsgrad=True))
    with pytest.raises(UserError, match="maximize=True is not supported"):
        apply_optimizer(TrainConfig(), functools.partial(torch.optim.SGD, maximize=True))
    with pytest.raises(UserError, match="ns_coefficients"):
        apply_optimizer(
            TrainConfig(), functools.partial(torch.optim.Muon, ns_coefficients=(3.0, -4.0, 2.0))
        )
    with pytest.raises(UserError, match="pass settings by keyword"):
        apply_optimizer(TrainConfig(), functools.partial(torch.optim.SGD, [], 0.1))


def test_the_typed_summary_keeps_the_json_form():
    data = _summary_of_recorded_run()
    assert data["recoveries"] and data["fail_slow"]
    s = RunSummary.from_dict(data)
    assert s.to_dict() == data and list(s.to_dict()) == list(data)
    assert s.bit_exact is data["bit_exact"] and s.faulty.iterations == data["faulty"]["iterations"]
    assert s.recoveries[0].total_s == data["recoveries"][0]["total_s"]
    assert s["ettr"] == data["ettr"] and dict(s) == data  # read like the dict it was
    no_ref = {k: v for k, v in data.items() if k not in ("reference",) and k not in (
        "reference_state_hash", "ettr", "reference_wall_s", "bit_exact", "rank_mismatches",
        "per_iteration_mismatches", "per_rank_mismatches")}  # fmt: skip
    assert RunSummary.from_dict(no_ref).to_dict() == no_ref
    assert RunSummary.from_dict(no_ref).bit_exact is None
    with pytest.raises(ValueError, match="not in RunSummary"):
        RunSummary.from_dict({**data, "surprise": 1})


def test_the_package_exports_the_api():
    from unbroken.api import run_job

    assert unbroken.run_job is run_job
    assert unbroken.RunSummary is RunSummary
    assert _objects.build is build
