"""Each optimizer rule, run chunk by chunk over the striped flat state, against a reference
over whole parameter tensors: torch.optim.SGD, a straightforward Lion (the authors' reference
arithmetic), torch.optim.Muon for the Muon matrices with AdamW for the rest. Same arithmetic
order, so the comparisons are bit-exact (`torch.equal`)."""

from __future__ import annotations

import pytest
import torch

from unbroken.train.optim import AdamW
from unbroken.update import PlainUpdater
from unbroken.update.muon import MuonRule

from ._rig import built, fake_grads

ITERS = 3
SCALES = (1.0, 0.5, 1.0)  # a clipped iteration in the middle
LRS = (1e-3, 2e-3, 5e-4)


def _run_chunked(b) -> None:
    upd = PlainUpdater(b.state, b.geometry, b.step)
    for it in range(ITERS):
        fake_grads(b, it)
        upd.update(it, lr=LRS[it], grad_scale=SCALES[it], hook=lambda *a: None)


def _params(b) -> dict[str, torch.Tensor]:
    """Independent copies of the initial parameters, by slot name, with a .grad to fill."""
    out = {}
    for s in b.state.layout.stored:
        t = b.state.params[s.offset : s.offset + s.numel].view(s.shape).clone()
        out[s.name] = torch.nn.Parameter(t)
    return out


def _set_grads(b, params, it) -> None:
    fake_grads(b, it)
    for s in b.state.layout.stored:
        g = b.state.grads[s.offset : s.offset + s.numel].view(s.shape)
        params[s.name].grad = g.clone() if SCALES[it] == 1.0 else g * SCALES[it]


def _assert_params_equal(b, params) -> None:
    for s in b.state.layout.stored:
        got = b.state.params[s.offset : s.offset + s.numel].view(s.shape)
        assert torch.equal(got, params[s.name].detach()), s.name


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_equals_torch_sgd(nesterov):
    kw = {"momentum": 0.9, "nesterov": nesterov, "weight_decay": 0.01}
    b = built("sgd", **kw)
    params = _params(b)
    decay = [params[s.name] for s in b.state.layout.stored if s.decay]
    rest = [params[s.name] for s in b.state.layout.stored if not s.decay]
    ref = torch.optim.SGD(
        [{"params": decay}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3,
        momentum=0.9,
        nesterov=nesterov,
        weight_decay=0.01,
        foreach=False,
    )
    _run_chunked(b)
    for it in range(ITERS):
        _set_grads(b, params, it)
        for group in ref.param_groups:
            group["lr"] = LRS[it]
        ref.step()
    _assert_params_equal(b, params)
    for s in b.state.layout.stored:
        buf = ref.state[params[s.name]]["momentum_buffer"]
        assert torch.equal(b.state.exp_avg[s.offset : s.offset + s.numel].view(s.shape), buf)


def _lion_reference(p, grad, m, *, lr, beta1, beta2, wd) -> None:
    p.mul_(1.0 - lr * wd)
    update = m.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
    p.add_(update, alpha=-lr)
    m.mul_(beta2).add_(grad, alpha=1.0 - beta2)


def test_lion_equals_reference():
    b = built("lion", weight_decay=0.1)
    params = _params(b)
    moms = {k: torch.zeros_like(v) for k, v in params.items()}
    _run_chunked(b)
    with torch.no_grad():
        for it in range(ITERS):
            _set_grads(b, params, it)
            for s in b.state.layout.stored:
                p = params[s.name]
                wd = 0.1 if s.decay else 0.0
                _lion_reference(p, p.grad, moms[s.name], lr=LRS[it], beta1=0.9, beta2=0.99, wd=wd)
    _assert_params_equal(b, params)


def test_muon_equals_torch_muon_and_adamw_for_the_rest():
    b = built("muon", weight_decay=0.1)
    rule = b.step.rule
    assert isinstance(rule, MuonRule)
    muon_offsets = {m.offset for m in rule.matrices}
    slots = b.state.layout.stored
    muon = [s for s in slots if s.offset in muon_offsets]
    rest = [s for s in slots if s.offset not in muon_offsets]
    assert muon and rest
    assert all(len(s.shape) == 2 and "embed" not in s.name for s in muon)
    params = _params(b)
    ref = torch.optim.Muon(
        [params[s.name] for s in muon],
        lr=1e-3,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = AdamW(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    moments = {s.name: (torch.zeros(s.shape), torch.zeros(s.shape)) for s in rest}
    _run_chunked(b)
    with torch.no_grad():
        for it in range(ITERS):
            _set_grads(b, params, it)
            ref.param_groups[0]["lr"] = LRS[it]
            ref.step()
            for s in rest:
                p = params[s.name]
                m, v = moments[s.name]
                adamw.update_range(
                    p, p.grad, m, v, step=it + 1, lr=LRS[it], grad_scale=1.0, decay=s.decay
                )
    _assert_params_equal(b, params)
