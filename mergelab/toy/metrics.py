"""Exact match, per-skill success and bootstrap confidence intervals for the toy studies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tasks import LetterMap


def exact_match(predictions: Sequence[str], targets: Sequence[str | None]) -> np.ndarray:
    """Per-example 0/1: prediction equals target exactly (an undefined target ``None`` counts 0)."""
    return np.array([float(t is not None and p == t) for p, t in zip(predictions, targets, strict=True)])


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


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    groups: Sequence[int] | None = None,
    n_boot: int = 1000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean and percentile-bootstrap ``(1 - alpha)`` interval of per-example values.

    With ``groups`` (e.g. the training seed of each example) the bootstrap is two-level: resample
    seeds, then examples within each drawn seed, so the interval reflects seed-to-seed variation
    as well as test-set size. Returns ``(mean, low, high)``; NaNs if ``values`` is empty.
    """
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    if groups is None:
        draws = rng.integers(0, v.size, size=(n_boot, v.size))
        means = v[draws].mean(1)
    else:
        g = np.asarray(groups)
        if g.shape != v.shape:
            raise ValueError(f"groups shape {g.shape} != values shape {v.shape}")
        per = [v[g == k] for k in np.unique(g)]
        means = np.empty(n_boot)
        for b in range(n_boot):
            picked = rng.integers(0, len(per), size=len(per))
            means[b] = np.mean(
                np.concatenate([per[i][rng.integers(0, per[i].size, per[i].size)] for i in picked])
            )
    lo, hi = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(v.mean()), float(lo), float(hi)
