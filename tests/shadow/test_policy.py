"""Leto §6 level policy: relaunch at the level that fits, lower under repeated pressure, raise
again at a recovery when the peak active memory leaves room."""

from __future__ import annotations

from unbroken.shadow.policy import LevelPolicy

MB = 1 << 20


def _policy() -> LevelPolicy:
    p = LevelPolicy(configured=3, budget=1000 * MB, margin=0.0)
    p.record_footprint(3, 100 * MB)
    p.record_footprint(2, 60 * MB)
    p.record_footprint(1, 10 * MB)
    return p


def test_reclaim_relaunches_at_the_most_advanced_level_that_fits():
    p = _policy()
    # 4 shadows, 700 MB active: L3 needs 400 more (1100 > 1000), L2 240 (940): L2.
    assert p.after_reclaim(active=700 * MB, shadows=4) == 2
    # 900 MB active: only L1 (40 MB) fits.
    p = _policy()
    assert p.after_reclaim(active=900 * MB, shadows=4) == 1
    # 990 MB active: nothing fits, no shadows.
    p = _policy()
    assert p.after_reclaim(active=990 * MB, shadows=4) == 0


def test_repeated_pressure_lowers_the_level_even_if_the_headroom_looks_fine():
    p = _policy()
    assert p.after_reclaim(active=100 * MB, shadows=4) == 3  # the spike was over already
    assert p.after_reclaim(active=100 * MB, shadows=4) == 2  # second time: at least one lower
    assert p.after_reclaim(active=100 * MB, shadows=4) == 1
    assert p.after_reclaim(active=100 * MB, shadows=4) == 0
    assert p.after_reclaim(active=100 * MB, shadows=4) == 0


def test_recovery_raises_the_level_as_far_as_peak_memory_allows():
    p = _policy()
    p.after_reclaim(active=900 * MB, shadows=4)
    assert p.cap == 1
    assert p.at_recovery(peak_active=500 * MB, shadows=4) == 3  # room again: back to L3
    assert p.at_recovery(peak_active=700 * MB, shadows=4) == 2
    assert p.at_recovery(peak_active=None, shadows=4) == 3  # nothing observed: as configured
    assert p.reclaims == 0


def test_unmeasured_levels_are_estimated_from_deeper_ones():
    p = LevelPolicy(configured=3, budget=1000 * MB, margin=0.0)
    assert p.fits(3, active=999 * MB, shadows=4)  # nothing measured: try it
    p.record_footprint(3, 100 * MB)
    assert p.estimate(1) == 100 * MB  # conservative until L1 is measured
    assert not p.fits(1, active=700 * MB, shadows=4)
    p.record_footprint(1, 10 * MB)
    assert p.fits(1, active=700 * MB, shadows=4)
