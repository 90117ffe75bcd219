"""Paired comparisons over seeds: a method against a baseline run at the same seeds
(``scripts/experiments/compare_methods.py``).

Runs at one seed share the first step (one seed feeds every random source), so the per-seed difference
d_s = m_s - b_s removes the seed's own luck; with n seeds, d̄ = mean(d_s) and s_d = stdev(d_s):

    paired t interval:     d̄ ± t_{1-α/2, n-1} · s_d / √n
    bootstrap interval:    the α/2 and 1-α/2 quantiles of mean(d_s*) over resamples of the n differences with
                           replacement (percentile method; with 5 seeds it is narrower than t and reported beside it)
    detectable difference: (t_{1-α/2, n-1} + t_{power, n-1}) · s_d / √n, the true difference that a two-sided paired t
                           test at level α finds with probability ``power`` (normal-approximation form with t quantiles)

The Student-t quantiles are computed here (no scipy in the environment): the CDF by Simpson's rule over the density
on [0, t], inverted by bisection; accurate to ~1e-7 for the degrees of freedom a seed count gives.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Sequence


def _t_density(x: float, df: int) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"t_cdf: df={df}; it needs at least 1 degree of freedom (two seeds)")
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    # Simpson's rule on [0, x] with the substitution-free density; 2,000 panels are ample below |x| ~ 50.
    panels = 2000
    h = x / panels
    total = _t_density(0.0, df) + _t_density(x, df)
    total += 4 * sum(_t_density((2 * i - 1) * h, df) for i in range(1, panels // 2 + 1))
    total += 2 * sum(_t_density(2 * i * h, df) for i in range(1, panels // 2))
    return 0.5 + total * h / 3


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0 < p < 1)."""
    if not 0 < p < 1:
        raise ValueError(f"t_quantile: p={p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
        if high > 1e6:
            raise ValueError(f"t_quantile: p={p} is too close to 1 for df={df}")
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class PairedDifference:
    """Method minus baseline over paired seeds: the mean difference, its two 95% (or ``confidence``) intervals,
    the differences' standard deviation and the seed count."""

    n: int
    mean: float
    sd: float
    t_low: float
    t_high: float
    boot_low: float
    boot_high: float

    def describe(self, digits: int = 3) -> str:
        return (f"{self.mean:+.{digits}f} [{self.t_low:+.{digits}f}, {self.t_high:+.{digits}f}] "
                f"(bootstrap [{self.boot_low:+.{digits}f}, {self.boot_high:+.{digits}f}], n={self.n})")


def paired_difference(method: Sequence[float], baseline: Sequence[float], confidence: float = 0.95,
                      resamples: int = 10_000, seed: int = 0) -> PairedDifference:
    """Paired t and bootstrap intervals of mean(method - baseline); the two sequences are aligned by seed."""
    if len(method) != len(baseline):
        raise ValueError(f"paired_difference: {len(method)} method values against {len(baseline)} baseline values; "
                         "pair them by seed (the same seeds, in the same order)")
    diffs = [m - b for m, b in zip(method, baseline)]
    if len(diffs) < 2:
        raise ValueError(f"paired_difference: {len(diffs)} paired seed(s); an interval needs at least 2")
    if not all(math.isfinite(d) for d in diffs):
        raise ValueError(f"paired_difference: a difference is not finite ({diffs}); a run lacks the metric")
    n, mean, sd = len(diffs), statistics.fmean(diffs), statistics.stdev(diffs)
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * sd / math.sqrt(n)
    boot_low, boot_high = bootstrap_interval(diffs, confidence, resamples, seed)
    return PairedDifference(n, mean, sd, mean - half, mean + half, boot_low, boot_high)


def bootstrap_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap interval of mean(``values``): the (1 - confidence)/2 and 1 - (1 - confidence)/2
    quantiles of the means of ``resamples`` resamples with replacement (seeded)."""
    rng, n = random.Random(seed), len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return means[int(math.floor(tail * (resamples - 1)))], means[int(math.ceil((1 - tail) * (resamples - 1)))]


def detectable_difference(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true paired difference a two-sided paired t test at level ``alpha`` detects with probability
    ``power``, for paired differences of standard deviation ``sd`` over ``n`` seeds."""
    if n < 2:
        raise ValueError(f"detectable_difference: n={n} seeds; it needs at least 2")
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of the mean of ``values`` (one value: the interval is the point)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = t_quantile(1 - (1 - confidence) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def paired_t_p(method: Sequence[float], baseline: Sequence[float]) -> float:
    """The two-sided p-value of the paired t test of mean(method - baseline) = 0 (1.0 when every difference is 0; 0.0
    when they are all equal and not 0: no spread, nothing to test against)."""
    if len(method) != len(baseline) or len(method) < 2:
        raise ValueError(f"paired_t_p: {len(method)} method and {len(baseline)} baseline values; give at least 2 "
                         "pairs, aligned by seed")
    diffs = [m - b for m, b in zip(method, baseline)]
    if not all(math.isfinite(d) for d in diffs):
        raise ValueError(f"paired_t_p: a difference is not finite ({diffs}); a run lacks the metric")
    n, mean, sd = len(diffs), statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (sd / math.sqrt(n))
    return max(0.0, min(1.0, 2 * (1 - t_cdf(t, n - 1))))


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values over a family of tests (name -> raw p): sorted ascending, the k-th smallest
    (k = 0..m-1) is multiplied by m - k, made non-decreasing along the order and capped at 1. A test is rejected at
    family-wise level α exactly when its adjusted p-value is <= α."""
    order = sorted(p_values, key=lambda name: p_values[name])
    m, adjusted, running = len(order), {}, 0.0
    for k, name in enumerate(order):
        running = max(running, min(1.0, (m - k) * p_values[name]))
        adjusted[name] = running
    return adjusted
