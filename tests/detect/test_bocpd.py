import numpy as np
import pytest

from unbroken.detect.bocpd import Bocpd, BocpdConfig


def _run(xs, sd=0.03, **kw):
    b = Bocpd(BocpdConfig(beta0=sd**2, **kw))
    return [cp for x in xs if (cp := b.update(float(x))) and cp.index > 0]


def test_finds_a_step_within_two_points():
    rng = np.random.default_rng(1)
    xs = np.r_[1 + 0.03 * rng.standard_normal(50), 1.5 + 0.03 * rng.standard_normal(20)]
    cps = _run(xs)
    assert len(cps) == 1
    assert abs(cps[0].index - 50) <= 1
    assert cps[0].at - 50 <= 2


@pytest.mark.parametrize("seed", range(5))
def test_stationary_noise_and_single_outliers_raise_nothing(seed):
    rng = np.random.default_rng(seed)
    xs = 1 + 0.05 * rng.standard_normal(200)
    xs[[30, 90, 150]] *= 1.6  # isolated spikes: one point is not a change
    assert _run(xs, sd=0.05) == []


def test_snapshot_restore_forgets_points():
    b = Bocpd(BocpdConfig(beta0=1e-3))
    for x in [1.0, 1.01, 0.99, 1.0]:
        b.update(x)
    snap = b.snapshot()
    before = b.run_length_posterior().copy()
    b.update(5.0)
    b.update(5.0)
    b.restore(snap)
    assert b.t == 4
    np.testing.assert_allclose(b.run_length_posterior(), before)


def test_truncation_bounds_the_state():
    b = Bocpd(BocpdConfig(max_run=16))
    for _ in range(100):
        b.update(1.0)
    assert len(b.run_length_posterior()) == 16
    assert b.run_length_posterior().sum() == pytest.approx(1.0)


def test_config_is_validated():
    with pytest.raises(ValueError, match="hazard"):
        BocpdConfig(hazard=0.0)
    with pytest.raises(ValueError, match="min_run"):
        BocpdConfig(min_run=5, lag=3)
