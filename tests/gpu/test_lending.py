"""Activations in the protection buffers between updates (`unbroken.update.lending`, issue 16
item 4): the compute phase of a protected trainer allocates in the gradient parity, undo and
scratch regions, the bits after several iterations are those of the same trainer without
lending, and a tensor kept from the compute phase into the update is refused, not
overwritten.

The small model's activations fit in the lent regions (2 MiB pages: the undo buffer alone is
384 MiB), so every segment of the pool lies in them."""

from __future__ import annotations

import pytest
import torch

from unbroken.config import DataConfig, JobConfig, ModelConfig, TrainConfig

from ._updater_rig import cuda

CFG = JobConfig(
    model=ModelConfig(preset="small"),
    data=DataConfig(tokens_per_microbatch=1024, microbatches=2, max_documents=200),
    train=TrainConfig(iterations=8, device="cuda", precision="bf16"),
)


def _trainer(lend: bool, init=None):
    from unbroken.bench.gpu import _build

    return _build(CFG, torch.device("cuda"), protected=True, init_from=init, lend=lend)


@pytest.fixture
def deterministic(monkeypatch):
    """The trainers' settings (`unbroken.launch.session`): without them the embedding's backward
    adds with atomics and no two runs agree."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _run(lend: bool, init, iterations: int = 4):
    tr, upd, _, regions, _ = _trainer(lend=lend, init=init)
    for it in range(iterations):
        tr.run_iteration(it)
    return tr, upd, regions


@pytest.mark.gpu
@cuda
def test_lent_activations_leave_the_bits_of_an_unlent_run(deterministic):
    from unbroken.update import lending

    _, _, built, _, _ = _trainer(lend=False)
    init = built.state.params.clone()
    del built
    reference = _run(False, init)[2]["model"].clone()
    control = _run(False, init)[2]["model"]
    assert torch.equal(control, reference), "two unlent runs differ: the comparison means nothing"
    del control
    torch.cuda.empty_cache()

    before = lending.stats(reset_peaks=True)
    tr, upd, regions = _run(True, init)
    after = lending.stats()
    print(f"lending: {after}")
    assert tr.lending is upd.inner.lending is not None
    assert tr.lending.phases == 4 * CFG.data.microbatches
    assert after.lent_peak > 0, "the compute phase never allocated in the lent regions"
    assert after.fallback_calls == before.fallback_calls  # small activations: all lent
    assert torch.equal(regions["model"], reference)
    tr.lending.retire()
    assert lending.stats().lent_in_use == 0  # retired: its segments are back in the free list


@pytest.mark.gpu
@cuda
def test_a_tensor_kept_from_the_compute_phase_is_refused_at_the_update(deterministic):
    from unbroken.update.lending import LentMemoryInUse

    tr, upd, _ = _run(True, None, iterations=2)  # the first phase runs unlent; then it lends
    with tr.lending.compute():
        kept = torch.ones(4096, device="cuda")
    assert any(lo <= kept.data_ptr() < lo + n for lo, n in tr.lending.ranges)
    with pytest.raises(LentMemoryInUse, match="still alive in lent memory"):
        upd.inner.protect(2)
    del kept
    upd.inner.protect(2)  # released: the buffers are the updater's again
    tr.lending.retire()


WARMED_FIRST_PHASE = """
import os, sys, torch
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True)
sys.path.insert(0, sys.argv[1])
from tests.gpu.test_lending import CFG, _run, _trainer
from unbroken.shadow.warm import warm_cuda
from unbroken.update import lending

warm_cuda(CFG, torch.device("cuda", 0))  # as a shadow does before its promotion
_, _, built, _, _ = _trainer(lend=False)
init = built.state.params.clone()
del built
lending.stats(reset_peaks=True)
tr, upd, regions = _run(True, init, iterations=1)
first = tr.lending.phases, tr.lending.lent_phases, lending.stats().lent_peak
lent = regions["model"].clone()
tr.lending.retire()
del tr, upd, regions
torch.cuda.empty_cache()
unlent = _run(False, init, iterations=1)[2]["model"]
print("phases", *first, "equal", bool(torch.equal(lent, unlent)))
"""


@pytest.mark.gpu
@cuda
def test_a_warmed_process_lends_from_its_first_compute_phase_and_keeps_the_bits():
    """A promoted shadow's process (its warm-up made the lasting buffers) lends from its first
    micro-batch on (`lending.mark_warmed`): one iteration of 2 micro-batches, both lent, and
    the bits of the same iteration unlent. A fresh process: its own interpreter."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    proc = subprocess.run(
        [sys.executable, "-c", WARMED_FIRST_PHASE, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    _, phases, lent_phases, peak, _, equal = line.split()
    assert int(phases) == int(lent_phases) == CFG.data.microbatches and int(peak) > 0, line
    assert equal == "True", line
