"""Choosing a codec backend for a device.

Order on the CPU: ``native`` (the compiled GFNI/AVX2/C kernel) → ``isal`` (ISA-L bundled with
pyeclib) → ``numpy`` (always works). On CUDA: ``triton``. A backend that cannot load here is
skipped by ``auto`` and reported with its reason by `available_backends`; asking for it by name
raises `BackendUnavailableError` with that reason.
"""

from __future__ import annotations

from unbroken.erasure.codec import Codec

__all__ = ["BackendUnavailableError", "available_backends", "get_codec"]

CPU_BACKENDS = ("native", "isal", "numpy")
CUDA_BACKENDS = ("triton",)


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message says why."""


def _build(
    backend: str, data_pages: int, parity_pages: int, device: str, name: str, generator: str
) -> Codec:
    kw = {"name": name, "generator": generator}
    try:
        if backend == "native":
            from unbroken.erasure.native_backend import NativeCodec

            return NativeCodec(data_pages, parity_pages, **kw)
        if backend == "isal":
            from unbroken.erasure.isal_backend import IsalCodec

            return IsalCodec(data_pages, parity_pages, **kw)
        if backend == "numpy":
            from unbroken.erasure.numpy_backend import NumpyCodec

            return NumpyCodec(data_pages, parity_pages, **kw)
        if backend == "triton":
            from unbroken.erasure.cuda_backend import TritonCodec

            return TritonCodec(data_pages, parity_pages, device=device, **kw)
    except (ImportError, OSError, RuntimeError) as exc:
        raise BackendUnavailableError(f"erasure backend {backend!r} unavailable: {exc}") from exc
    raise ValueError(
        f"unknown erasure backend {backend!r}; choose from {CPU_BACKENDS + CUDA_BACKENDS}"
    )


def _normalise(device: str) -> str:
    device = str(device)
    if device == "cuda":
        return "cuda:0"
    return device


def get_codec(
    data_pages: int,
    parity_pages: int,
    *,
    device: str = "cpu",
    backend: str = "auto",
    name: str = "code",
    generator: str = "cauchy",
) -> Codec:
    """Return the fastest available codec for a (k, m) code on ``device``.

    Args:
        data_pages: k.
        parity_pages: m (k + m ≤ 256).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        backend: ``"auto"`` or a backend name (``native``, ``isal``, ``numpy``, ``triton``).
        name: how error messages name the code (a protection group's name).
        generator: the generator matrix (`gf256.GENERATORS`).

    Raises:
        BackendUnavailableError: the named backend (or every backend for the device) cannot
            run here.
    """
    device = _normalise(device)
    if backend != "auto":
        return _build(backend, data_pages, parity_pages, device, name, generator)
    candidates = CPU_BACKENDS if device == "cpu" else CUDA_BACKENDS
    reasons = []
    for candidate in candidates:
        try:
            return _build(candidate, data_pages, parity_pages, device, name, generator)
        except BackendUnavailableError as exc:
            reasons.append(str(exc))
    raise BackendUnavailableError(f"no erasure backend for {device}: " + "; ".join(reasons))


def available_backends(device: str = "cpu") -> dict[str, str]:
    """Map each backend for ``device`` to ``"ok"`` or the reason it cannot run."""
    device = _normalise(device)
    status = {}
    for candidate in CPU_BACKENDS if device == "cpu" else CUDA_BACKENDS:
        try:
            _build(candidate, 2, 1, device, "probe", "cauchy")
            status[candidate] = "ok"
        except BackendUnavailableError as exc:
            status[candidate] = str(exc)
    return status
