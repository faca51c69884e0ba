"""DCP checkpoints: round trip, completeness, corrupt/incomplete fallback, Young's interval."""

from __future__ import annotations

import json
import math

import pytest
import torch

from unbroken.checkpoint import (
    CheckpointMismatch,
    find_latest_valid,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
    young_interval,
)
from unbroken.model.flat import FlatLayout, ParamSlot
from unbroken.train.state import TrainState


def _state(seed: float) -> TrainState:
    layout = FlatLayout(slots=(ParamSlot("w", (64,), 0, 64, True),), numel=64)
    st = TrainState.allocate(layout)
    for i, t in enumerate(st.persistent().values()):
        t.copy_(torch.arange(64, dtype=torch.float32) * seed + i)
    return st


def _save(root, seed, it, keep=5):
    return save_checkpoint(root, _state(seed), it, group=None, rank=0, keep=keep)


def test_round_trip_restores_every_byte(tmp_path):
    _save(tmp_path, 1.5, 4)
    info = find_latest_valid(tmp_path)
    assert info is not None and info.iteration == 4
    target = _state(0.0)
    assert load_checkpoint(info, target, group=None) == 4
    assert target.state_hash() == _state(1.5).state_hash()


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_manifest", "missing_file"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, damage):
    _save(tmp_path, 1.0, 3)
    _save(tmp_path, 2.0, 6)
    newest = list_checkpoints(tmp_path)[-1]
    data = sorted(p for p in newest.path.iterdir() if p.suffix == ".distcp")[0]
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:10])
    elif damage == "no_manifest":
        (newest.path / "manifest.json").unlink()
    else:
        data.unlink()
    skipped = []
    info = find_latest_valid(tmp_path, on_skip=lambda i, r: skipped.append((i.iteration, r)))
    assert info is not None and info.iteration == 3
    assert skipped and skipped[0][0] == 6
    target = _state(0.0)
    load_checkpoint(info, target, group=None)
    assert target.state_hash() == _state(1.0).state_hash()


def test_manifest_for_another_iteration_is_rejected(tmp_path):
    _save(tmp_path, 1.0, 3)
    info = list_checkpoints(tmp_path)[0]
    meta = json.loads((info.path / "manifest.json").read_text())
    meta["iteration"] = 9
    (info.path / "manifest.json").write_text(json.dumps(meta))
    assert verify_checkpoint(info) is not None
    assert find_latest_valid(tmp_path) is None


def test_keep_prunes_old_checkpoints(tmp_path):
    for it in range(1, 6):
        _save(tmp_path, float(it), it, keep=2)
    assert [c.iteration for c in list_checkpoints(tmp_path)] == [4, 5]


def test_a_torn_save_is_removed_once_a_newer_checkpoint_is_sealed(tmp_path):
    # A crash inside the save of iteration 2 (files written, never sealed), and one of 9 after
    # a newer seal: the save of 4 removes the torn 2 (no generation resumes it), not the 9
    # (newer than every sealed one: it may be a save in progress).
    _save(tmp_path, 1.0, 1, keep=3)
    for it in (2, 9):
        torn = tmp_path / f"iter_{it:08d}"
        torn.mkdir()
        (torn / "__0_0.distcp").write_bytes(b"x" * 64)
    _save(tmp_path, 3.0, 3, keep=3)
    _save(tmp_path, 4.0, 4, keep=3)
    assert [c.iteration for c in list_checkpoints(tmp_path)] == [1, 3, 4, 9]


def test_young_interval():
    # sqrt(2 * C * MTTF) / t_iter
    assert young_interval(2.0, 600.0, 1.0, 10_000) == round(math.sqrt(2 * 2 * 600))
    assert young_interval(0.0, 600.0, 1.0, 100) == 1
    assert young_interval(10.0, math.inf, 1.0, 77) == 77
    assert young_interval(50.0, 1e9, 1.0, 100) == 100
    with pytest.raises(ValueError):
        young_interval(1.0, 0.0, 1.0, 10)


def test_the_seed_is_saved_and_a_job_with_another_is_refused(tmp_path):
    save_checkpoint(tmp_path, _state(1.0), 3, group=None, rank=0, keep=2, rng_seed=7)
    info = find_latest_valid(tmp_path)
    target = _state(0.0)
    assert load_checkpoint(info, target, group=None, rng_seed=7) == 3
    assert target.state_hash() == _state(1.0).state_hash()
    with pytest.raises(CheckpointMismatch, match=r"train\.seed = 7, this job has 8"):
        load_checkpoint(info, _state(0.0), group=None, rng_seed=8)
