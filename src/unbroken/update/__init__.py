"""The update phase: an optimizer rule (AdamW, SGD, Lion, Muon; `unbroken.update.rule`) over
striped chunks of the flat state, plain or as crash-consistent chunk transactions (the
Resumable Model Updater, Leto §5.2, Pseudocode 1)."""

from unbroken.update.geometry import ChunkRef, StateGeometry
from unbroken.update.kernel import ChunkStep
from unbroken.update.plain import PlainUpdater
from unbroken.update.rule import ChunkContext, ChunkRule

__all__ = ["ChunkContext", "ChunkRef", "ChunkRule", "ChunkStep", "PlainUpdater", "StateGeometry"]
