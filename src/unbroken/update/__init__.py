"""The update phase: AdamW over striped chunks of the flat state, plain or as crash-consistent
chunk transactions (the Resumable Model Updater, Leto §5.2, Pseudocode 1)."""

from unbroken.update.geometry import ChunkRef, StateGeometry
from unbroken.update.kernel import ChunkStep
from unbroken.update.plain import PlainUpdater

__all__ = ["ChunkRef", "ChunkStep", "PlainUpdater", "StateGeometry"]
