"""A shadow's CUDA warm-up (`unbroken.shadow.warm.warm_cuda`) compiles every Triton kernel the
promoted trainer's first protected update runs — the fused chunk transaction among them (issue
16 item 5: the warm-up covers every kernel the first update after a takeover runs), so the
takeover never compiles one.

In a fresh process with an empty Triton cache directory: warm up for the job, then run the
graph updater's first protected update on the job's state. Every kernel Triton compiles leaves
a directory in the cache named by its hash, holding `<kernel name>.json`; none may appear after
the warm-up (on the H200 at stop 37 the warm-up compiled adamw_kernel, adamw_kernel_dev,
chunk_transaction_kernel, gf_matmul_xor, marker_write and marker_write_dev, the update none).
Once per first-tier code: the Cauchy tier's table kernel and the Vandermonde tier's Horner
kernel (stop 41: the test had passed the updater a config not resolved for the GPU, so its
update took the CPU's Cauchy default while the warm-up, resolving for the GPU, warmed the
Horner kernel — a job hands both the same resolved config).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ._updater_rig import cuda

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch

    import dataclasses

    from tests.gpu._updater_rig import CFG, LR, PROT, SCALE, noop
    from unbroken.engine.replica import build_training
    from unbroken.shadow.warm import warm_cuda
    from unbroken.update.graph import GraphUpdater
    from unbroken.update.rmu import local_allocator

    cache = Path(os.environ["TRITON_CACHE_DIR"])

    def kernels():
        return {p.stem for p in cache.glob("*/*.json") if not p.stem.startswith("__")}

    # A job's config as `unbroken.api` hands it to every process: resolved for the device,
    # with the first tier's code of the test's parameter.
    PROT = dataclasses.replace(PROT, code=sys.argv[1]).resolved(cuda=True)
    CFG = dataclasses.replace(CFG, protection=PROT)
    device = torch.device("cuda")
    warm_cuda(CFG, device)
    warmed = kernels()
    regions = {}
    b = build_training(
        CFG, n_shards=1, device=device, allocate=local_allocator(PROT, regions, pin_marker=True)
    )
    upd = GraphUpdater(b.state, b.geometry, b.step, regions, PROT)
    assert upd.fused is not None
    upd.initialize(-1)
    b.state.grads.normal_(0.0, 1e-2)
    upd.protect(0)
    upd.record_sync(0, loss=2.5, grad_norm=1.25, grad_scale=SCALE, lr=LR)
    upd.update(0, lr=LR, grad_scale=SCALE, hook=noop)
    torch.cuda.synchronize()
    print(json.dumps({"warmed": sorted(warmed), "later": sorted(kernels() - warmed)}))
    """
)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    ("code", "kernel"),
    [("cauchy", "chunk_transaction_kernel"), ("vandermonde", "chunk_transaction_horner_kernel")],
)
def test_the_shadow_warm_up_compiles_every_kernel_the_first_update_runs(tmp_path, code, kernel):
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "src")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, code], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"compiled by the warm-up: {got['warmed']}; by the first update: {got['later']}")
    assert kernel in got["warmed"]
    assert got["later"] == []
