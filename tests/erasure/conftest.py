"""Backends under test: every backend runs the same conformance suite (STYLE.md §8).

A backend case knows how to build a codec and how to make and read page buffers on its device.
GPU cases carry the ``gpu`` marker and skip where CUDA is absent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from unbroken.erasure import BackendUnavailableError, Codec, get_codec


@dataclass(frozen=True)
class BackendCase:
    name: str
    make: Callable[..., Codec]
    """(k, m, generator="cauchy") -> a codec of this backend."""
    device: str

    def buffer(self, data: np.ndarray):
        """A page on this backend's device holding ``data`` (uint8, 1-D)."""
        if self.device == "cpu":
            return np.array(data, dtype=np.uint8, copy=True)
        import torch

        return torch.from_numpy(np.array(data, dtype=np.uint8)).to(self.device)

    def read(self, buf) -> np.ndarray:
        if isinstance(buf, np.ndarray):
            return buf.copy()
        return buf.cpu().numpy().copy()


def _native(isa: str) -> Callable[..., Codec]:
    def make(k: int, m: int, generator: str = "cauchy") -> Codec:
        from unbroken.erasure.native_backend import NativeCodec, NativeUnavailableError

        try:
            return NativeCodec(k, m, isa=isa, generator=generator)
        except NativeUnavailableError as exc:
            pytest.skip(str(exc))

    return make


def _named(backend: str, device: str = "cpu") -> Callable[..., Codec]:
    def make(k: int, m: int, generator: str = "cauchy") -> Codec:
        try:
            return get_codec(k, m, device=device, backend=backend, generator=generator)
        except BackendUnavailableError as exc:
            pytest.skip(str(exc))

    return make


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


CPU_CASES = [
    BackendCase("numpy", _named("numpy"), "cpu"),
    BackendCase("native-scalar", _native("scalar"), "cpu"),
    BackendCase("native-avx2", _native("avx2"), "cpu"),
    BackendCase("native-gfni512", _native("gfni512"), "cpu"),
    BackendCase("isal", _named("isal"), "cpu"),
]
GPU_CASES = [BackendCase("triton", _named("triton", "cuda"), "cuda:0")]

_gpu_skip = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
REQUIRED_IN_CI = {"isal"}
"""Backends whose conformance run CI must not skip: ISA-L (pyeclib, in the `bench` extra) is the
independent implementation of the field arithmetic ours is checked against."""
BACKEND_PARAMS = [
    pytest.param(
        case, id=case.name, marks=[pytest.mark.ci_required] if case.name in REQUIRED_IN_CI else []
    )
    for case in CPU_CASES
] + [pytest.param(case, id=case.name, marks=[pytest.mark.gpu, _gpu_skip]) for case in GPU_CASES]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request) -> BackendCase:
    return request.param
