"""Which steps the graph-replayed updater captures (`unbroken.update.graph.graph_capable`):
one-pass AdamW whose decay is one prefix of the flat state, nothing frozen — the condition
under which every chunk is one fused launch with the same arguments each iteration. Anything
else takes the stream updater on a GPU (`unbroken.update.factory`)."""

from __future__ import annotations

from unbroken.train.optim import AdamW
from unbroken.update.geometry import StateGeometry
from unbroken.update.graph import graph_capable
from unbroken.update.kernel import ChunkStep
from unbroken.update.optimizers import LionRule

GEOMETRY = StateGeometry(numel=50_000, page_bytes=8192, stripe_pages=4, chunk_bytes=2048)
OPT = AdamW(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def test_adamw_with_a_decay_prefix_or_none_is_captured():
    assert graph_capable(ChunkStep(GEOMETRY, OPT, [(0, 30_000)]))
    assert graph_capable(ChunkStep(GEOMETRY, OPT, []))


def test_masks_frozen_elements_and_other_rules_are_not():
    assert not graph_capable(ChunkStep(GEOMETRY, OPT, [(0, 10), (20, 30)]))  # two ranges
    assert not graph_capable(ChunkStep(GEOMETRY, OPT, [(100, 30_000)]))  # not a prefix
    assert not graph_capable(ChunkStep(GEOMETRY, OPT, [(0, 30_000)], frozen=[(0, 50)]))
    lion = LionRule(beta1=0.9, beta2=0.99, weight_decay=0.1)
    assert not graph_capable(ChunkStep(GEOMETRY, lion, [(0, 30_000)]))
