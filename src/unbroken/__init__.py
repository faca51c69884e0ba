"""unbroken: a fault-tolerant runtime for hybrid-parallel LLM training on PyTorch.

See docs/ and ../ARCHITECTURE map in the README for the package layout. The public surface of
this top-level module is deliberately tiny: the version, the user-facing error type, and the
Python API — `run_job` (`unbroken.api`), the `RunSummary` it returns and the `RunObserver`
interface for watching a run live. Those three are imported on first use, so `import unbroken`
(done by every process of a job) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unbroken.errors import UserError

if TYPE_CHECKING:
    from unbroken.api import run_job
    from unbroken.metrics.observer import RunObserver
    from unbroken.metrics.run_summary import RunSummary

__all__ = ["RunObserver", "RunSummary", "UserError", "__version__", "run_job"]
__version__ = "0.1.0"

_LAZY = {
    "run_job": "unbroken.api",
    "RunSummary": "unbroken.metrics.run_summary",
    "RunObserver": "unbroken.metrics.observer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'unbroken' has no attribute {name!r}")
