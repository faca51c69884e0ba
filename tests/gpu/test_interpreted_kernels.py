"""The update's Triton kernels run by Triton's CPU interpreter (no GPU needed; skipped where
Triton is not installed, as on the CPU-only CI machine): the fused AdamW kernel against the
eager update, its device-scalar variant (the graph updater's) bit for bit against it, and the
graph updater's marker kernel against the host writer's bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_ADAMW = textwrap.dedent(
    """
    import torch
    from unbroken.train.optim import AdamW
    from unbroken.update.fused_adamw import AdamWCoefficients, fused_adamw_, fused_adamw_dev_
    opt = AdamW(0.9, 0.95, 1e-8, 0.1)
    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(3000, generator=gen) for _ in range(3))
    v = torch.rand(3000, generator=gen)
    ref = [t.clone() for t in (p, g, m, v)]
    opt.update_range(*[t[:1000] for t in ref], step=4, lr=1e-3, grad_scale=0.5, decay=True)
    opt.update_range(*[t[1000:] for t in ref], step=4, lr=1e-3, grad_scale=0.5, decay=False)
    c = AdamWCoefficients.of(opt, step=4, lr=1e-3, grad_scale=0.5)
    dev = [t.clone() for t in (p, g, m, v)]
    fused_adamw_(p, g, m, v, c, first_index=0, decay_end=1000)
    for a, b in ((p, ref[0]), (m, ref[2]), (v, ref[3])):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    # The graph updater's launch (scalars read from a tensor) computes the same bits.
    coeffs = torch.tensor(c.values(), dtype=torch.float32)
    fused_adamw_dev_(*dev, coeffs, first_index=0, decay_end=1000)
    assert all(torch.equal(a, b) for a, b in zip(dev, (p, g, m, v)))
    print("ok")
    """
)


_MARKER = textwrap.dedent(
    """
    import torch
    from triton.runtime import interpreter

    # The interpreter runs no inline PTX; the kernel's one asm line is a system-scope fence
    # (ordering for the host's view of a running GPU), a no-op for a sequential interpreter.
    class _Result:
        def __init__(self, value):
            self.value = value

        def get_result(self, i=0):
            return self.value

    interpreter.InterpreterBuilder.create_inline_asm = (
        lambda self, asm, constraints, values, ty, pure, pack: _Result(values[0])
    )

    from unbroken.update.device_marker import DeviceMarker, _crc_tables, _kernels
    from unbroken.update.layout import MARKER_PAGE
    from unbroken.update.marker import MARKER_BYTES, SLOT_BYTES, ProgressMarker, Stage

    first = ProgressMarker(torch.zeros(MARKER_BYTES, dtype=torch.uint8))
    first.write(stage=Stage.IDLE, iteration=7, done_iter=6)
    synced = first.write(
        stage=Stage.SYNCED, loss=3.25, grad_norm=-0.5, grad_scale=0.9, lr=3e-4
    )
    base = torch.tensor(DeviceMarker.base_words(synced) + [0], dtype=torch.int64)
    table, z = _crc_tables()
    table = torch.from_numpy(table)
    pages = torch.zeros((3, MARKER_PAGE), dtype=torch.uint8)
    # Transaction 0's first write, transaction 1's commit, the update's last write (IDLE).
    for seq_off, stage, group, chunk, idle in (
        (1, Stage.CHUNK_UPDATING, 0, 0, 0),
        (6, Stage.SYNCED, 0, 2, 0),
        (9, Stage.IDLE, 0, 0, 1),
    ):
        host = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
        writer = ProgressMarker(host)
        writer.read()
        if synced.seq + seq_off > 1:
            writer.skip(synced.seq + seq_off - 1)
        done = synced.iteration if idle else synced.done_iter
        want = writer.write(
            iteration=synced.iteration, stage=stage, group=group, chunk=chunk, done_iter=done,
            loss=synced.loss, grad_norm=synced.grad_norm, grad_scale=synced.grad_scale,
            lr=synced.lr,
        )
        _kernels()[1][(1,)](
            pages, table, base, z, seq_off, int(stage), group, chunk, idle, PAGE=MARKER_PAGE
        )
        slot = (want.seq % 2) * SLOT_BYTES
        assert torch.equal(pages[0, slot : slot + SLOT_BYTES], host[slot : slot + SLOT_BYTES])
        assert ProgressMarker(pages[0, :MARKER_BYTES]).read() == want
        assert torch.equal(pages[1], pages[0]) and torch.equal(pages[2], pages[0])
    print("ok")
    """
)


def test_the_update_kernels_in_tritons_interpreter_match_their_references():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    for script in (_ADAMW, _MARKER):
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
        )
        assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
