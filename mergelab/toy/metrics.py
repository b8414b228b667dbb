"""Exact match, per-skill success and bootstrap confidence intervals for the toy studies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..eval.stats import bootstrap_ci
from .tasks import LetterMap


def exact_match(predictions: Sequence[str], targets: Sequence[str | None]) -> np.ndarray:
    """Per-example 0/1: prediction equals target exactly (an undefined target ``None`` counts 0)."""
    return np.array(
        [float(t is not None and p == t) for p, t in zip(predictions, targets, strict=True)]
    )


def skill_success(
    inputs: Sequence[str], predictions: Sequence[str], skill: LetterMap
) -> np.ndarray:
    """Per-example 0/1 over the examples the skill touches: every touched position rewritten.

    Only the positions where ``skill`` changes the input count (other positions are the joint
    exact match's business); examples without such a position are left out (empty array if none).
    """
    out = []
    for x, p in zip(inputs, predictions, strict=True):
        idx = [i for i, c in enumerate(x) if skill.touches(c)]
        if idx:
            out.append(float(len(p) == len(x) and all(p[i] == skill(x[i]) for i in idx)))
    return np.array(out)


def seed_bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    groups: Sequence[int] | None = None,
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap interval of per-example values, optionally two-level.

    With ``groups`` (the training seed of each example) and more than one group, the bootstrap
    resamples seeds, then examples within each drawn seed, so the interval carries seed-to-seed
    variation as well as test-set size. Otherwise it is the plain item bootstrap of
    :func:`mergelab.eval.stats.bootstrap_ci`. Returns ``(mean, low, high)``; NaNs if empty.
    """
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    g = None if groups is None else np.asarray(groups)
    if g is None or np.unique(g).size < 2:
        ci = bootstrap_ci(v, n_boot=n_boot, confidence=confidence, seed=seed)
        return ci["mean"], ci["low"], ci["high"]
    if g.shape != v.shape:
        raise ValueError(f"groups shape {g.shape} != values shape {v.shape}")
    rng = np.random.default_rng(seed)
    per = [v[g == k] for k in np.unique(g)]
    means = np.empty(n_boot)
    for b in range(n_boot):
        picked = rng.integers(0, len(per), size=len(per))
        means[b] = np.mean(
            np.concatenate([per[i][rng.integers(0, per[i].size, per[i].size)] for i in picked])
        )
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(v.mean()), float(lo), float(hi)
