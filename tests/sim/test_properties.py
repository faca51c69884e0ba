"""Properties of the queue model and the discrete-event replay (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.sim.des import Failure, simulate_once
from unbroken.sim.itertime import bucket_exposure
from unbroken.sim.policy import KindCost, PolicyTerms

times = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)
sizes = st.floats(min_value=1.0, max_value=1e9, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(times, sizes), min_size=1, max_size=30), times)
def test_exposure_is_between_last_bucket_and_all_buckets(buckets, window):
    w = tuple(b[0] for b in buckets)
    p = tuple(b[1] for b in buckets)
    exposed, finish = bucket_exposure(w, p, window)
    assert -1e-9 <= exposed <= sum(w) + 1e-9
    # The last bucket is ready at W at the earliest, so at least its transfer is exposed.
    assert exposed >= w[-1] - 1e-9
    assert finish >= window - 1e-9 or exposed == 0.0


def _terms(interval: int, rollback: bool) -> PolicyTerms:
    cost = KindCost(detect_s=1.0, init_s=5.0, lost_iters=0.0, rollback=rollback)
    return PolicyTerms(
        policy="p",
        applicable=True,
        reason="",
        t_iter_s=2.0,
        omega=0.0,
        t_ckpt_s=0.5,
        interval=interval,
        usable_lag=1,
        costs={"hof": cost, "fatal": cost, "fail-slow": cost},
    )


failure_times = st.lists(st.floats(min_value=0.0, max_value=900.0), max_size=12)


@settings(max_examples=100, deadline=None)
@given(failure_times, st.integers(min_value=1, max_value=20))
def test_replay_invariants(ts, interval):
    trace = [Failure(t, "fatal") for t in ts]
    keep = simulate_once(_terms(interval, False), trace=trace, horizon_s=1000.0)
    roll = simulate_once(_terms(interval, True), trace=trace, horizon_s=1000.0)
    clean = simulate_once(_terms(interval, True), trace=[], horizon_s=1000.0)
    for run in (keep, roll, clean):
        assert 0.0 <= run.ettr <= 1.0
    # Keeping progress never loses to rolling back; failures never help.
    assert roll.iterations <= keep.iterations <= clean.iterations
    assert sum(keep.failures.values()) == len(ts)
