"""The classic merge methods, each one registered function of tensor maths that reads top to
bottom: the specification of what a merge computes.

Conventions: ``base`` is θ_b, ``experts`` are θ_i, a *task vector* is τ_i = θ_i − θ_b, ``weight``
is w_i and ``lambda_`` is λ. Every tensor arrives whole, in the compute dtype (float32 by
default); the engine casts the result to the checkpoint's dtype. A method never modifies its
inputs and knows nothing of how tensors are streamed. Where the TIES/DARE papers and the tools
(PEFT 0.21 ``merge_utils``, mergekit 0.1.5) disagree the choice is a parameter, the paper's
choice is the default, and each docstring says which setting reproduces which tool.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..registry import Interval, TensorContext, merge_method
from . import interpolation
from .steps import (
    HALF_DTYPES,
    DareRescale,
    DivideBy,
    MajoritySign,
    add_scaled_,
    band_trim_,
    dare_keep_mask,
    elect_merge,
    kth_largest_abs_many,
    magnitude_threshold,
    model_magnitude_thresholds,
    outlier_ranks,
    random_drop_,
    task_vectors,
    threshold_trim_,
    weighted_sum,
)

# density 0 would keep nothing (the merge would be the base): a positive fraction is required.
_DENSITY_RANGE = {"density": Interval(0.0, 1.0, low_open=True)}


def _check_linear(params: dict[str, Any]) -> None:
    if params["normalize"] and sum(params["weight"]) == 0:
        raise ValueError("merge method 'linear': weights sum to zero, cannot normalise")


@merge_method("linear", per_model=("weight",), needs_base=False, check=_check_linear)
def linear(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    normalize: bool = True,
    ctx: TensorContext,
) -> torch.Tensor:
    """Weighted average of the models (model soup): Σ w_i θ_i / Σ w_i.

    ``normalize=False`` gives the plain weighted sum Σ w_i θ_i. mergekit's ``linear`` normalises by
    default, as here. The base, if given, is not part of the average.
    """
    if normalize and sum(weight) == 0:
        raise ValueError("linear merge: weights sum to zero, cannot normalise")
    return weighted_sum(experts, weight, normalize)


def _check_slerp(params: dict[str, Any]) -> None:
    t = params["t"]
    if not 0 <= t <= 1 and not params["extrapolate"]:
        raise ValueError(
            f"merge method 'slerp': t={t:g} is outside [0, 1] (t = 0 gives the first model, "
            "t = 1 the second); pass extrapolate=true to go beyond them on purpose"
        )


@merge_method(
    "slerp",
    per_model=(),
    needs_base=False,
    ranges={"dot_threshold": Interval(0.0, 1.0, high_open=True)},
    check=_check_slerp,
)
def slerp(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    t: float = 0.5,
    dot_threshold: float = 0.9995,
    extrapolate: bool = False,
    ctx: TensorContext,
) -> torch.Tensor:
    """Spherical interpolation of two models per tensor: t = 0 gives the first, t = 1 the second.

    The two models are (base, expert) as in mergekit, or (expert 0, expert 1) without a base.
    Falls back to linear interpolation when |cos θ| > ``dot_threshold`` (0.9995, mergekit's; must
    lie in [0, 1)). ``t`` must lie in [0, 1] unless ``extrapolate=True`` (mergekit does not check):
    then the same formula continues along the great circle beyond either model.
    """
    if base is not None and len(experts) == 1:
        return interpolation.slerp(t, base, experts[0], dot_threshold=dot_threshold)
    if base is None and len(experts) == 2:
        return interpolation.slerp(t, experts[0], experts[1], dot_threshold=dot_threshold)
    raise ValueError(
        f"slerp interpolates exactly two models: a base and one expert, or two experts without "
        f"a base; got {'a base and ' if base is not None else ''}{len(experts)} expert(s)"
    )


@merge_method("task_arithmetic", per_model=("weight",))
def task_arithmetic(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    lambda_: float = 1.0,
    normalize: bool = False,
    ctx: TensorContext,
) -> torch.Tensor:
    """Task arithmetic (Ilharco et al. 2023): θ_b + λ Σ_i w_i τ_i.

    ``normalize`` divides Σ w_i τ_i by Σ w_i (mergekit's ``normalize``, off by default there too).
    mergekit's ``task_arithmetic`` equals this; PEFT's returns Σ w_i τ_i only (no base, no λ).
    With λ = 1 and w_i = 1 on a model whose logits are linear in θ this is exactly logit
    composition.
    """
    task_vector_sum = weighted_sum((e - base for e in experts), weight, normalize)
    if task_vector_sum.dtype in HALF_DTYPES:  # mergekit's order: λ · Σ rounded, then + θ_b
        return add_scaled_(task_vector_sum, lambda_, base)
    return torch.add(base, task_vector_sum, alpha=lambda_)


def ties_model_thresholds(params: dict[str, Any], make_iter) -> dict[str, Any]:
    """TIES' whole-model statistics (its ``prepare`` hook): one |τ_i| threshold per expert over
    every tensor of the model (``steps.model_magnitude_thresholds``)."""
    return {"ties_thresholds": model_magnitude_thresholds(make_iter, params["density"])}


def _ties_needs_model_pass(params: dict[str, Any]) -> bool:
    return params["trim_scope"] == "model" and any(d < 1 for d in params["density"])


@merge_method(
    "ties",
    per_model=("weight", "density"),
    per_model_defaults={"density": 0.2},
    ranges=_DENSITY_RANGE,
    prepare=ties_model_thresholds,
    needs_prepare=_ties_needs_model_pass,
)
def ties(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    density: list[float],
    lambda_: float = 1.0,
    trim_scope: Literal["model", "tensor"] = "model",
    majority_sign: MajoritySign = "sum",
    weighted_sign: bool = False,
    divide_by: DivideBy = "count",
    ctx: TensorContext,
) -> torch.Tensor:
    """TIES-merging (Yadav et al. 2023): trim, elect sign, disjoint mean; θ_b + λ τ_merged.

    * Trim: expert i keeps its top ``density_i`` fraction of |τ_i| (default 0.2, the paper's k),
      over the whole model (``trim_scope="model"``, the paper's code; exact global threshold from
      the method's whole-model pass) or per tensor (``"tensor"``: mergekit, PEFT).
    * Elect: the sign of Σ_i τ_i per entry (``majority_sign="sum"``: paper, PEFT "total",
      mergekit "sum") or of the count of signs (``"count"``: PEFT "frequency", mergekit "count"),
      on the unweighted trimmed τ_i (``weighted_sign=False``: paper, PEFT) or on w_i τ_i
      (``True``: mergekit). Ties (sum = 0) elect +, as in every implementation.
    * Disjoint merge: Σ w_i τ_i over the agreeing entries divided by their count
      (``divide_by="count"``: paper, PEFT), by Σ w_i (``"weight_sum"``: mergekit
      ``normalize: true``, its default for ties) or not at all (``"none"``).

    PEFT's ``ties(...)`` is ``trim_scope="tensor"`` and returns τ_merged only. mergekit's ``ties``
    is ``trim_scope="tensor", weighted_sign=True, divide_by="weight_sum"`` (its density default is
    1.0, i.e. no trimming). Exact ties in |τ| at the threshold are all kept (a sort keeps exactly k).
    """
    stack = task_vectors(base, experts)
    if trim_scope == "model":
        if any(d < 1 for d in density) and "ties_thresholds" not in ctx.stats:
            raise ValueError(
                "ties with trim_scope='model' needs whole-model thresholds from its prepare pass: "
                "merge through an engine (merge_state_dicts, merge_models, the checkpoint merger) "
                "or use trim_scope='tensor'"
            )
        thresholds = ctx.stats.get("ties_thresholds", [0.0] * len(experts))
    else:
        thresholds = [magnitude_threshold(tau, d) for tau, d in zip(stack, density)]
    for tau, threshold in zip(stack, thresholds):
        threshold_trim_(tau, threshold)
    return elect_merge(
        base,
        stack,
        weight,
        lambda_=lambda_,
        majority_sign=majority_sign,
        weighted_sign=weighted_sign,
        divide_by=divide_by,
    )


def dare(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    density: list[float],
    rescale: DareRescale,
    ctx: TensorContext,
) -> torch.Tensor:
    """Stack of DARE-sparsified task vectors: each τ_i's entries dropped at random (a mask from
    ``steps.dare_keep_mask`` with the tensor's seed, one per expert) and the rest rescaled."""
    stack = task_vectors(base, experts)
    for i, (tau, d) in enumerate(zip(stack, density)):
        if d < 1:  # no draw when nothing is dropped, as in mergekit and PEFT
            random_drop_(tau, dare_keep_mask(tau.shape, d, ctx.tensor_seed, i), d, rescale)
    return stack


@merge_method(
    "dare_linear",
    per_model=("weight", "density"),
    per_model_defaults={"density": 0.1},
    ranges=_DENSITY_RANGE,
)
def dare_linear(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    density: list[float],
    lambda_: float = 1.0,
    rescale: DareRescale = "keep_rate",
    normalize: bool = False,
    ctx: TensorContext,
) -> torch.Tensor:
    """DARE then task arithmetic (Yu et al. 2024): θ_b + λ Σ_i w_i DARE(τ_i).

    DARE drops each entry of τ_i with probability p_i = 1 − ``density_i`` (default density 0.1,
    i.e. the drop rate 0.9 of the paper's LLM experiments) and rescales the survivors: by
    1/(1−p) (``rescale="keep_rate"``: paper, PEFT ``dare_linear``) or to τ_i's pre-drop L1 norm
    (``"l1"``: mergekit, whose ``rescale: true`` is its default), or not (``"none"``).
    Masks come from a generator seeded by (seed, tensor name): reproducible, different per tensor.
    ``normalize`` divides by Σ w_i (mergekit's option). mergekit's ``dare_linear`` is
    ``rescale="l1"``; PEFT's returns Σ w_i DARE(τ_i) only.
    """
    stack = dare(base, experts, density, rescale, ctx)
    return add_scaled_(weighted_sum(stack, weight, normalize), lambda_, base)


@merge_method(
    "dare_ties",
    per_model=("weight", "density"),
    per_model_defaults={"density": 0.1},
    ranges=_DENSITY_RANGE,
)
def dare_ties(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    density: list[float],
    lambda_: float = 1.0,
    rescale: DareRescale = "keep_rate",
    majority_sign: MajoritySign = "sum",
    weighted_sign: bool = False,
    divide_by: DivideBy = "count",
    ctx: TensorContext,
) -> torch.Tensor:
    """DARE then TIES' sign election and disjoint merge: θ_b + λ τ_merged (no magnitude trim).

    Drop and rescale as in ``dare_linear``; elect and merge as in ``ties`` (same parameters, same
    defaults: the papers' choices, which PEFT's ``dare_ties`` also makes). mergekit's
    ``dare_ties`` is ``rescale="l1", weighted_sign=True, divide_by="none"`` (``normalize: false``
    is its default here; ``normalize: true`` is ``divide_by="weight_sum"``).
    """
    stack = dare(base, experts, density, rescale, ctx)
    return elect_merge(
        base,
        stack,
        weight,
        lambda_=lambda_,
        majority_sign=majority_sign,
        weighted_sign=weighted_sign,
        divide_by=divide_by,
    )


@merge_method(
    "breadcrumbs",
    per_model=("weight", "density", "gamma"),
    per_model_defaults={"density": 0.9, "gamma": 0.01},
    ranges={**_DENSITY_RANGE, "gamma": Interval(0.0, 1.0)},
)
def breadcrumbs(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    density: list[float],
    gamma: list[float],
    lambda_: float = 1.0,
    normalize: bool = False,
    ctx: TensorContext,
) -> torch.Tensor:
    """Model Breadcrumbs (Davari & Belilovsky 2023), mergekit semantics: θ_b + λ Σ_i w_i m_i ⊙ τ_i.

    Per tensor, m_i drops the largest ``gamma_i`` fraction of |τ_i| (outliers) and keeps the next
    ``density_i`` fraction, dropping the smallest rest (see ``steps.magnitude_outlier_trim_``).
    Defaults density 0.9, gamma 0.01 are mergekit's documented example (its parameter default
    density = 1.0 disables the mask altogether). ``normalize`` divides by Σ w_i as in mergekit.
    """
    stack = task_vectors(base, experts)
    for tau, d, g in zip(stack, density, gamma):
        ranks = outlier_ranks(tau.numel(), d, g)  # [] keeps everything, None nothing
        if ranks is None:
            tau.zero_()
        elif ranks:
            band_trim_(tau, *kth_largest_abs_many(tau, ranks))
    return add_scaled_(weighted_sum(stack, weight, normalize), lambda_, base)


@merge_method("model_stock", per_model=())
def model_stock(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    filter_wise: bool = False,
    ctx: TensorContext,
) -> torch.Tensor:
    """Model Stock (Jang et al. 2024): interpolate from the base toward the experts' average by
    t = N cos θ / (1 + (N − 1) cos θ), cos θ the mean pairwise cosine of the task vectors, per
    tensor (or per row with ``filter_wise``). Needs ≥ 2 experts; weights are not used. Same as
    mergekit's ``model_stock``.
    """
    return interpolation.model_stock(base, experts, filter_wise=filter_wise)
