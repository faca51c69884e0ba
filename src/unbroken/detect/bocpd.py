"""Bayesian online change-point detection (Adams & MacKay 2007) over a scalar series.

The fail-slow detector watches the per-iteration time series with this. The model: the series
is a sequence of runs; within a run the values are i.i.d. normal with unknown mean and
precision under a normal-gamma prior, so each run's posterior predictive is a Student-t; a
new run starts before any point with constant hazard H. Per step the run-length posterior is
updated in O(run length), truncated at `max_run` (the longest kept run absorbs the one past
the bound), so a step costs O(max_run) whatever the job's length.

Why hand-written and not a PyPI package: the candidates in the package index (`bocpd` 0.0.4,
`bocd` 0.1.2, `bayesian-changepoint-detection` 0.2.dev1, `changepoint`, `bayescd`) are
unmaintained or offline-only, and none exposes what the detector needs: a snapshot of the
state to *remove* benign points again (ResiHP §5.2 drops a benign change point from the series)
and run-length truncation. The whole algorithm is ~100 lines of numpy.

Change-point rule. After point t, run length r means "the current run is the last r points"
(r = 0: the prior, a run starting at the next point). A change is declared when
P(min_run <= r_t <= lag) > threshold, or (late) P(lag < r_t <= R) > threshold where R is the
length of the longest run that began after the last declared change, at most `late`; it is
located at the first point of the most probable of those runs; each location is declared
once. min_run = 2
means one outlier never declares a change: the new level must hold for two points (a
persistent fail-slow is declared one iteration after it starts, ResiHP §8.4 reports 2-3).

[Note: late changes] With R = `lag` alone, a change whose evidence builds up more slowly than
`lag` points was never declared: by the time the new run was probable it was too long to count,
and it never became short again. On a noisy host (a 2-core machine running four ranks and their
shadows: 22% noise on the series) a 1.45x slowdown took 12-16 points to win the posterior and
the demo's slow rank went unreported for good. Counting the runs that began after the last
declared change, on their own, declares it late instead (and locates it where it began). The
late window is a second test, not a wider first one: added to the short runs' mass, the thin
tail of a stationary series' posterior over many long runs tipped a two-point dip over the
threshold. Runs that began before the last declared change never count, so a change is not
declared twice, and `late` bounds the window the caller must keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Bocpd", "BocpdConfig", "BocpdState", "ChangePoint"]


@dataclass(kw_only=True, slots=True)
class BocpdConfig:
    """Hazard, prior and decision rule of the detector (values are in the units fed in)."""

    hazard: float = 1.0 / 200.0
    """Prior probability that a new run starts before any point (1 / expected run length)."""
    max_run: int = 256
    """Run-length truncation: hypotheses longer than this are dropped (cost per step)."""
    mu0: float = 1.0
    """Prior mean of a run (the detector feeds times normalized by the warm-up median)."""
    kappa0: float = 0.1
    """Prior pseudo-count of the mean: small, so a new run may sit far from mu0."""
    alpha0: float = 1.0
    """Prior shape of the precision."""
    beta0: float = 1e-3
    """Prior rate of the precision (alpha0 * expected variance of a run)."""
    outlier_prob: float = 0.05
    """Share of points that are outliers of their run (robust likelihood, see module doc)."""
    outlier_density: float = 0.1
    """Flat density of an outlier: 1 / width of the range the fed values can take."""
    min_run: int = 2
    """Points a new run needs before it counts: 2 ignores one-point outliers."""
    lag: int = 5
    """Largest run length that always counts as 'a change just happened'."""
    late: int = 24
    """Largest run length that counts when it began after the last declared change ([Note:
    late changes]): a change whose evidence builds up slowly is declared late, not never."""
    threshold: float = 0.8
    """Posterior mass on run lengths min_run..lag (or, late, lag+1..R: module doc) needed to
    declare a change."""

    def __post_init__(self) -> None:
        if not 0.0 < self.hazard < 1.0:
            raise ValueError("bocpd.hazard must be in (0, 1)")
        if self.late < self.lag:
            raise ValueError("bocpd.late must be >= bocpd.lag")
        if self.max_run < self.late + 2:
            raise ValueError("bocpd.max_run must exceed bocpd.late + 1")
        if self.kappa0 <= 0 or self.alpha0 <= 0 or self.beta0 <= 0:
            raise ValueError("bocpd.kappa0, alpha0 and beta0 must be > 0")
        if not 0.0 <= self.outlier_prob < 1.0 or self.outlier_density <= 0:
            raise ValueError("bocpd.outlier_prob must be in [0, 1), outlier_density > 0")
        if not 1 <= self.min_run <= self.lag:
            raise ValueError("bocpd.min_run must be in [1, bocpd.lag]")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError("bocpd.threshold must be in (0, 1)")


@dataclass(frozen=True, slots=True)
class ChangePoint:
    """A declared change: the new run starts at point `index`; declared after point `at`."""

    index: int
    at: int
    probability: float


@dataclass(frozen=True, slots=True)
class BocpdState:
    """An immutable snapshot (restore it to forget the points fed after it)."""

    t: int
    log_p: np.ndarray
    mu: np.ndarray
    kappa: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    last_index: int


class Bocpd:
    """Online detector; feed points with `update`, one at a time."""

    def __init__(self, cfg: BocpdConfig | None = None) -> None:
        self.cfg = cfg or BocpdConfig()
        c = self.cfg
        self._log_h = math.log(c.hazard)
        self._log_1mh = math.log1p(-c.hazard)
        self.t = 0
        """Points fed so far (the index the next point gets)."""
        self.log_p = np.zeros(1)
        """Log run-length posterior; entry r = run length r."""
        self.mu = np.array([c.mu0])
        self.kappa = np.array([c.kappa0])
        self.alpha = np.array([c.alpha0])
        self.beta = np.array([c.beta0])
        self.last_index = -1
        """Location of the last declared change (each is declared once)."""

    def snapshot(self) -> BocpdState:
        return BocpdState(
            t=self.t,
            log_p=self.log_p.copy(),
            mu=self.mu.copy(),
            kappa=self.kappa.copy(),
            alpha=self.alpha.copy(),
            beta=self.beta.copy(),
            last_index=self.last_index,
        )

    def restore(self, s: BocpdState) -> None:
        self.t, self.last_index = s.t, s.last_index
        self.log_p, self.mu = s.log_p.copy(), s.mu.copy()
        self.kappa, self.alpha, self.beta = s.kappa.copy(), s.alpha.copy(), s.beta.copy()

    def _log_pred(self, x: float) -> np.ndarray:
        """Student-t log density of x under every run's posterior predictive."""
        nu = 2.0 * self.alpha
        scale2 = self.beta * (self.kappa + 1.0) / (self.alpha * self.kappa)
        z2 = (x - self.mu) ** 2 / scale2
        lg = np.array([math.lgamma(v / 2.0 + 0.5) - math.lgamma(v / 2.0) for v in nu])
        return lg - 0.5 * np.log(nu * math.pi * scale2) - (nu / 2.0 + 0.5) * np.log1p(z2 / nu)

    def run_length_posterior(self) -> np.ndarray:
        """P(r_t = r) for r = 0 .. len - 1."""
        return np.exp(self.log_p)

    def update(self, x: float) -> ChangePoint | None:
        """Feed one point; returns a change point the first time one is declared."""
        c = self.cfg
        inlier = self._log_pred(x) + math.log1p(-c.outlier_prob)
        if c.outlier_prob > 0:
            outlier = math.log(c.outlier_prob * c.outlier_density)
            pred = np.logaddexp(inlier, outlier)
            w = np.exp(inlier - pred)
        else:
            pred, w = inlier, np.ones_like(inlier)
        lp = self.log_p + pred
        grow = lp + self._log_1mh
        cp = np.logaddexp.reduce(lp) + self._log_h
        log_p = np.concatenate(([cp], grow))
        # Normal-gamma update of each run with x, weighted by P(x is not an outlier); run 0 =
        # the prior.
        kappa1 = self.kappa + w
        mu = np.concatenate(([c.mu0], (self.kappa * self.mu + w * x) / kappa1))
        beta = np.concatenate(
            ([c.beta0], self.beta + self.kappa * w * (x - self.mu) ** 2 / (2.0 * kappa1))
        )
        kappa = np.concatenate(([c.kappa0], kappa1))
        alpha = np.concatenate(([c.alpha0], self.alpha + 0.5 * w))
        if len(log_p) > c.max_run:
            # The longest kept run absorbs the one past the bound (it stands for "max_run - 1
            # points or more") with the likelier one's statistics. Dropping it instead handed
            # a long stationary run's mass to whatever young runs held the rest: after
            # max_run points, a change nobody made.
            k = c.max_run - 1
            keep = k if log_p[k] >= log_p[k + 1] else k + 1
            for a in (mu, kappa, alpha, beta):
                a[k] = a[keep]
            log_p[k] = np.logaddexp(log_p[k], log_p[k + 1])
            log_p, mu, kappa, alpha, beta = (
                a[: c.max_run] for a in (log_p, mu, kappa, alpha, beta)
            )
        log_p = log_p - np.logaddexp.reduce(log_p)
        self.log_p, self.mu, self.kappa, self.alpha, self.beta = log_p, mu, kappa, alpha, beta
        index = self.t
        self.t += 1
        # The short runs, as always; else the longer ones that began after the last declared
        # change ([Note: late changes]).
        first = c.min_run
        short = np.exp(log_p[first : c.lag + 1])
        mass = float(short.sum())
        if mass <= c.threshold:
            first = c.lag + 1
            short = np.exp(log_p[first : min(c.late, index - self.last_index) + 1])
            mass = float(short.sum())
            if mass <= c.threshold:
                return None
        r = int(np.argmax(short)) + first
        where = index - r + 1
        if where <= self.last_index:
            return None
        self.last_index = where
        return ChangePoint(index=where, at=index, probability=mass)
