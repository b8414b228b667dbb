"""The accelerator's fast paths: the methods that are element-wise passes (linear, task
arithmetic, TIES, DARE with a per-entry rescale, breadcrumbs) as one compiled loop per chunk on
every core, straight from the inputs' stored dtype into the output buffer, and TIES' whole-model
thresholds and the per-tensor ones in fewer passes (:mod:`.thresholds`).

Each is registered with :func:`mergelab.merge.registry.register_fast_path` and returns the bits
of the method it stands for (tests/test_merge_kernels.py: every method × dtype × option, the
accelerator on and off), or ``None`` where it does not apply (a tensor off the CPU; a compute
dtype other than float32, bfloat16 and float16; DARE's "l1" rescale in float32 compute): the
method then runs.

In half-precision compute (``dtype: bfloat16`` or ``float16``, what every mergekit example sets)
the methods' steps are mergekit's order of operations (:func:`..methods.steps.half_weighted_sum`:
every entry's bits depend on that entry alone), and linear, task arithmetic, TIES, breadcrumbs
and DARE run as one compiled pass per chunk that repeats them with their rounding
(:func:`.kernels.half_merge`, through :func:`_half_compiled`): the per-tensor k-th largest |τ_i|
are the float32 passes' rounded to the dtype (:func:`.thresholds.tau_kth_largest_abs`, exact),
and DARE's keep bits and rescale come from one compiled pass over the experts
(:func:`.kernels.dare_keep_bits_many`), the drop applied inside the merge pass. Where a pass meets a
NaN or an Inf, the methods' own steps run in that dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..methods.steps import (
    DARE_BLOCK,
    HALF_DTYPES,
    add_scaled_,
    band_trim_,
    elect_merge,
    kept_count,
    outlier_ranks,
    random_drop_,
    task_vectors,
    threshold_trim_,
    weighted_sum,
)
from ..registry import TensorContext, register_fast_path
from . import chunks, kernels, thresholds

# ctx.stats key of the per-tensor k-th largest |τ_i| an engine computed ahead: (ranks, values)
TAU_KTH = "tau_kth_largest_abs"


def _compute_dtype(ctx: TensorContext, like: torch.Tensor) -> torch.dtype:
    return ctx.dtype or like.dtype


def _runs(ctx: TensorContext, *inputs: torch.Tensor) -> bool:
    """Whether the compiled loops take these inputs: float32 compute, everything on the CPU."""
    tensors = [*inputs, *([] if ctx.out is None else [ctx.out])]
    return _compute_dtype(ctx, inputs[0]) == torch.float32 and kernels.usable(*tensors)


def _runs_half(ctx: TensorContext, *inputs: torch.Tensor) -> bool:
    """Whether the half-precision paths take these inputs: bfloat16/float16 compute, the
    accelerator on, everything on the CPU."""
    tensors = [*inputs, *([] if ctx.out is None else [ctx.out])]
    return _compute_dtype(ctx, inputs[0]) in HALF_DTYPES and kernels.usable(*tensors)


def _cast(ctx: TensorContext, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """The inputs in the compute dtype, as ``MergeMethod._reference`` casts them."""
    return [x if ctx.dtype is None else x.to(ctx.dtype) for x in inputs]


def _deliver(ctx: TensorContext, merged: torch.Tensor) -> torch.Tensor:
    """The result where the engine wants it: copied into ``ctx.out`` when set (as
    ``MergeMethod._reference`` does)."""
    return merged if ctx.out is None else ctx.out.copy_(merged)


def _output(ctx: TensorContext, like: torch.Tensor) -> torch.Tensor:
    """The flat buffer the loop writes into: ``ctx.out``, or a new float32 one."""
    if ctx.out is not None:
        return ctx.out.view(-1)
    return torch.empty(like.numel(), dtype=torch.float32, device=like.device)


def _run_loop(
    loop: Callable[[slice], int],
    inputs: list[torch.Tensor],
    out: torch.Tensor,
    ctx: TensorContext,
    size: int | None = None,
) -> None:
    """A compiled loop (``kernels.ChunkMerger`` / ``ChunkSummer``) over every chunk of ``out``
    on every core; what it saw of NaN/Inf goes into ``ctx.checks``."""
    found = 0
    for flags in chunks.for_chunks(out.numel(), loop, size):
        found |= flags
    ctx.checks = kernels.LoopChecks.of(found, inputs, out)


def _weighted_sum(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    ctx: TensorContext,
    weight: list[float],
    *,
    lambda_: float,
    normalize: bool,
) -> torch.Tensor | None:
    """linear (no base) and task arithmetic: one ``sum_chunk`` pass per chunk."""
    inputs = ([] if base is None else [base]) + list(experts)
    if not _runs(ctx, *inputs):
        return None
    out = _output(ctx, experts[0])
    summer = kernels.ChunkSummer(base, experts, out, weight, lambda_=lambda_, normalize=normalize)
    _run_loop(summer, inputs, out, ctx)
    return out.view(experts[0].shape)


def _weighted_sum_half(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    ctx: TensorContext,
    weight: list[float],
    *,
    lambda_: float,
    normalize: bool,
) -> torch.Tensor | None:
    """linear (no base) and task arithmetic in half precision: steps.half_weighted_sum (then
    add_scaled_ with a base) in one compiled pass per chunk; ``None`` (the method runs) where
    the loop declines."""
    dtype = _compute_dtype(ctx, experts[0])
    seen = ([] if base is None else [base]) + list(experts)
    cast = _cast(ctx, *seen)
    b, rows = (None, cast) if base is None else (cast[0], cast[1:])
    plan = kernels.half_plan(weight, dtype, lambda_=lambda_, normalize=normalize)
    return _half_compiled(b, rows, ctx, plan, seen=seen)


def _half_compiled(
    base: torch.Tensor | None,
    rows: list[torch.Tensor],
    ctx: TensorContext,
    plan: tuple,
    *,
    seen: list[torch.Tensor],
    drops: list | None = None,
) -> torch.Tensor | None:
    """The merge ``plan`` (:func:`.kernels.half_plan`) in one compiled pass per chunk
    (:func:`.kernels.half_merge`) of ``base`` and ``rows`` (already in the compute dtype), into
    ``ctx.out`` where it is in that dtype; ``None`` where the loop declines (a NaN or an Inf
    met): the caller runs the steps. ``seen``: the inputs as the fast path was given them (the
    loop's finite inputs mean finite ``seen``: casting keeps NaN and Inf), recorded with the
    result in ``ctx.checks`` so that nobody checks them again."""
    like = rows[0]
    out = ctx.out
    direct = out is not None and out.dtype == like.dtype and out.is_contiguous()
    target = out.view(like.shape) if direct else torch.empty_like(like)
    if not kernels.half_merge(base, rows, target, plan, drops=drops):
        return None
    result = target if direct or out is None else out.copy_(target)
    if result is target:  # a copy into another dtype may overflow: checked by the engine
        ctx.checks = kernels.LoopChecks.of(0, seen, result)
    return result


def linear(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    if _runs_half(ctx, *experts):
        return _weighted_sum_half(
            None, experts, ctx, p["weight"], lambda_=1.0, normalize=p["normalize"]
        )
    return _weighted_sum(None, experts, ctx, p["weight"], lambda_=1.0, normalize=p["normalize"])


def task_arithmetic(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    args = (base, experts, ctx, p["weight"])
    options = {"lambda_": p["lambda_"], "normalize": p["normalize"]}
    if _runs_half(ctx, base, *experts):
        return _weighted_sum_half(*args, **options)
    return _weighted_sum(*args, **options)


def _elect_plan(p: dict[str, Any]) -> tuple | None:
    """``kernels.elect_plan`` for TIES' elect and disjoint merge options (``None`` for unknown
    options: the method raises on them)."""
    if p["majority_sign"] not in ("sum", "count"):
        return None
    if p["divide_by"] not in ("count", "weight_sum", "none"):
        return None
    return kernels.elect_plan(p["weight"], **_elect_options(p))


def _elect_options(p: dict[str, Any]) -> dict[str, Any]:
    """TIES' elect and disjoint-merge options, as ``elect_merge`` and ``kernels.elect_plan``
    take them."""
    return {k: p[k] for k in ("lambda_", "majority_sign", "weighted_sign", "divide_by")}


def _merge(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    ctx: TensorContext,
    plan: tuple,
    dare_seed: int | None = None,
    size: int | None = None,
) -> torch.Tensor:
    params, scalars, flags = plan
    out = _output(ctx, base)
    merger = kernels.ChunkMerger(base, experts, out, params, scalars, flags, dare_seed=dare_seed)
    if dare_seed is not None:
        size = kernels.dare_chunk(base.numel(), len(merger.dare))
    _run_loop(merger, [base, *experts], out, ctx, size)
    return out.view(base.shape)


# --- per-tensor magnitude thresholds ---------------------------------------------------------------


def _tau_kth(
    base: torch.Tensor, experts: list[torch.Tensor], ranks: list[list[int]], ctx: TensorContext
) -> list[list[float]]:
    """The k-th largest |τ_i| of this tensor for ``ranks``: what the engine computed ahead
    (:func:`_ahead`, the same call) when it asked for these very ranks, else now."""
    ahead = ctx.stats.get(TAU_KTH)
    if ahead is not None and ahead[0] == ranks:
        return ahead[1]
    return thresholds.tau_kth_largest_abs(base, experts, ranks, _compute_dtype(ctx, base))


def _ahead(
    ranks: Callable[[int, dict[str, Any]], list[list[int]] | None],
) -> Callable[..., dict[str, Any]]:
    """An ``ahead`` hook computing :func:`_tau_kth` for ``ranks(numel, params)`` (``None``:
    nothing to compute)."""

    def ahead(base, experts, ctx: TensorContext, params: dict) -> dict[str, Any]:
        wanted = ranks(base.numel(), params)
        if wanted is None or not any(wanted):
            return {}
        dtype = _compute_dtype(ctx, base)
        return {TAU_KTH: (wanted, thresholds.tau_kth_largest_abs(base, experts, wanted, dtype))}

    return ahead


def _ties_ranks(numel: int, p: dict[str, Any]) -> list[list[int]] | None:
    """The rank of each expert's per-tensor threshold (none for density 1); ``None`` for the
    whole-model trim."""
    if p["trim_scope"] != "tensor":
        return None
    return [[kept_count(d, numel)] if d < 1 else [] for d in p["density"]]


def _breadcrumbs_ranks(numel: int, p: dict[str, Any]) -> list[list[int]]:
    """Each expert's two ranks (steps.outlier_ranks; [] keeps nothing or everything)."""
    return [outlier_ranks(numel, d, g) or [] for d, g in zip(p["density"], p["gamma"])]


# --- the methods -----------------------------------------------------------------------------------


def _ties_half(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    """TIES in half precision: the method's steps, with the per-tensor thresholds from
    :func:`_tau_kth` (in the compute dtype, exact)."""
    if p["trim_scope"] == "model":
        if any(d < 1 for d in p["density"]) and "ties_thresholds" not in ctx.stats:
            return None  # the method says what is missing
        found = ctx.stats.get("ties_thresholds", [0.0] * len(experts))
    else:
        kth = _tau_kth(base, experts, _ties_ranks(base.numel(), p), ctx)
        found = [values[0] if values else 0.0 for values in kth]
    seen = [base, *experts]
    base, *experts = _cast(ctx, base, *experts)
    plan = kernels.half_plan(p["weight"], base.dtype, lambda_=p["lambda_"], elect=_elect_options(p))
    plan[0][:, kernels.P_LOW] = [kernels.trim_below(t) for t in found]
    merged = _half_compiled(base, experts, ctx, plan, seen=seen)
    if merged is not None:
        return merged
    stack = task_vectors(base, experts)
    for tau, threshold in zip(stack, found):
        threshold_trim_(tau, threshold)
    return _deliver(ctx, elect_merge(base, stack, p["weight"], **_elect_options(p)))


def ties(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    plan = _elect_plan(p)
    if plan is not None and _runs_half(ctx, base, *experts):
        return _ties_half(base, experts, ctx, p)
    if plan is None or not _runs(ctx, base, *experts):
        return None
    if p["trim_scope"] == "model":
        if any(d < 1 for d in p["density"]) and "ties_thresholds" not in ctx.stats:
            return None  # the method says what is missing
        found = ctx.stats.get("ties_thresholds", [0.0] * len(experts))
    else:
        kth = _tau_kth(base, experts, _ties_ranks(base.numel(), p), ctx)
        found = [values[0] if values else 0.0 for values in kth]
    plan[0][:, kernels.P_LOW] = [kernels.trim_below(t) for t in found]
    return _merge(base, experts, ctx, plan)


def ties_prepare(
    params: dict[str, Any], make_iter: Callable[..., Any], dtype: torch.dtype | None
) -> dict[str, Any]:
    """TIES' whole-model thresholds (the method's ``prepare``: the same values): a sampled pass
    and an exact one (:func:`.thresholds.global_magnitude_thresholds`). With ``dtype`` the
    engine streams stored-dtype memory maps, fresh on every yield: the sample reads them
    unpopulated (``make_iter(sparse=True)``), and in the exact pass each is counted while the
    next is mapped."""
    stored = dtype is not None
    found = thresholds.global_magnitude_thresholds(
        make_iter,
        params["density"],
        dtype,
        fetch_ahead=stored,
        sample_iter=functools.partial(make_iter, sparse=True) if stored else None,
    )
    return {"ties_thresholds": found}


def dare_keep_mask(shape: torch.Size, density: float, seed: int, expert: int) -> torch.Tensor:
    """``steps.dare_keep_mask``'s mask (True = kept), block by block from the same SFC64
    streams, each entry's comparison made on integers: the low 23 bits of its 32-bit draw <
    round(density · 2²³), which ``steps.dare_keep_block`` makes exactly in float arithmetic."""
    numel = math.prod(shape)
    keep = torch.empty(numel, dtype=torch.bool)
    limit = round(density * (1 << 23))
    drawn = keep.numpy()
    for start in range(0, numel, DARE_BLOCK):
        n = min(DARE_BLOCK, numel - start)
        generator = np.random.SFC64(
            np.random.SeedSequence(seed, spawn_key=(expert, start // DARE_BLOCK))
        )
        bits = generator.random_raw((n + 1) // 2).view(np.uint32)[:n]
        np.less(np.bitwise_and(bits, (1 << 23) - 1), limit, out=drawn[start : start + n])
    return keep.view(tuple(shape))


def _dare_half(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor:
    """dare_linear and dare_ties in half precision: the methods' steps, any rescale. The
    dropping experts' keep bits and drops in one compiled pass over them all
    (:func:`.kernels.dare_keep_bits_many`, each τ_i formed and not stored, the base's tiles read
    once), then the merge in one compiled pass that forms τ_i again and drops
    (:func:`.kernels.half_merge`). Where one of them declines (a NaN or an Inf), the
    method's steps run: the stack of dropped task vectors, then the merge."""
    seen = [base, *experts]
    base, *experts = _cast(ctx, base, *experts)
    dropping = [i for i, d in enumerate(p["density"]) if d < 1]
    found: list | None = []
    if dropping:
        found = kernels.dare_keep_bits_many(
            base,
            [experts[i] for i in dropping],
            [p["density"][i] for i in dropping],
            ctx.tensor_seed,
            dropping,
            p["rescale"],
        )
    drops: list = [None] * len(experts)  # all None where the pass declined
    for i, drop in zip(dropping, found or []):
        drops[i] = drop
    linear = "majority_sign" not in p  # dare_linear
    elect = None if linear else _elect_options(p)
    normalize = p["normalize"] if linear else False
    plan = kernels.half_plan(
        p["weight"], base.dtype, lambda_=p["lambda_"], normalize=normalize, elect=elect
    )
    if found is not None:
        merged = _half_compiled(base, experts, ctx, plan, seen=seen, drops=drops)
        if merged is not None:
            return merged
    stack = task_vectors(base, experts)
    for i, (tau, d, found) in enumerate(zip(stack, p["density"], drops)):
        if found is not None:
            kernels.apply_keep_bits_(tau, found)
        elif d < 1:
            keep = dare_keep_mask(tau.shape, d, ctx.tensor_seed, i)
            random_drop_(tau, keep, d, p["rescale"])
    if linear:
        merged = add_scaled_(weighted_sum(stack, p["weight"], p["normalize"]), p["lambda_"], base)
    else:
        merged = elect_merge(base, stack, p["weight"], **_elect_options(p))
    return _deliver(ctx, merged)


def _dare(base, experts, ctx: TensorContext, p: dict[str, Any], plan) -> torch.Tensor | None:
    """DARE's drop and a per-entry rescale fused with the merge ``plan`` in float32 (the "l1"
    rescale needs τ_i's norms before and after the drop: the method runs it); in half
    precision, :func:`_dare_half`."""
    if plan is not None and p["rescale"] in ("keep_rate", "l1", "none"):
        if _runs_half(ctx, base, *experts):
            return _dare_half(base, experts, ctx, p)
    if p["rescale"] == "l1" or plan is None or not _runs(ctx, base, *experts):
        return None
    params = plan[0]
    for i, d in enumerate(p["density"]):
        params[i, kernels.P_DARE_LIMIT] = kernels.dare_limit(d)
        params[i, kernels.P_DARE_DIVISOR] = d if p["rescale"] == "keep_rate" and d < 1 else 0.0
    return _merge(base, experts, ctx, plan, dare_seed=ctx.tensor_seed)


def dare_linear(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    plan = kernels.sum_plan(p["weight"], lambda_=p["lambda_"], normalize=p["normalize"])
    return _dare(base, experts, ctx, p, plan)


def dare_ties(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    return _dare(base, experts, ctx, p, _elect_plan(p))


def _breadcrumbs_half(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor:
    """breadcrumbs in half precision: the method's steps, the band's ends from :func:`_tau_kth`."""
    numel = base.numel()
    found = _tau_kth(base, experts, _breadcrumbs_ranks(numel, p), ctx)
    seen = [base, *experts]
    base, *experts = _cast(ctx, base, *experts)
    plan = kernels.half_plan(
        p["weight"], base.dtype, lambda_=p["lambda_"], normalize=p["normalize"]
    )
    _band_columns(plan, numel, p, found)
    merged = _half_compiled(base, experts, ctx, plan, seen=seen)
    if merged is not None:
        return merged
    stack = task_vectors(base, experts)
    for tau, d, g, band in zip(stack, p["density"], p["gamma"], found):
        ranks = outlier_ranks(numel, d, g)
        if ranks is None:
            tau.zero_()
        elif ranks:
            band_trim_(tau, *band)
    merged = add_scaled_(weighted_sum(stack, p["weight"], p["normalize"]), p["lambda_"], base)
    return _deliver(ctx, merged)


def _band_columns(plan: tuple, numel: int, p: dict[str, Any], found: list[list[float]]) -> None:
    """breadcrumbs' band in a plan's trim columns: τ − hardshrink(τ, largest), trimmed below
    the smallest kept (nothing kept: everything trimmed; no band: nothing)."""
    params, _, flags = plan
    flags[kernels.F_BAND] = 1
    for i, (d, g, band) in enumerate(zip(p["density"], p["gamma"], found)):
        ranks = outlier_ranks(numel, d, g)
        if ranks is None:  # keeps nothing
            params[i, kernels.P_LOW] = math.inf
        elif ranks:
            params[i, kernels.P_LOW] = kernels.trim_below(band[0])
            params[i, kernels.P_HIGH] = band[1]


def breadcrumbs(base, experts, ctx: TensorContext, p: dict[str, Any]) -> torch.Tensor | None:
    if _runs_half(ctx, base, *experts):
        return _breadcrumbs_half(base, experts, ctx, p)
    if not _runs(ctx, base, *experts):
        return None
    numel = base.numel()
    found = _tau_kth(base, experts, _breadcrumbs_ranks(numel, p), ctx)
    plan = kernels.sum_plan(p["weight"], lambda_=p["lambda_"], normalize=p["normalize"])
    _band_columns(plan, numel, p, found)
    return _merge(base, experts, ctx, plan)


def register() -> None:
    """Register every fast path (each runs where :func:`kernels.active`)."""
    on = kernels.active
    for name, merge in [("linear", linear), ("task_arithmetic", task_arithmetic)]:
        register_fast_path(name, merge, stored_dtype=True, active=on)
    register_fast_path(
        "ties",
        ties,
        stored_dtype=True,
        prepare=ties_prepare,
        ahead=_ahead(_ties_ranks),
        active=on,
    )
    register_fast_path("dare_linear", dare_linear, stored_dtype=True, active=on)
    register_fast_path("dare_ties", dare_ties, stored_dtype=True, active=on)
    register_fast_path(
        "breadcrumbs", breadcrumbs, stored_dtype=True, ahead=_ahead(_breadcrumbs_ranks), active=on
    )
