"""unbroken: a fault-tolerant runtime for hybrid-parallel LLM training on PyTorch.

See docs/ and ../ARCHITECTURE map in the README for the package layout. The public surface of
this top-level module is deliberately tiny: the version and the user-facing error type.
"""

from unbroken.errors import UserError

__all__ = ["UserError", "__version__"]
__version__ = "0.1.0"
