import numpy as np
import pytest

from unbroken.detect.workload import DataParallelSchedule, MicroBatchModel, WorkloadPredictor

from .synth import ALPHA, BETA, mb_time, split


def test_fit_recovers_alpha_and_beta():
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(60):
        d = split(rng, int(rng.integers(1, 6)))
        samples.append((d, mb_time(d) * (1 + 0.002 * rng.standard_normal())))
    m = MicroBatchModel.fit(samples)
    assert m.alpha == pytest.approx(ALPHA, rel=0.02)
    assert m.beta == pytest.approx(BETA, rel=0.02)


def test_fit_without_spread_in_sum_sq_predicts_the_median():
    m = MicroBatchModel.fit([((2048,), 1.0), ((2048,), 1.2), ((2048,), 3.0)])
    assert m.beta == 0.0
    assert m.predict((2048,)) == pytest.approx(1.2)


def test_a_negative_cost_is_never_fitted():
    # Only short documents, sum l^2 barely varying, and noise that slopes the wrong way: the
    # fit must not extrapolate to negative times for a long document.
    short = (128,) * 16
    shorter = (128,) * 15 + (64, 64)
    m = MicroBatchModel.fit([(short, 0.030), (short, 0.031), (shorter, 0.034), (shorter, 0.035)])
    assert m.beta == 0.0 and m.alpha > 0
    assert m.predict((2048,)) == pytest.approx(m.predict(short))
    assert m.predict(short) > 0


def test_fit_is_not_pulled_up_by_one_sided_outliers():
    # A fifth of the micro-batches were preempted (2x their time): the healthy model stays.
    rng = np.random.default_rng(1)
    samples = []
    for i in range(100):
        d = split(rng, int(rng.integers(1, 6)))
        samples.append((d, mb_time(d) * (2.0 if i % 5 == 0 else 1.0)))
    m = MicroBatchModel.fit(samples)
    assert m.alpha == pytest.approx(ALPHA, rel=0.02)
    assert m.beta == pytest.approx(BETA, rel=0.02)


def test_data_parallel_iteration_is_max_of_replica_sums_plus_sync():
    sched = DataParallelSchedule(sync_s=0.5)
    assert sched.iteration_time([[1.0, 2.0], [4.0]]) == 4.5


def test_predictor_fits_the_sync_constant():
    mb = [((1024, 1024), 0.3), ((2048,), 0.5), ((512, 1536), 0.35)]
    lengths = [[(2048,), (2048,)], [(1024, 1024), (2048,)]]
    p = WorkloadPredictor.fit_data_parallel(mb, [(lengths, 1.25)] * 3)
    assert p.iteration_time(lengths) == pytest.approx(1.25, rel=1e-6)
