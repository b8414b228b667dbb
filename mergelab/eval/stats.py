"""Honest uncertainty for benchmark scores.

* :func:`bootstrap_ci` — percentile bootstrap CI of a mean over items (seeded).
* :func:`paired_bootstrap` — CI of the difference of two candidates' means on the *same* items,
  resampling items jointly (keeps the pairing, so it is much tighter than two separate CIs).
* :func:`mcnemar_exact` — exact McNemar test on pass/fail pairs: only items where the two
  disagree count; p-value from Binomial(n_disagree, 1/2), two-sided.
* :func:`paired_comparison` — both, for two ``{item id: score}`` mappings on the ids they share,
  with the p-value to report: exact McNemar when every outcome is 0/1, else the bootstrap's.
* :func:`compare` — the same for two evaluation results (``EvalResult`` or their items).
* :func:`t_interval` — Student-t interval of a mean over a few independent replicates (e.g. one
  score per training seed), where resampling a handful of values would undercover.
* :func:`holm` — Holm's step-down adjustment of a family of p-values (family-wise error rate);
  a claim picked from many tests is judged by its adjusted p-value.
* :func:`tost_paired` — two one-sided tests of equivalence of two candidates on the same items
  within a margin stated in advance; without it, a non-significant difference is only "not
  distinguished", never "equal".
* :func:`mcnemar_power` / :func:`items_for_power` — the power of the exact McNemar test for a
  given difference and discordant-pair rate, and the test-set size that reaches a target power.

A difference like 39.4 vs 38.1 on MBPP+ (378 items) is about 5 items; whether that means anything
is exactly what these answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def _as_array(values: Sequence[float]) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"need a non-empty 1-D sequence of per-item scores, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("per-item scores contain NaN or inf")
    return a


def _bootstrap_means(a: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Chunked so 10k resamples of a few thousand items stay small in memory.
    out = np.empty(n_boot)
    chunk = max(1, 2_000_000 // a.size)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, a.size, size=(stop - start, a.size))
        out[start:stop] = a[idx].mean(axis=1)
    return out


def bootstrap_ci(
    values: Sequence[float], n_boot: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """Mean of per-item scores and its percentile bootstrap CI.

    Returns ``{"mean", "low", "high", "n", "confidence", "n_boot", "seed"}``; scores are in the
    units given (e.g. 0/1 per item → a fraction).
    """
    a = _as_array(values)
    means = _bootstrap_means(a, n_boot, seed)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return {
        "mean": float(a.mean()),
        "low": float(low),
        "high": float(high),
        "n": int(a.size),
        "confidence": confidence,
        "n_boot": n_boot,
        "seed": seed,
    }


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    n_boot: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """Mean difference ``a − b`` over paired items, its percentile CI, and a two-sided
    bootstrap p-value (twice the smaller tail mass at 0, capped at 1)."""
    xa, xb = _as_array(a), _as_array(b)
    if xa.shape != xb.shape:
        raise ValueError(f"paired scores need equal lengths, got {xa.size} and {xb.size}")
    d = xa - xb
    means = _bootstrap_means(d, n_boot, seed)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    p = min(1.0, 2.0 * min(np.mean(means <= 0.0), np.mean(means >= 0.0)))
    return {
        "mean_diff": float(d.mean()),
        "low": float(low),
        "high": float(high),
        "p_value": float(p),
        "n": int(d.size),
        "confidence": confidence,
        "n_boot": n_boot,
        "seed": seed,
    }


def mcnemar_exact(a: Sequence[bool], b: Sequence[bool]) -> dict[str, float]:
    """Exact McNemar test for paired pass/fail outcomes.

    ``a_only`` = items only ``a`` gets right, ``b_only`` = only ``b``; under H0 each
    disagreement is a fair coin, so p = P(Binomial(a_only + b_only, 1/2) as extreme), two-sided.
    """
    from scipy.stats import binomtest

    xa, xb = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if xa.shape != xb.shape or xa.ndim != 1:
        raise ValueError("mcnemar_exact needs two 1-D boolean sequences of equal length")
    a_only = int(np.sum(xa & ~xb))
    b_only = int(np.sum(~xa & xb))
    n = a_only + b_only
    p = 1.0 if n == 0 else float(binomtest(a_only, n, 0.5, alternative="two-sided").pvalue)
    return {
        "a_only": a_only,
        "b_only": b_only,
        "both": int(np.sum(xa & xb)),
        "neither": int(np.sum(~xa & ~xb)),
        "p_value": p,
    }


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """``mean ± t(½ + confidence/2, n − 1) · sd / √n`` over ``values`` (``sd`` with ``n − 1``
    in the denominator); ``(nan, nan)`` for fewer than two values. NaN values propagate."""
    from scipy.stats import t

    a = np.asarray(values, dtype=np.float64)
    if a.size < 2:
        return float("nan"), float("nan")
    half = t.ppf(0.5 + confidence / 2, a.size - 1) * a.std(ddof=1) / np.sqrt(a.size)
    return float(a.mean() - half), float(a.mean() + half)


def is_binary(values: Sequence[float]) -> bool:
    """Whether every per-item outcome is 0 or 1 (pass/fail), the case McNemar's test is for."""
    return all(v in (0.0, 1.0) for v in values)


def paired_comparison(
    a: Mapping[str, float],
    b: Mapping[str, float],
    n_boot: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """``a − b`` on the item ids both have, in ``a``'s order (the bootstrap resamples positions).

    Returns ``n``, ``mean_a``, ``mean_b``, ``paired_bootstrap``, ``mcnemar`` (when every outcome
    is 0/1), and ``p_value`` with ``p_value_kind``: the exact McNemar p-value for binary
    outcomes, else the paired bootstrap's.
    """
    ids = [i for i in a if i in b]
    if not ids:
        raise ValueError("the two results share no items")
    xa, xb = [float(a[i]) for i in ids], [float(b[i]) for i in ids]
    out: dict[str, Any] = {
        "n": len(ids),
        "mean_a": float(np.mean(xa)),
        "mean_b": float(np.mean(xb)),
        "paired_bootstrap": paired_bootstrap(xa, xb, n_boot, confidence, seed),
    }
    if is_binary(xa + xb):
        out["mcnemar"] = mcnemar_exact([v == 1.0 for v in xa], [v == 1.0 for v in xb])
        out["p_value"] = out["mcnemar"]["p_value"]
        out["p_value_kind"] = "exact McNemar (binary outcomes)"
    else:
        out["p_value"] = out["paired_bootstrap"]["p_value"]
        out["p_value_kind"] = "paired bootstrap (outcomes not binary)"
    return out


def compare(
    result_a: Any,
    result_b: Any,
    metric: str | None = None,
    n_boot: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, Any]:
    """Paired comparison of two evaluation results (``EvalResult`` or their ``items`` lists)
    on the items they share, by ``item_id``. ``metric`` defaults to the results' primary metric.

    Returns ``metric``, ``n_shared`` and :func:`paired_comparison`'s fields (the paired bootstrap
    of the difference a − b and, when all per-item scores are 0/1, the exact McNemar test).
    """
    items_a = getattr(result_a, "items", result_a)
    items_b = getattr(result_b, "items", result_b)
    metric = metric or getattr(result_a, "primary_metric", None) or "score"
    scores_a = {it["item_id"]: float(it["scores"][metric]) for it in items_a}
    scores_b = {it["item_id"]: float(it["scores"][metric]) for it in items_b}
    out = paired_comparison(scores_a, scores_b, n_boot, confidence, seed)
    return {"metric": metric, "n_shared": out["n"], **out}


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values of one family of tests (same keys): sort ascending,
    multiply the i-th smallest (0-based) by ``m − i``, make the sequence non-decreasing, cap at 1.
    Rejecting where the adjusted p ≤ α keeps the family-wise error rate at α."""
    keys = sorted(p_values, key=lambda k: p_values[k])
    m, running, out = len(keys), 0.0, {}
    for i, k in enumerate(keys):
        p = float(p_values[k])
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p-value of {k!r} is {p}, not in [0, 1]")
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return {k: out[k] for k in p_values}


def tost_paired(
    a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05
) -> dict[str, Any]:
    """Two one-sided paired t-tests of |mean(a − b)| < ``margin`` (same items, in order).

    ``p_value`` is the larger one-sided p; equivalence is shown when it is ≤ ``alpha`` — the same
    as the (1 − 2α) t-interval of the mean difference lying inside (−margin, margin), which is
    returned too. The margin must be fixed before looking at the data."""
    from scipy.stats import t as student_t

    xa, xb = _as_array(a), _as_array(b)
    if xa.shape != xb.shape:
        raise ValueError("tost_paired needs two sequences of equal length")
    if margin <= 0:
        raise ValueError(f"margin must be positive, got {margin}")
    d = xa - xb
    n = d.size
    if n < 2:
        raise ValueError("tost_paired needs at least 2 pairs")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    se = sd / np.sqrt(n)
    if se == 0.0:  # every pair differs by the same amount: equivalent iff inside the margin
        p_lower = p_upper = 0.0 if abs(mean) < margin else 1.0
        low = high = mean
    else:
        p_lower = float(student_t.sf((mean + margin) / se, n - 1))  # H0: mean ≤ −margin
        p_upper = float(student_t.cdf((mean - margin) / se, n - 1))  # H0: mean ≥ +margin
        q = float(student_t.ppf(1 - alpha, n - 1))
        low, high = mean - q * se, mean + q * se
    p = max(p_lower, p_upper)
    return {
        "n": n,
        "mean_diff": mean,
        "margin": margin,
        "alpha": alpha,
        "interval": [low, high],
        "interval_level": 1 - 2 * alpha,
        "p_lower": p_lower,
        "p_upper": p_upper,
        "p_value": p,
        "equivalent": p <= alpha,
    }


def _mcnemar_rejects(n_discordant: int, alpha: float) -> np.ndarray:
    """For each count k = 0..n of discordant pairs won by the first candidate, whether the
    two-sided exact McNemar test rejects at ``alpha``."""
    from scipy.stats import binom

    k = np.arange(n_discordant + 1)
    lower = binom.cdf(np.minimum(k, n_discordant - k), n_discordant, 0.5)
    return np.minimum(1.0, 2.0 * lower) <= alpha


def mcnemar_power(n: int, discordant_rate: float, difference: float, alpha: float = 0.05) -> float:
    """Power of the two-sided exact McNemar test on ``n`` paired items when a fraction
    ``discordant_rate`` of the pairs disagree and the accuracies differ by ``difference``
    (so p10 = (rate + difference)/2, p01 = (rate − difference)/2): the sum over the number of
    discordant pairs D ~ Binomial(n, rate) of P(the test rejects | D), the split of the D pairs
    being Binomial(D, p10 / rate). Exact (no normal approximation)."""
    from scipy.stats import binom

    if not 0 < difference <= discordant_rate <= 1:
        raise ValueError(
            f"need 0 < difference ≤ discordant_rate ≤ 1, got {difference} and {discordant_rate}"
        )
    q = (discordant_rate + difference) / (2 * discordant_rate)
    power = 0.0
    for d in range(1, n + 1):
        weight = float(binom.pmf(d, n, discordant_rate))
        if weight < 1e-15:
            continue
        rejects = _mcnemar_rejects(d, alpha)
        power += weight * float(binom.pmf(np.arange(d + 1), d, q)[rejects].sum())
    return power


def items_for_power(
    discordant_rate: float,
    difference: float,
    power: float = 0.8,
    alpha: float = 0.05,
    max_items: int = 5000,
) -> int:
    """The fewest paired items at which :func:`mcnemar_power` reaches ``power``. The power of an
    exact test is not monotone in n (it saw-tooths), so this is the first n that reaches it and
    every n from there up to 20 % more also do."""
    n = 2
    while n <= max_items:
        if mcnemar_power(n, discordant_rate, difference, alpha) >= power and all(
            mcnemar_power(m, discordant_rate, difference, alpha) >= power
            for m in range(n + 1, n + 1 + n // 5, max(1, n // 50))
        ):
            return n
        n += 1
    raise ValueError(f"power {power} is not reached within {max_items} items")
