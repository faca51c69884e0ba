"""Modules built on the meta device without running their initializers.

A module's constructor initializes its parameters (`reset_parameters` -> `torch.nn.init.*`,
`Tensor.normal_`, ...). On the meta device that computes nothing, yet torch's meta kernels for
the random initializers are Python references wrapped to keep TorchDynamo out, and the first
call imports `torch._dynamo`: 1.0-1.7 s on the 2-core VM, in every process that builds a meta
model — the preflight of every `unbroken train` (a refused bad input took 4 s instead of 2.5),
every trainer and shadow. `skip_meta_init` skips an initializer whose tensor is on the meta
device, through a `TorchFunctionMode` (torch's documented hook for intercepting tensor
functions; no maintained library does this one thing). A meta tensor holds no values and meta
ops draw no random numbers, so nothing a job computes changes; real tensors pass through.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["skip_meta_init"]

_TENSOR_INITS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.zero_,
        torch.Tensor.fill_,
        torch.Tensor.random_,
        torch.Tensor.bernoulli_,
        torch.Tensor.exponential_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.geometric_,
    }
)


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        init = func in _TENSOR_INITS or getattr(func, "__module__", None) == "torch.nn.init"
        if init and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def skip_meta_init() -> TorchFunctionMode:
    """A context in which initializers of meta tensors do nothing (module docstring)."""
    return _SkipMetaInit()
