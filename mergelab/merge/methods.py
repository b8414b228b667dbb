"""The registered merge methods. Each is a pure function over one parameter tensor.

Conventions: ``base`` is θ_b, ``experts`` are θ_i, a *task vector* is τ_i = θ_i − θ_b, ``weight``
is w_i and ``lambda_`` is λ. All tensors arrive in the compute dtype (float32 by default); the
engine casts the result back to the checkpoint's dtype. The methods registered with
``chunked=True`` (linear, task arithmetic, TIES, DARE, breadcrumbs) are element-wise passes over
chunks on every core (``ops.for_chunks``); the streaming engine hands them the inputs in their
stored dtype and an output buffer (``ctx.dtype``, ``ctx.out``), so each chunk is cast in cache
and no full-size float32 copy of any input exists. TIES, DARE (per-entry rescales) and
breadcrumbs run each chunk as one compiled loop where the package's C loops were built
(``kernels``, the same bits: docs/merge_performance.md); the torch code here is the reference and the fallback. Where
the TIES/DARE papers and the tools
(PEFT 0.21 ``merge_utils``, mergekit 0.1.5) disagree the choice is a parameter, the paper's choice
is the default, and each docstring says which setting reproduces which tool.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from . import kernels, ops
from .ops import DareRescale, DivideBy, MajoritySign
from .registry import Interval, LoopChecks, TensorContext, merge_method

# density 0 would keep nothing (the merge would be the base): a positive fraction is required.
_DENSITY_RANGE = {"density": Interval(0.0, 1.0, low_open=True)}


def weighted_sum(
    tensors: Iterable[torch.Tensor], weight: list[float], normalize: bool
) -> torch.Tensor:
    """Σ_i w_i x_i into a new tensor, divided by Σ_i w_i when ``normalize``.

    Accumulates one tensor at a time, so a generator of task vectors never needs a full stack.
    """
    merged: torch.Tensor | None = None
    for w, x in zip(weight, tensors):
        if merged is None:
            merged = torch.mul(x, w)
        else:
            merged.add_(x, alpha=w)
    assert merged is not None
    if normalize:
        total = sum(weight)
        if abs(total) >= 1e-8:  # mergekit's rule: a (near-)zero total is not divided by
            merged.div_(total)
    return merged


def _compute_dtype(ctx: TensorContext, like: torch.Tensor) -> torch.dtype:
    return ctx.dtype or like.dtype


def _output(ctx: TensorContext, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat buffer a chunked method writes into: ``ctx.out``, or a new one in ``dtype``."""
    if ctx.out is not None:
        return ctx.out.view(-1)
    return torch.empty(like.numel(), dtype=dtype, device=like.device)


def _result(out: torch.Tensor, part: slice, dtype: torch.dtype) -> torch.Tensor:
    """Where a chunk's result is computed: ``out[part]`` itself, or (when ``out`` has another
    dtype) a scratch buffer that :func:`_emit` then rounds into ``out[part]``."""
    target = out[part]
    if target.dtype == dtype:
        return target
    return ops.scratch("result", part.stop - part.start, dtype, out.device)


def _emit(out: torch.Tensor, part: slice, result: torch.Tensor) -> None:
    target = out[part]
    if result.data_ptr() != target.data_ptr():
        target.copy_(result)


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
    for flags in ops.for_chunks(out.numel(), loop, size):
        found |= flags
    ctx.checks = LoopChecks.of(found, inputs, out)


def _combine(
    base: torch.Tensor | None,
    tensors: list[torch.Tensor],
    weight: list[float],
    *,
    normalize: bool,
    lambda_: float = 1.0,
    ctx: TensorContext,
) -> torch.Tensor:
    """θ_b + λ Σ_i w_i (x_i − θ_b), or Σ_i w_i x_i without a base; Σ divided by Σ_i w_i when
    ``normalize`` (unless |Σ w_i| < 1e-8, mergekit's rule).

    Walks the tensors chunk by chunk on every core (``ops.for_chunks``) with reused cache-sized
    buffers per thread: no task-vector stack, no full-size temporaries besides the output. With
    the compiled loops, one pass per chunk (``kernels.ChunkSummer``, the same bits).
    """
    total = sum(weight)
    divide = normalize and abs(total) >= 1e-8
    dtype = _compute_dtype(ctx, tensors[0])
    flat_base = base.reshape(-1) if base is not None else None
    flat = [x.reshape(-1) for x in tensors]
    out = _output(ctx, tensors[0], dtype)
    inputs = ([] if base is None else [base]) + list(tensors)
    if dtype == torch.float32 and kernels.usable(*inputs, out):  # one compiled pass
        summer = kernels.ChunkSummer(
            base, tensors, out, weight, lambda_=lambda_, normalize=normalize
        )
        _run_loop(summer, inputs, out, ctx)
        return out.view(tensors[0].shape)

    def combine(part: slice) -> bool:
        n = part.stop - part.start
        d = ops.scratch("delta", n, dtype, out.device)
        a = ops.scratch("acc", n, dtype, out.device)
        b = None if flat_base is None else ops.as_dtype(flat_base[part], dtype, "in-base")
        for i, (x, w) in enumerate(zip(flat, weight)):
            term = ops.as_dtype(x[part], dtype, "in-expert")
            if b is not None:
                term = torch.sub(term, b, out=d)
            if i == 0:
                torch.mul(term, w, out=a)
            else:
                a.add_(term, alpha=w)
        if divide:
            a.div_(total)
        if b is None:
            out[part] = a
        else:
            result = _result(out, part, dtype)
            torch.add(b, a, alpha=lambda_, out=result)
            _emit(out, part, result)
        # NaN/Inf in an input makes the stored result non-finite: a finite stored chunk
        # (checked while in cache) clears its inputs too
        return ops.all_finite_chunk(out[part])

    if all(ops.for_chunks(out.numel(), combine)):
        ctx.checks = LoopChecks.of(0, inputs, out)
    return out.view(tensors[0].shape)


def _sum_rows_into(
    out: torch.Tensor,
    rows: torch.Tensor,
    weight: list[float],
    normalize: bool,
    lambda_: float,
    base: torch.Tensor,
) -> None:
    """out = θ_b + λ Σ_i w_i rows_i (Σ divided by Σ w_i when ``normalize``), for one chunk: the
    same operations, in the same order, as ``add_scaled_(weighted_sum(rows, ...), λ, θ_b)``."""
    acc = weighted_sum(rows, weight, normalize)
    if lambda_ != 1:
        acc.mul_(lambda_)
    torch.add(acc, base, out=out)


def add_scaled_(delta: torch.Tensor, lambda_: float, base: torch.Tensor) -> torch.Tensor:
    """θ_b + λ δ, reusing δ's storage (``delta`` is the method's own buffer)."""
    if lambda_ != 1:
        delta.mul_(lambda_)
    return delta.add_(base)


def _check_linear(params: dict[str, Any]) -> None:
    if params["normalize"] and sum(params["weight"]) == 0:
        raise ValueError("merge method 'linear': weights sum to zero, cannot normalise")


@merge_method("linear", per_model=("weight",), needs_base=False, check=_check_linear, chunked=True)
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
    return _combine(None, experts, weight, normalize=normalize, ctx=ctx)


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
        return ops.slerp(t, base, experts[0], dot_threshold=dot_threshold)
    if base is None and len(experts) == 2:
        return ops.slerp(t, experts[0], experts[1], dot_threshold=dot_threshold)
    raise ValueError(
        f"slerp interpolates exactly two models: a base and one expert, or two experts without "
        f"a base; got {'a base and ' if base is not None else ''}{len(experts)} expert(s)"
    )


@merge_method("task_arithmetic", per_model=("weight",), chunked=True)
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
    return _combine(base, experts, weight, normalize=normalize, lambda_=lambda_, ctx=ctx)


def _ties_prepare(
    params: dict[str, Any], make_iter, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Whole-model |τ_i| thresholds, one per expert (a sampled pass and an exact one, see ops); τ
    in ``dtype`` when the engine streams stored-dtype tensors, which are fresh memory maps: the
    sample reads them unpopulated (``make_iter(sparse=True)``), and in the exact pass each is
    counted while the next is mapped."""
    stored = dtype is not None
    thresholds = ops.global_magnitude_thresholds(
        make_iter,
        params["density"],
        dtype,
        fetch_ahead=stored,
        sample_iter=functools.partial(make_iter, sparse=True) if stored else None,
    )
    return {"ties_thresholds": thresholds}


# ctx.stats key of the per-tensor k-th largest |τ_i| an engine computed ahead: (ranks, values)
_TAU_KTH = "tau_kth_largest_abs"


def _tau_kth(
    base: torch.Tensor, experts: list[torch.Tensor], ranks: list[list[int]], ctx: TensorContext
) -> list[list[float]]:
    """``ops.tau_kth_largest_abs`` of this tensor for ``ranks``: what the engine computed ahead
    (:func:`_ahead_tau_kth`, the same call) when it asked for these very ranks, else now."""
    ahead = ctx.stats.get(_TAU_KTH)
    if ahead is not None and ahead[0] == ranks:
        return ahead[1]
    return ops.tau_kth_largest_abs(base, experts, ranks, _compute_dtype(ctx, base))


def _ahead_tau_kth(
    ranks: Callable[[int, dict[str, Any]], list[list[int]] | None],
) -> Callable[..., dict[str, Any]]:
    """An ``ahead`` hook (registry) computing :func:`_tau_kth` for ``ranks(numel, params)``
    (``None``: nothing to compute)."""

    def ahead(
        base: torch.Tensor, experts: list[torch.Tensor], ctx: TensorContext, params: dict
    ) -> dict[str, Any]:
        wanted = ranks(base.numel(), params)
        if wanted is None or not any(wanted):
            return {}
        dtype = _compute_dtype(ctx, base)
        return {_TAU_KTH: (wanted, ops.tau_kth_largest_abs(base, experts, wanted, dtype))}

    return ahead


def _ties_ranks(numel: int, params: dict[str, Any]) -> list[list[int]] | None:
    """The rank of each expert's per-tensor threshold (none for density 1); ``None`` for the
    whole-model trim."""
    if params["trim_scope"] != "tensor":
        return None
    return [[ops.kept_count(d, numel)] if d < 1 else [] for d in params["density"]]


def _breadcrumbs_ranks(numel: int, params: dict[str, Any]) -> list[list[int]]:
    """Each expert's two ranks (ops.outlier_ranks; [] keeps nothing or everything)."""
    return [
        ops.outlier_ranks(numel, d, g) or [] for d, g in zip(params["density"], params["gamma"])
    ]


def _elect_merge_into(
    out: torch.Tensor,
    base: torch.Tensor,
    stack: torch.Tensor,
    weight: list[float],
    *,
    lambda_: float,
    majority_sign: MajoritySign,
    weighted_sign: bool,
    divide_by: DivideBy,
) -> None:
    """out = θ_b + λ · disjoint_merge(elect(stack)) for one chunk (``stack`` is overwritten)."""
    n = out.numel()
    votes = ops.scratch("votes", n, stack.dtype, stack.device).view(out.shape)
    elected = ops.elect_sign(stack, majority_sign, weight if weighted_sign else None, out=votes)
    merged = ops.disjoint_merge_(
        stack,
        elected,
        weight,
        divide_by=divide_by,
        weighted_sign=weighted_sign,
        out=ops.scratch("merged", n, stack.dtype, stack.device).view(out.shape),
    )
    torch.add(base, merged, alpha=lambda_, out=out)


def _compiled_elect_plan(
    dtype: torch.dtype,
    base: torch.Tensor,
    experts: list[torch.Tensor],
    out: torch.Tensor,
    weight: list[float],
    options: dict[str, Any],
) -> tuple | None:
    """``kernels.elect_plan`` for :func:`_elect_merge_into`'s ``options`` when the compiled loops
    can run (float32 compute on the CPU, known options; the torch path raises on the others)."""
    if dtype != torch.float32 or not kernels.usable(base, *experts, out):
        return None
    return _known_elect_plan(weight, options)


def _known_elect_plan(weight: list[float], options: dict[str, Any]) -> tuple | None:
    """``kernels.elect_plan`` for known options (else ``None``: the torch path raises)."""
    if options["majority_sign"] not in ("sum", "count"):
        return None
    if options["divide_by"] not in ("count", "weight_sum", "none"):
        return None
    return kernels.elect_plan(weight, **options)


def _trim_elect_merge(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    thresholds: list[float],
    weight: list[float],
    ctx: TensorContext,
    **options: Any,
) -> torch.Tensor:
    """θ_b + λ · disjoint_merge(elect(trim(τ))) with known |τ_i| thresholds, chunk by chunk on
    every core.

    Only the output and an ``[n_experts, CHUNK]`` scratch buffer per thread are allocated: τ_i is
    formed per chunk, so no full-size stack of task vectors exists (lower peak memory than
    stacking, and the temporaries stay in cache). ``options``: those of :func:`_elect_merge_into`.
    """
    dtype = _compute_dtype(ctx, base)
    flat_base = base.reshape(-1)
    flat_experts = [e.reshape(-1) for e in experts]
    out = _output(ctx, base, dtype)
    plan = _compiled_elect_plan(dtype, base, experts, out, weight, options)
    if plan is not None:  # the same maths in one compiled pass per chunk (kernels)
        params, scalars, flags = plan
        params[:, kernels.P_LOW] = [kernels.trim_below(t) for t in thresholds]
        merger = kernels.ChunkMerger(base, experts, out, params, scalars, flags)
        _run_loop(merger, [base, *experts], out, ctx)
        return out.view(base.shape)

    def merge(part: slice) -> None:
        n = part.stop - part.start
        stack = ops.scratch("stack", len(experts) * n, dtype, out.device).view(-1, n)
        b = ops.as_dtype(flat_base[part], dtype, "in-base")
        for tau, expert, threshold in zip(stack, flat_experts, thresholds):
            torch.sub(ops.as_dtype(expert[part], dtype, "in-expert"), b, out=tau)
            ops.threshold_trim_(tau, threshold)
        result = _result(out, part, dtype)
        _elect_merge_into(result, b, stack, weight, **options)
        _emit(out, part, result)

    ops.for_chunks(flat_base.numel(), merge)
    return out.view(base.shape)


def elect_merge(
    base: torch.Tensor, stack: torch.Tensor, weight: list[float], **options: Any
) -> torch.Tensor:
    """θ_b + λ · disjoint_merge(elect(stack)) for a full ``[n, *shape]`` stack (overwritten),
    chunk by chunk on every core."""
    flat_base = base.reshape(-1)
    flat_stack = stack.reshape(stack.shape[0], -1)
    out = torch.empty_like(flat_base)

    def merge(part: slice) -> None:
        _elect_merge_into(out[part], flat_base[part], flat_stack[:, part], weight, **options)

    ops.for_chunks(flat_base.numel(), merge)
    return out.view(base.shape)


@merge_method(
    "ties",
    per_model=("weight", "density"),
    per_model_defaults={"density": 0.2},
    ranges=_DENSITY_RANGE,
    prepare=_ties_prepare,
    needs_prepare=lambda p: p["trim_scope"] == "model" and any(d < 1 for d in p["density"]),
    chunked=True,
    ahead=_ahead_tau_kth(_ties_ranks),
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
      a two-pass first pass) or per tensor (``"tensor"``: mergekit, PEFT).
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
    if trim_scope == "model":
        if any(d < 1 for d in density) and "ties_thresholds" not in ctx.stats:
            raise ValueError(
                "ties with trim_scope='model' needs whole-model thresholds from its prepare pass: "
                "merge through an engine (merge_state_dicts, merge_models, the checkpoint merger) "
                "or use trim_scope='tensor'"
            )
        thresholds = ctx.stats.get("ties_thresholds", [0.0] * len(experts))
    else:  # the same exact selection, over this tensor only
        ranks = _ties_ranks(base.numel(), {"trim_scope": trim_scope, "density": density})
        found = _tau_kth(base, experts, ranks, ctx)
        thresholds = [values[0] if values else 0.0 for values in found]
    return _trim_elect_merge(
        base,
        experts,
        thresholds,
        weight,
        ctx,
        lambda_=lambda_,
        majority_sign=majority_sign,
        weighted_sign=weighted_sign,
        divide_by=divide_by,
    )


def _whole(
    base: torch.Tensor, experts: list[torch.Tensor], ctx: TensorContext
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The inputs in the compute dtype as whole tensors (for the paths that need whole-tensor
    statistics, e.g. DARE's "l1" rescale)."""
    dtype = _compute_dtype(ctx, base)
    return base.to(dtype), [e.to(dtype) for e in experts]


def _into_out(merged: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
    if ctx.out is None:
        return merged
    ops.parallel_copy_(ctx.out, merged)
    return ctx.out


def _dare_drop(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    density: list[float],
    rescale: DareRescale,
    ctx: TensorContext,
) -> torch.Tensor:
    """Stack of DARE-sparsified task vectors (whole tensors: "l1" needs τ_i's norms before and
    after the drop). Masks from ``ops.dare_keep_mask`` with the tensor's seed, one per expert."""
    tv = ops.task_vectors(base, experts)
    for i, (tau, d) in enumerate(zip(tv, density)):
        if d < 1:  # no draw when nothing is dropped, as in mergekit and PEFT
            keep = ops.dare_keep_mask(tau.shape, d, ctx.tensor_seed, i).to(tau.device)
            ops.random_drop_(tau, keep, d, rescale)
    return tv


def _dare_chunks(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    density: list[float],
    rescale: DareRescale,
    ctx: TensorContext,
    merge_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    compiled: tuple | None = None,
) -> torch.Tensor:
    """DARE's drop (and a per-entry rescale) fused with ``merge_into(result, base, stack)``
    chunk by chunk on every core: τ_i and its mask exist for one chunk at a time. The masks are
    those of :func:`_dare_drop` (``ops.dare_keep_range`` per chunk). ``compiled``: the same merge
    as a ``kernels`` plan (params, scalars, flags), used where the compiled loops run."""
    dtype = _compute_dtype(ctx, base)
    flat_base = base.reshape(-1)
    flat_experts = [e.reshape(-1) for e in experts]
    out = _output(ctx, base, dtype)
    seed = ctx.tensor_seed
    if compiled is not None and dtype == torch.float32 and kernels.usable(base, *experts, out):
        params, scalars, flags = compiled
        for i, d in enumerate(density):
            params[i, kernels.P_DARE_LIMIT] = kernels.dare_limit(d)
            params[i, kernels.P_DARE_DIVISOR] = d if rescale == "keep_rate" and d < 1 else 0.0
        merger = kernels.ChunkMerger(base, experts, out, params, scalars, flags, dare_seed=seed)
        size = kernels.dare_chunk(base.numel(), len(merger.dare))
        _run_loop(merger, [base, *experts], out, ctx, size)
        return out.view(base.shape)

    def merge(part: slice) -> None:
        n = part.stop - part.start
        stack = ops.scratch("stack", len(experts) * n, dtype, out.device).view(-1, n)
        b = ops.as_dtype(flat_base[part], dtype, "in-base")
        for i, (tau, expert, d) in enumerate(zip(stack, flat_experts, density)):
            torch.sub(ops.as_dtype(expert[part], dtype, "in-expert"), b, out=tau)
            if d < 1:
                keep = ops.dare_keep_range(seed, i, part.start, n, d)
                ops.random_drop_(tau, keep.to(tau.device), d, rescale)
        result = _result(out, part, dtype)
        merge_into(result, b, stack)
        _emit(out, part, result)

    ops.for_chunks(flat_base.numel(), merge)
    return out.view(base.shape)


@merge_method(
    "dare_linear",
    per_model=("weight", "density"),
    per_model_defaults={"density": 0.1},
    ranges=_DENSITY_RANGE,
    chunked=True,
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
    if rescale != "l1":  # a per-entry rescale: drop and merge in one chunked pass
        return _dare_chunks(
            base,
            experts,
            density,
            rescale,
            ctx,
            lambda out, b, stack: _sum_rows_into(out, stack, weight, normalize, lambda_, b),
            kernels.sum_plan(weight, lambda_=lambda_, normalize=normalize),
        )
    base, experts = _whole(base, experts, ctx)
    tv = _dare_drop(base, experts, density, rescale, ctx)
    return _into_out(add_scaled_(weighted_sum(tv, weight, normalize), lambda_, base), ctx)


@merge_method(
    "dare_ties",
    per_model=("weight", "density"),
    per_model_defaults={"density": 0.1},
    ranges=_DENSITY_RANGE,
    chunked=True,
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
    options = dict(
        lambda_=lambda_,
        majority_sign=majority_sign,
        weighted_sign=weighted_sign,
        divide_by=divide_by,
    )
    if rescale != "l1":  # a per-entry rescale: drop, elect and merge in one chunked pass
        return _dare_chunks(
            base,
            experts,
            density,
            rescale,
            ctx,
            lambda out, b, stack: _elect_merge_into(out, b, stack, weight, **options),
            _known_elect_plan(weight, options),
        )
    base, experts = _whole(base, experts, ctx)
    tv = _dare_drop(base, experts, density, rescale, ctx)
    return _into_out(elect_merge(base, tv, weight, **options), ctx)


@merge_method(
    "breadcrumbs",
    per_model=("weight", "density", "gamma"),
    per_model_defaults={"density": 0.9, "gamma": 0.01},
    ranges={**_DENSITY_RANGE, "gamma": Interval(0.0, 1.0)},
    chunked=True,
    ahead=_ahead_tau_kth(_breadcrumbs_ranks),
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
    ``density_i`` fraction, dropping the smallest rest (see ``ops.magnitude_outlier_trim_``).
    Defaults density 0.9, gamma 0.01 are mergekit's documented example (its parameter default
    density = 1.0 disables the mask altogether). ``normalize`` divides by Σ w_i as in mergekit.
    """
    ranks = [ops.outlier_ranks(base.numel(), d, g) for d, g in zip(density, gamma)]
    dtype = _compute_dtype(ctx, base)
    wanted = _breadcrumbs_ranks(base.numel(), {"density": density, "gamma": gamma})
    found = _tau_kth(base, experts, wanted, ctx)  # the ranks its ahead hook computes
    flat_base = base.reshape(-1)
    flat_experts = [e.reshape(-1) for e in experts]
    out = _output(ctx, base, dtype)
    if dtype == torch.float32 and kernels.usable(base, *experts, out):  # one compiled pass
        params, scalars, flags = kernels.sum_plan(weight, lambda_=lambda_, normalize=normalize)
        flags[kernels.F_BAND] = 1
        for i, (r, band) in enumerate(zip(ranks, found)):
            if r is None:  # keeps nothing
                params[i, kernels.P_LOW] = math.inf
            elif r:  # τ − hardshrink(τ, largest), trimmed below the smallest kept
                params[i, kernels.P_LOW] = kernels.trim_below(band[0])
                params[i, kernels.P_HIGH] = band[1]
        merger = kernels.ChunkMerger(base, experts, out, params, scalars, flags)
        _run_loop(merger, [base, *experts], out, ctx)
        return out.view(base.shape)

    def merge(part: slice) -> None:  # τ_i trimmed to its band, chunk by chunk on every core
        n = part.stop - part.start
        stack = ops.scratch("stack", len(experts) * n, dtype, out.device).view(-1, n)
        b = ops.as_dtype(flat_base[part], dtype, "in-base")
        for tau, expert, r, band in zip(stack, flat_experts, ranks, found):
            torch.sub(ops.as_dtype(expert[part], dtype, "in-expert"), b, out=tau)
            if r is None:
                tau.zero_()
            elif r:
                ops.band_trim_(tau, *band)
        result = _result(out, part, dtype)
        _sum_rows_into(result, stack, weight, normalize, lambda_, b)
        _emit(out, part, result)

    ops.for_chunks(flat_base.numel(), merge)
    return out.view(base.shape)


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
    return ops.model_stock(base, experts, filter_wise=filter_wise)


# Kept importable from here: ``from mergelab.merge.methods import task_vectors``.
task_vectors = ops.task_vectors
