"""The merge methods mergekit users reach for beyond the classics, pinned to mergekit 0.1.5.

Each is registered under mergekit's method name with mergekit's parameter names (``lambda`` is
``lambda_`` in Python), so a mergekit config maps onto it one to one. Conventions are those of
:mod:`mergelab.merge.methods.standard`: ``base`` is θ_b, ``experts`` are θ_i, τ_i = θ_i − θ_b, every tensor
arrives in the compute dtype and has the parameter's shape ``S``; the result has shape ``S``.

Where mergekit departs from the method's paper (DELLA's rescaling) the paper's variant is the
default and mergekit's is a documented parameter value. Methods that exist only in mergekit
(nuslerp, multislerp, nearswap, arcee_fusion, passthrough; karcher, whose paper's code is
mergekit's) follow mergekit. Three mapping rules for a mergekit config: ``rescale: true`` is
``rescale="l1"`` here (``false``: ``"none"``); ``int8_mask`` only changes mergekit's mask dtype,
never a value; a mergekit base model given to a method that ignores bases (karcher, passthrough,
linear) is, in mergekit, one more input model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..registry import Interval, TensorContext, merge_method
from . import interpolation, steps
from .steps import DareRescale, add_scaled_, elect_merge, weighted_sum

_POSITIVE = Interval(0.0, math.inf, low_open=True)
_MAGPRUNE_RANGES = {
    # density 0 would keep nothing (the merge would be the base): a positive fraction is required.
    "density": Interval(0.0, 1.0, low_open=True),
    "epsilon": Interval(0.0, 0.5, high_open=True),
}


def _magprune_check(method: str) -> Callable[[dict[str, Any]], None]:
    """Refuse keep probabilities density ± epsilon outside (0, 1), as mergekit does."""

    def check(params: dict[str, Any]) -> None:
        for i, (d, e) in enumerate(zip(params["density"], params["epsilon"])):
            if d < 1 and not (d - e > 0 and d + e < 1):
                raise ValueError(
                    f"merge method {method!r}: model {i} has density {d:g} and epsilon {e:g}, "
                    "but the keep probabilities density ± epsilon must lie inside (0, 1)"
                )

    return check


def _magprune(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    density: list[float],
    epsilon: list[float],
    rescale: DareRescale,
    ctx: TensorContext,
) -> torch.Tensor:
    """Stack ``[n, *S]`` of MAGPRUNE-d task vectors, drawn from ``ctx.generator()`` in order."""
    tv = steps.task_vectors(base, experts)
    generator = ctx.generator(base.device)
    for tau, d, e in zip(tv, density, epsilon):
        steps.magprune_(tau, d, e, generator, rescale)
    return tv


_MAGPRUNE_DOC = """\
    MAGPRUNE (``steps.magprune_``) drops each entry of τ_i at random, keeping it with probability
    density_i − epsilon_i for the smallest |τ| of its row up to density_i + epsilon_i for the
    largest (linear in the rank; a 1-D τ is one row), then rescales the survivors:
    ``rescale="keep_rate"`` divides each by its own keep probability (DELLA paper and its
    authors' code), ``"l1"`` restores τ_i's pre-drop L1 norm (mergekit's ``rescale: true``, its
    default), ``"none"`` (mergekit's ``rescale: false``). ``epsilon`` is mergekit's half-width of
    the probability window (the DELLA authors' code takes the full width, 2 · epsilon, as its
    ``window_size``); density ± epsilon must lie in (0, 1). Draws come from a generator seeded by (seed, tensor name), one
    ``torch.bernoulli`` per expert with density < 1: with torch's global RNG seeded to that
    generator's seed, mergekit draws the same masks."""


def _with_magprune_doc(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Fill the shared MAGPRUNE paragraph into a docstring (before the registry reads it)."""
    fn.__doc__ = fn.__doc__.replace("{magprune}", _MAGPRUNE_DOC.strip())
    return fn


@merge_method(
    "della",
    per_model=("weight", "density", "epsilon"),
    per_model_defaults={"density": 0.7, "epsilon": 0.15},
    ranges=_MAGPRUNE_RANGES,
    check=_magprune_check("della"),
)
@_with_magprune_doc
def della(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    density: list[float],
    epsilon: list[float],
    lambda_: float = 1.0,
    rescale: DareRescale = "keep_rate",
    normalize: bool = True,
    ctx: TensorContext,
) -> torch.Tensor:
    """DELLA (Deep et al. 2024, arXiv:2406.11617): MAGPRUNE, elect sign, merge; θ_b + λ τ_merged.

    {magprune}

    Elect and merge as mergekit's TIES: the sign of Σ_i w_i τ_i (weighted, ties elect +) and
    Σ w_i τ_i over the entries whose w_i τ_i agrees, divided by the Σ w_i of those entries
    (``normalize=True``, mergekit's default, as in the DELLA authors' code) or not at all
    (``False``). Defaults: density 0.7 (the drop rate 0.3 of the authors' example), epsilon 0.15
    (mergekit's). mergekit's ``della`` is this with ``rescale="l1"`` (and its density default 1.0,
    which prunes nothing).
    """
    tv = _magprune(base, experts, density, epsilon, rescale, ctx)
    return elect_merge(
        base,
        tv,
        weight,
        lambda_=lambda_,
        majority_sign="sum",
        weighted_sign=True,
        divide_by="weight_sum" if normalize else "none",
    )


@merge_method(
    "della_linear",
    per_model=("weight", "density", "epsilon"),
    per_model_defaults={"density": 0.7, "epsilon": 0.15},
    ranges=_MAGPRUNE_RANGES,
    check=_magprune_check("della_linear"),
)
@_with_magprune_doc
def della_linear(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    density: list[float],
    epsilon: list[float],
    lambda_: float = 1.0,
    rescale: DareRescale = "keep_rate",
    normalize: bool = False,
    ctx: TensorContext,
) -> torch.Tensor:
    """MAGPRUNE then task arithmetic, no sign election: θ_b + λ Σ_i w_i MAGPRUNE(τ_i).

    {magprune}

    ``normalize`` divides Σ w_i τ_i by Σ w_i (unless |Σ w_i| < 1e-8); off by default, as in
    mergekit. mergekit's ``della_linear`` is this with ``rescale="l1"``.
    """
    tv = _magprune(base, experts, density, epsilon, rescale, ctx)
    return add_scaled_(weighted_sum(tv, weight, normalize), lambda_, base)


@merge_method("sce", per_model=(), ranges={"select_topk": Interval(0.0, 1.0, low_open=True)})
def sce(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    select_topk: float = 1.0,
    ctx: TensorContext,
) -> torch.Tensor:
    """SCE (FuseChat, Wan et al. 2024, arXiv:2408.07990): select, calculate, erase; per tensor.

    * Select: keep only the positions whose variance across the τ_i is in the top
      ``select_topk`` fraction of the nonzero variances (1.0, mergekit's default: all).
    * Calculate: one coefficient per expert, η_i = mean(τ_i²) / Σ_j mean(τ_j²) over the selected
      τ (uniform when that sum is < 1e-6: mergekit's guard, which tiny task vectors also hit).
    * Erase: per entry, drop the τ_i whose sign differs from that of Σ_i τ_i (ties elect +).

    Result θ_b + Σ_i η_i m_i τ_i / Σ_i η_i m_i per entry (m_i: survives the erase; the divisor is
    clamped to ≥ 1e-6), i.e. an η-weighted mean of the agreeing τ_i. Same as mergekit's ``sce``;
    no per-model weights (mergekit has none either).
    """
    tv = steps.task_vectors(base, experts)
    if select_topk < 1:
        tv.mul_(steps.variance_selection_mask(tv, select_topk))
    elected = steps.elect_sign(tv, "sum")
    coefficients = steps.sce_coefficients(tv).view(-1, *([1] * base.dim()))
    kept = coefficients * (tv * elected > 0)  # η_i m_i; a zero never agrees
    merged = (tv * kept).sum(dim=0).div_(kept.sum(dim=0).clamp_(min=1e-6))
    return merged.add_(base)


@merge_method("nuslerp", per_model=("weight",), needs_base=False, n_experts=(2, 2))
def nuslerp(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    nuslerp_row_wise: bool = False,
    nuslerp_flatten: bool = True,
    ctx: TensorContext,
) -> torch.Tensor:
    """Spherical interpolation of two models with t from their weights (mergekit's ``nuslerp``).

    t = w_1 / (w_0 + w_1) (0.5 when |w_0 + w_1| < 1e-6), so equal weights give the midpoint. With
    a base it interpolates the task vectors and adds them back: θ_b + slerp(t, τ_0, τ_1);
    without, slerp(t, θ_0, θ_1). ``nuslerp_flatten`` (default) treats the tensor as one vector;
    otherwise every row (last axis) is interpolated on its own, or with ``nuslerp_row_wise``
    every slice along axis 0. Colinear pairs are interpolated linearly (``interpolation.nuslerp``).
    """
    total = sum(weight)
    t = 0.5 if abs(total) < 1e-6 else weight[1] / total
    options = {"row_wise": nuslerp_row_wise, "flatten": nuslerp_flatten}
    if base is None:
        return interpolation.nuslerp(t, experts[0], experts[1], **options)
    return interpolation.nuslerp(t, experts[0] - base, experts[1] - base, **options).add_(base)


def _check_multislerp(params: dict[str, Any]) -> None:
    if params["normalize_weights"] and len(params["weight"]) > 1 and sum(params["weight"]) == 0:
        raise ValueError("merge method 'multislerp': weights sum to zero, cannot normalise")


@merge_method(
    "multislerp",
    per_model=("weight",),
    needs_base=False,
    ranges={"eps": _POSITIVE},
    check=_check_multislerp,
)
def multislerp(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    normalize_weights: bool = True,
    eps: float = 1e-8,
    ctx: TensorContext,
) -> torch.Tensor:
    """Barycentric spherical interpolation of any number of models (mergekit's ``multislerp``).

    The tensors (the task vectors τ_i when a base is given, added back to it afterwards) are
    averaged on the hypersphere with weights w_i, divided by Σ w_i when ``normalize_weights``:
    see ``interpolation.multislerp`` (tangent-space mean at the weighted mean direction, one
    exponential-map step, scaled to the weighted mean norm; ``eps`` guards the norms). One model
    is returned unchanged. Refused when the weighted mean direction vanishes for > 2 models.
    Reference: https://goddard.blog/posts/multislerp-wow-what-a-cool-idea
    """
    if len(experts) == 1:
        return experts[0].clone()
    tensors = experts if base is None else [e - base for e in experts]
    merged = interpolation.multislerp(tensors, weight, normalize_weights=normalize_weights, eps=eps)
    return merged if base is None else merged.add_(base)


@merge_method(
    "karcher",
    per_model=("weight",),
    needs_base=False,
    ranges={"weight": _POSITIVE, "max_iter": Interval(0, math.inf), "tol": _POSITIVE},
)
def karcher(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    max_iter: int = 10,
    tol: float = 1e-5,
    ctx: TensorContext,
) -> torch.Tensor:
    """Karcher mean of the models on the sphere (Wang et al. 2026, arXiv:2603.04972).

    Per tensor: the weighted Riemannian (Karcher) mean of the directions θ_i/‖θ_i‖, by at most
    ``max_iter`` fixed-point steps until the tangent norm is < ``tol``, scaled by Σ α_i ‖θ_i‖
    with α_i = w_i / Σ w_i (``interpolation.karcher_mean``). Equal weights (the default) are mergekit's
    ``karcher``, which takes no weights; other weights give the paper's weighted mean. As for
    ``linear``, a base, if given, is not part of the mean (mergekit counts a configured base
    model as one more input, with equal weight).
    """
    return interpolation.karcher_mean(experts, weight, max_iter=max_iter, tol=tol)


@merge_method("nearswap", per_model=(), ranges={"t": Interval(0.0, math.inf)}, n_experts=(1, 1))
def nearswap(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    t: float = 0.0001,
    ctx: TensorContext,
) -> torch.Tensor:
    """NearSwap (mergekit): take the other model's value where it is near the base's.

    Per entry, w = clamp(t / max(|θ_b − θ_1|, 1e-6), 0, 1) and the result is
    w θ_1 + (1 − w) θ_b: entries closer than ``t`` become θ_1's, farther ones move toward it by
    t / distance. t = 0 returns the base. One model besides the base. mergekit requires ``t``;
    the default 0.0001 is the value of the method's reference merge
    (huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001).
    """
    other = experts[0]
    w = (t / (base - other).abs_().clamp_(min=1e-6)).clamp_(0, 1)
    return w * other + (1 - w) * base


@merge_method("arcee_fusion", per_model=(), n_experts=(1, 1))
def arcee_fusion(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    ctx: TensorContext,
) -> torch.Tensor:
    """Arcee Fusion (mergekit): take the other model's values only where they changed markedly.

    Importance per entry s = |θ_1 − θ_b| · KL(softmax(θ_1) ‖ softmax(θ_b)) (softmax along the last
    axis, ``steps.fusion_importance``); the entries with s ≥ median + 1.5 · IQR of s (Tukey's
    fence, ``steps.iqr_outlier_threshold``) take θ_1's value, the rest keep θ_b's. One model
    besides the base; no parameters. Tensors over 10⁶ entries estimate the quantiles from 10⁶
    entries drawn from the per-tensor generator (mergekit: from torch's global RNG).
    """
    other = experts[0]
    importance = steps.fusion_importance(other, base)
    threshold = steps.iqr_outlier_threshold(importance, ctx.generator(base.device))
    return base + (other - base) * (importance >= threshold)


@merge_method(
    "passthrough",
    per_model=("scale",),
    per_model_defaults={"scale": 1.0},
    needs_base=False,
    n_experts=(1, 1),
)
def passthrough(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    scale: list[float],
    ctx: TensorContext,
) -> torch.Tensor:
    """The one model's tensor, times ``scale`` (default 1: unchanged); mergekit's ``passthrough``.

    The per-tensor half of layer stacking (frankenmerges): which layers of which model end up
    where is decided by the config's ``slices``. Exactly one model and no base.
    """
    if base is not None:
        raise ValueError("passthrough copies one model: give it as the only model, without a base")
    (factor,) = scale
    return experts[0].clone() if factor == 1 else experts[0] * factor
