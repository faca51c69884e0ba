"""Resilient Memory Pool (Leto §4): retained host memory that outlives trainers.

One state-manager process per rank (`unbroken.state.manager`) owns named `memfd_create`
regions ("model", "grads", "grad_parity", "model_parity", "undo", "scratch", "marker"). Trainers
connect with `RetainedClient`, receive each region's fd over `SCM_RIGHTS`, map it once and use
it as a zero-copy tensor. A trainer killed with SIGKILL loses nothing: the manager still holds
the fds, and a replacement trainer attaches by name (`fresh` is False).

After a failure the manager localizes missing pages through the memory itself — memfd holes
(`SEEK_HOLE`), plus an madvise scan for hardware-poisoned pages where the kernel supports it —
and remaps them to healthy zeroed memory. The trainer rebuilds their contents from parity
(`unbroken.erasure`); the pool never restores contents.

Must never: read or write page contents in the manager; consult the injector
(`unbroken.state.pageloss`) to localize; touch retained pages before localization after a
failure ([Note: localize before touching] in `unbroken.state.localize`).

The manager imports no torch (fast start); `RetainedClient` and friends are imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken.state.pageloss import punch_pages

if TYPE_CHECKING:
    from unbroken.state.client import (
        LocalizationReport,
        RetainedClient,
        RetainedRegion,
        RetainedStateError,
    )

__all__ = [
    "LocalizationReport",
    "RetainedClient",
    "RetainedRegion",
    "RetainedStateError",
    "punch_pages",
]

_CLIENT_NAMES = frozenset(__all__) - {"punch_pages"}


def __getattr__(name: str) -> Any:
    # Lazy: `python -m unbroken.state.manager` imports this package and must not pay for torch.
    if name in _CLIENT_NAMES:
        from unbroken.state import client

        return getattr(client, name)
    raise AttributeError(f"module 'unbroken.state' has no attribute {name!r}")
