"""Bootstrap CIs and paired comparisons: seeded, correct against closed forms and scipy."""

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from mergelab.eval.stats import bootstrap_ci, compare, mcnemar_exact, paired_bootstrap


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    rng = np.random.default_rng(1)
    x = (rng.random(200) < 0.3).astype(float)
    a = bootstrap_ci(x, n_boot=4000, seed=7)
    b = bootstrap_ci(x, n_boot=4000, seed=7)
    c = bootstrap_ci(x, n_boot=4000, seed=8)
    assert a == b and a != c
    assert a["low"] < a["mean"] < a["high"]
    assert a["mean"] == pytest.approx(x.mean())


def test_bootstrap_ci_width_matches_the_binomial_standard_error():
    # For a proportion p over n items, the 95% CI is about ±1.96·sqrt(p(1−p)/n).
    n, p = 400, 0.4
    x = np.array([1.0] * int(n * p) + [0.0] * int(n * (1 - p)))
    ci = bootstrap_ci(x, n_boot=10_000, seed=0)
    half_width = (ci["high"] - ci["low"]) / 2
    assert half_width == pytest.approx(1.96 * np.sqrt(p * (1 - p) / n), rel=0.08)


def test_bootstrap_ci_coverage_is_close_to_nominal():
    rng = np.random.default_rng(0)
    covered = 0
    for trial in range(200):
        x = (rng.random(150) < 0.35).astype(float)
        ci = bootstrap_ci(x, n_boot=1000, seed=trial)
        covered += ci["low"] <= 0.35 <= ci["high"]
    assert 0.88 <= covered / 200 <= 0.99


def test_paired_bootstrap_is_tighter_than_unpaired_when_correlated():
    rng = np.random.default_rng(3)
    base = (rng.random(300) < 0.5).astype(float)
    flip = rng.random(300) < 0.06  # b differs from a on ~6% of items
    a, b = base, np.where(flip, 1 - base, base)
    paired = paired_bootstrap(a, b, n_boot=4000, seed=0)
    assert paired["mean_diff"] == pytest.approx(a.mean() - b.mean())
    ci_a, ci_b = bootstrap_ci(a, n_boot=4000), bootstrap_ci(b, n_boot=4000)
    assert paired["high"] - paired["low"] < 0.5 * (
        (ci_a["high"] - ci_a["low"]) + (ci_b["high"] - ci_b["low"])
    )
    identical = paired_bootstrap(a, a, n_boot=500)
    assert identical["mean_diff"] == identical["low"] == identical["high"] == 0.0
    assert identical["p_value"] == 1.0
    clearly = paired_bootstrap(np.ones(100), np.zeros(100), n_boot=500)
    assert clearly["p_value"] == 0.0


def test_mcnemar_exact_matches_the_binomial_test():
    a = np.array([1] * 30 + [1] * 12 + [0] * 4 + [0] * 54, dtype=bool)
    b = np.array([1] * 30 + [0] * 12 + [1] * 4 + [0] * 54, dtype=bool)
    res = mcnemar_exact(a, b)
    assert (res["a_only"], res["b_only"], res["both"], res["neither"]) == (12, 4, 30, 54)
    assert res["p_value"] == pytest.approx(binomtest(12, 16, 0.5).pvalue)
    assert res["p_value"] == pytest.approx(0.0768, abs=1e-4)  # exact two-sided value
    assert mcnemar_exact(a, a)["p_value"] == 1.0


def test_compare_aligns_items_by_id_and_rejects_bad_input():
    items_a = [{"item_id": str(i), "scores": {"accuracy": float(i % 2)}} for i in range(10)]
    items_b = [{"item_id": str(i), "scores": {"accuracy": 1.0}} for i in reversed(range(12))]
    out = compare(items_a, items_b, metric="accuracy", n_boot=500)
    assert out["n_shared"] == 10 and out["mean_a"] == 0.5 and out["mean_b"] == 1.0
    assert out["mcnemar"]["b_only"] == 5 and out["mcnemar"]["a_only"] == 0
    with pytest.raises(ValueError, match="share no items"):
        compare(items_a, [{"item_id": "x", "scores": {"accuracy": 1.0}}], metric="accuracy")
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap([1, 0], [1])
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_ci([1.0, float("nan")])
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_ci([])


def test_one_paired_comparison_for_results_and_score_mappings():
    """``compare`` (evaluation results) is ``paired_comparison`` (score mappings) on the same
    items: one implementation, the reported p-value McNemar's for 0/1 outcomes."""
    from mergelab.eval.stats import paired_comparison

    a = {str(i): float(i % 3 == 0) for i in range(30)}
    b = {str(i): float(i % 2 == 0) for i in reversed(range(32))}
    items = lambda d: [{"item_id": k, "scores": {"accuracy": v}} for k, v in d.items()]  # noqa: E731
    out = compare(items(a), items(b), metric="accuracy", n_boot=700, seed=5)
    direct = paired_comparison(a, b, n_boot=700, seed=5)
    assert out == {"metric": "accuracy", "n_shared": 30, **direct}
    assert direct["n"] == 30 and direct["p_value"] == direct["mcnemar"]["p_value"]
    assert direct["p_value_kind"].startswith("exact McNemar")
    graded = paired_comparison({"x": 0.5, "y": 1.0, "z": 0.0}, {"x": 0.0, "y": 1.0, "z": 0.0})
    assert "mcnemar" not in graded
    assert graded["p_value"] == graded["paired_bootstrap"]["p_value"]
    with pytest.raises(ValueError, match="share no items"):
        paired_comparison({"x": 1.0}, {"y": 1.0})


def test_t_interval_against_hand_computed_values():
    from mergelab.eval.stats import t_interval

    # mean 0.82, sd 0.02, n 3: half-width t(0.975, 2) · 0.02 / √3 = 4.302653 · 0.011547 = 0.049683
    low, high = t_interval([0.80, 0.82, 0.84])
    assert (low, high) == pytest.approx((0.770317, 0.869683), abs=1e-6)
    assert t_interval([0.5, 0.5]) == (0.5, 0.5)
    assert all(math.isnan(v) for v in t_interval([0.7]))
    assert t_interval([0.0, 1.0], confidence=0.5) == pytest.approx((0.0, 1.0))  # t(0.75, 1) = 1


def test_holm_against_a_hand_computation():
    from mergelab.eval.stats import holm

    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → monotone 0.06
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    assert adjusted == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06, "d": 0.02})
    assert list(adjusted) == ["a", "b", "c", "d"]  # the caller's order
    assert holm({"x": 0.7, "y": 0.6}) == pytest.approx({"x": 1.0, "y": 1.0})  # capped at 1
    with pytest.raises(ValueError, match="not in"):
        holm({"x": 1.5})


def test_mcnemar_power_matches_a_simulation_of_the_test():
    from mergelab.eval.stats import mcnemar_power

    n, rate, diff = 60, 0.3, 0.15
    rng = np.random.default_rng(0)
    p10, p01 = (rate + diff) / 2, (rate - diff) / 2
    rejected = 0
    trials = 2000
    for _ in range(trials):
        cells = rng.multinomial(n, [p10, p01, 1 - rate])
        d = cells[0] + cells[1]
        rejected += d > 0 and binomtest(int(cells[0]), int(d), 0.5).pvalue <= 0.05
    simulated = rejected / trials
    exact = mcnemar_power(n, rate, diff)
    assert abs(exact - simulated) < 3 * math.sqrt(exact * (1 - exact) / trials) + 0.005
    # more items, more power; more discordant pairs for the same difference, less power
    assert mcnemar_power(120, rate, diff) > exact > mcnemar_power(60, 0.45, diff)
    with pytest.raises(ValueError, match="difference"):
        mcnemar_power(60, 0.1, 0.15)


def test_items_for_power_is_the_first_size_that_reaches_it():
    from mergelab.eval.stats import items_for_power, mcnemar_power

    n = items_for_power(0.25, 0.15)
    assert mcnemar_power(n, 0.25, 0.15) >= 0.8 > mcnemar_power(n - 1, 0.25, 0.15)
    assert 80 < n < 110  # the normal approximation's (z.975·√r + z.8·√(r − d²))² / d² ≈ 85
    assert items_for_power(0.4, 0.15) > n


def test_tost_paired_shows_equivalence_only_inside_the_margin():
    from scipy.stats import ttest_1samp

    from mergelab.eval.stats import tost_paired

    rng = np.random.default_rng(1)
    a = (rng.random(400) < 0.6).astype(float)
    same = a.copy()
    same[:8] = 1 - same[:8]  # a few items flipped: a difference near zero
    close = tost_paired(a, same, margin=0.1)
    assert close["equivalent"] and close["interval"][0] > -0.1 and close["interval"][1] < 0.1
    # each one-sided p is a one-sample t-test of the differences shifted by the margin
    d = a - same
    lower = ttest_1samp(d + 0.1, 0.0, alternative="greater").pvalue
    upper = ttest_1samp(d - 0.1, 0.0, alternative="less").pvalue
    assert close["p_lower"] == pytest.approx(lower) and close["p_upper"] == pytest.approx(upper)
    far = np.where(rng.random(400) < 0.25, 0.0, a)  # about 15 points lower
    assert not tost_paired(a, far, margin=0.1)["equivalent"]
    assert not tost_paired(a[:20], same[:20], margin=0.1)["equivalent"]  # 8 of 20 differ
    with pytest.raises(ValueError, match="margin"):
        tost_paired(a, same, margin=0.0)
