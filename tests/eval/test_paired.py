"""igpo/eval/paired.py: Student-t quantiles against printed t-table values, the paired intervals worked by hand, and
the errors a comparison with missing or unpaired runs gets."""

import math
import statistics

import pytest

from igpo.eval.paired import detectable_difference, mean_interval, paired_difference, t_cdf, t_quantile


@pytest.mark.parametrize("p, df, table", [(0.975, 1, 12.706), (0.975, 4, 2.776), (0.975, 9, 2.262),
                                          (0.975, 29, 2.045), (0.8, 4, 0.941), (0.95, 7, 1.895)])
def test_t_quantiles_match_the_printed_table(p, df, table):
    assert t_quantile(p, df) == pytest.approx(table, abs=1e-3)
    assert t_quantile(1 - p, df) == pytest.approx(-table, abs=1e-3)
    assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-7)


def test_the_paired_interval_is_the_t_interval_of_the_per_seed_differences():
    method, baseline = [0.30, 0.25, 0.40, 0.35, 0.30], [0.20, 0.22, 0.30, 0.33, 0.25]
    result = paired_difference(method, baseline)
    # differences 0.10, 0.03, 0.10, 0.02, 0.05: mean 0.06, sd sqrt(0.0058 / 4) = 0.038079
    sd = math.sqrt(((0.04 ** 2) + (0.03 ** 2) + (0.04 ** 2) + (0.04 ** 2) + (0.01 ** 2)) / 4)
    assert result.n == 5 and result.mean == pytest.approx(0.06) and result.sd == pytest.approx(sd)
    half = 2.776445 * sd / math.sqrt(5)
    assert (result.t_low, result.t_high) == pytest.approx((0.06 - half, 0.06 + half), abs=1e-6)
    # The bootstrap means lie between the smallest and the largest difference, around the mean.
    assert 0.02 <= result.boot_low < 0.06 < result.boot_high <= 0.10
    assert paired_difference(method, baseline) == result  # seeded resampling
    assert "+0.060 [" in result.describe() and "n=5" in result.describe()


def test_unpaired_or_missing_values_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="pair them by seed"):
        paired_difference([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference([0.1], [0.2])
    with pytest.raises(ValueError, match="lacks the metric"):
        paired_difference([0.1, float("nan")], [0.2, 0.1])


def test_the_detectable_difference_shrinks_with_seeds_and_grows_with_spread():
    # n = 5, sd 0.04: (2.776 + 0.941) * 0.04 / sqrt(5) = 0.0665
    assert detectable_difference(0.04, 5) == pytest.approx(0.0665, abs=5e-4)
    assert detectable_difference(0.04, 10) < detectable_difference(0.04, 5) < detectable_difference(0.08, 5)


def test_mean_interval():
    mean, low, high = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and (low, high) == pytest.approx((2.0 - 4.303 / math.sqrt(3), 2.0 + 4.303 / math.sqrt(3)),
                                                         abs=1e-3)
    assert mean_interval([0.5]) == (0.5, 0.5, 0.5)


def test_the_paired_p_value_agrees_with_the_interval_and_the_t_table():
    import random

    from igpo.eval.paired import paired_t_p
    # df = 4, t = 2.776: the two-sided 5% point of the printed table.
    d = [1.0, -1.0, 1.0, -1.0, 0.0]
    sd = statistics.stdev(d)
    shift = 2.776445 * sd / math.sqrt(5)
    assert paired_t_p([x + shift for x in d], [0.0] * 5) == pytest.approx(0.05, abs=1e-5)
    rng = random.Random(3)
    for _ in range(50):
        m, b = [rng.gauss(0.1, 0.2) for _ in range(10)], [rng.gauss(0, 0.2) for _ in range(10)]
        interval = paired_difference(m, b)
        assert (paired_t_p(m, b) < 0.05) == (interval.t_low > 0 or interval.t_high < 0)
    assert paired_t_p([1, 2], [1, 2]) == 1.0 and paired_t_p([2, 3], [1, 2]) == 0.0
    with pytest.raises(ValueError, match="aligned by seed"):
        paired_t_p([1.0], [1.0])


def test_holm_adjusts_step_down_and_keeps_the_order():
    from igpo.eval.paired import holm
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert adjusted == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    assert holm({"x": 0.6, "y": 0.7}) == pytest.approx({"x": 1.0, "y": 1.0})
    assert holm({"only": 0.02}) == {"only": 0.02}
