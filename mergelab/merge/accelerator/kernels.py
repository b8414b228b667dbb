"""Fused compiled loops for the chunked merge methods: one pass per chunk instead of a torch
operation per step (about forty for TIES), with bit-identical results. The merge loops also
report whether they loaded or stored a NaN/Inf (``FOUND_IN_INPUT``, ``FOUND_IN_RESULT``), so the
engines need no separate pass to check.

The loops are C (``mergelab/merge/accelerator/_loops.c``, the extension module
``mergelab.merge.accelerator._loops``), built when the package is installed (``setup.py``);
importing them costs about a millisecond. The plain torch methods (:mod:`mergelab.merge.methods`)
are the specification and run wherever the loops do not: where the package was installed without
a C compiler, or with the accelerator switched off (:mod:`mergelab.merge.accelerator`). The
loops run over the chunks of :func:`.chunks.for_chunks` (fixed chunk boundaries, every core) and
release the GIL:

* ``_loops.merge_chunk`` — per position: widen the stored inputs (bfloat16 or float32) to
  float32, τ_i = θ_i − θ_b, trim (|τ| threshold, or breadcrumbs' band), DARE's random drop and
  rescale, then either the weighted sum (DARE-linear, breadcrumbs) or TIES' sign election and
  disjoint merge, θ_b + λ·…, rounded to the output dtype (bfloat16 round-to-nearest-even, as torch);
* ``_loops.sum_chunk`` — linear's and task arithmetic's weighted sum, per
  position: widen, θ_i − θ_b, Σ w_i ·, ÷ Σ w_i, θ_b + λ ·, round;
* ``_loops.tau_abs_histograms`` — the radix-histogram passes of :class:`.thresholds.KthLargestAbs` over
  |τ_i| for one chunk, straight from the stored inputs, the base read once for every expert; a
  band pass flags the entries in its band with a bit each where the CPU has AVX2
  (``_loops.band_masks(False)`` switches to a byte each, as elsewhere, for the tests);
* ``_loops.tau_kth`` — every pass of one tensor's thresholds (:func:`tau_kth`): the sampled
  pass, the band pass and any exact passes, counted by the same loop as
  ``tau_abs_histograms``, with the decisions between them (:class:`.thresholds.KthLargestAbs`'s) and
  the selection among a band's collected values, in one call on one thread; the chunked passes
  cost a few Python round trips per pass, as much as the counting itself on small tensors.

Every float32 operation is the one torch performs, in the same order: ``add_(x, alpha=w)`` is a
fused multiply-add in torch's vectorised kernels, so it is ``fmaf`` there, and the compiler may
not fuse anything else (``-ffp-contract=off``); ``relu``, ``sign``, ``hardshrink`` and ``clamp``
keep torch's treatment of −0.0. The general loops work on tiles of :data:`TILE` positions (the
task vectors of a tile stay in L1); two bfloat16 experts into a bfloat16 output, the common case,
run one loop per position for each set of options, with the options as compile-time constants;
where the CPU has AVX2 and FMA, the sums and the plain-weight elections among them run versions
written in vector intrinsics (``_loops.vector_loops(False)`` switches back, for the tests).
DARE's masks are the same as the torch path's: the SFC64 stream NumPy would produce for each block
and expert (state taken from ``numpy.random.SFC64``, then generated there), so no generator
changes. A DARE chunk is several blocks (:func:`dare_chunk`), and the loop advances the streams
of all its blocks and experts together, :data:`DARE_LANES` at a time: SFC64 is one long
dependency chain per stream, which a stream at a time cannot speed up. docs/merge_performance.md
gives the costs.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from ..methods.steps import DARE_BLOCK, FLOAT_LAYOUT, half_total, in_dtype, round_exact_sum
from . import chunks, sampling
from .chunks import scratch
from .sampling import RUN_HASH

# MERGELAB_ACCELERATOR=off (or 0, false, no) switches the accelerator off: every merge then runs
# the plain torch methods (tests compare both). ``enabled`` is the one setting
# (:func:`mergelab.merge.accelerator.set_enabled`).
ENV_VAR = "MERGELAB_ACCELERATOR"
enabled = os.environ.get(ENV_VAR, "").strip().lower() not in ("off", "0", "false", "no")

# Positions per tile inside a chunk: the [n_experts, TILE] task vectors of a tile stay in L1.
TILE = 512
# Stored dtypes the loops read and write directly (others are cast chunk by chunk with torch).
_NATIVE = {torch.bfloat16: np.uint16, torch.float32: np.float32}

# merge_chunk's per-expert parameters, columns of a float32 [n_experts, 9] array
P_LOW, P_HIGH, P_DARE_LIMIT, P_DARE_DIVISOR = 0, 1, 2, 3
P_SUM_W, P_VOTE_W, P_FLIP, P_MERGE_W, P_DIVISOR_W = 4, 5, 6, 7, 8
# its flags (int64) and scalars (float32)
F_KIND, F_BAND, F_VOTE_COUNT, F_VOTE_PLAIN, F_ANY_FLIP, F_MERGE_PLAIN = 0, 1, 2, 3, 4, 5
F_DIVIDE_BY, F_DIVISOR_PLAIN, F_ALL_POSITIVE, F_SUM_DIVIDE, F_SCALE = 6, 7, 8, 9, 10
S_LAMBDA, S_TOTAL, S_MIN_W = 0, 1, 2
KIND_SUM, KIND_ELECT = 0, 1
DIVIDE_NONE, DIVIDE_COUNT, DIVIDE_WEIGHT_SUM = 0, 1, 2
# What a merge loop returns: bits set where it met NaN or Inf in an input or a stored result
FOUND_IN_INPUT, FOUND_IN_RESULT = 1, 2
# DARE's random streams the merge loop advances together, in the lanes of one vector register
DARE_LANES = 8


# Constants the C loops were built with, which must be these (a build of an older _loops.c is
# refused rather than misread: rebuild with `pip install -e .` or `python setup.py build_ext -i`)
LOOPS_VERSION = 12
_SHARED_CONSTANTS = {
    "VERSION": LOOPS_VERSION,
    "TILE": TILE,
    "DARE_LANES": DARE_LANES,
    "RUN_HASH": RUN_HASH,
    "P_LOW": P_LOW,
    "P_HIGH": P_HIGH,
    "P_DARE_LIMIT": P_DARE_LIMIT,
    "P_DARE_DIVISOR": P_DARE_DIVISOR,
    "P_SUM_W": P_SUM_W,
    "P_VOTE_W": P_VOTE_W,
    "P_FLIP": P_FLIP,
    "P_MERGE_W": P_MERGE_W,
    "P_DIVISOR_W": P_DIVISOR_W,
    "F_KIND": F_KIND,
    "F_BAND": F_BAND,
    "F_VOTE_COUNT": F_VOTE_COUNT,
    "F_VOTE_PLAIN": F_VOTE_PLAIN,
    "F_ANY_FLIP": F_ANY_FLIP,
    "F_MERGE_PLAIN": F_MERGE_PLAIN,
    "F_DIVIDE_BY": F_DIVIDE_BY,
    "F_DIVISOR_PLAIN": F_DIVISOR_PLAIN,
    "F_ALL_POSITIVE": F_ALL_POSITIVE,
    "F_SUM_DIVIDE": F_SUM_DIVIDE,
    "F_SCALE": F_SCALE,
    "S_LAMBDA": S_LAMBDA,
    "S_TOTAL": S_TOTAL,
    "S_MIN_W": S_MIN_W,
    "KIND_SUM": KIND_SUM,
    "KIND_ELECT": KIND_ELECT,
    "DIVIDE_NONE": DIVIDE_NONE,
    "DIVIDE_COUNT": DIVIDE_COUNT,
    "DIVIDE_WEIGHT_SUM": DIVIDE_WEIGHT_SUM,
    "FOUND_IN_INPUT": FOUND_IN_INPUT,
    "FOUND_IN_RESULT": FOUND_IN_RESULT,
}


@functools.cache
def _extension() -> ModuleType | None:
    """The compiled loops (``mergelab.merge.accelerator._loops``), or ``None`` where the package was
    installed without them (no C compiler at install time)."""
    try:
        from . import _loops
    except ImportError:
        return None
    stale = {k: v for k, v in _SHARED_CONSTANTS.items() if getattr(_loops, k, None) != v}
    if stale:
        raise ImportError(
            f"mergelab.merge.accelerator._loops ({_loops.__file__}) was built from another _loops.c "
            f"(constants {sorted(stale)} differ); rebuild it: pip install -e . "
            "(or python setup.py build_ext --inplace)"
        )
    return _loops


def available() -> bool:
    """Whether the compiled loops were built (accelerator/_loops.c, at install time)."""
    return _extension() is not None


def active() -> bool:
    """Whether the compiled loops run (built, and not switched off: ``enabled``)."""
    return enabled and available()


def loops() -> ModuleType:
    """The compiled loops' module (``mergelab.merge.accelerator._loops``); an ImportError where the
    package was installed without them."""
    compiled = _extension()
    if compiled is None:
        raise ImportError(
            "mergelab's compiled loops were not built (no C compiler when the package was "
            "installed); the merges run the plain torch methods"
        )
    return compiled


def active_loops() -> ModuleType | None:
    """The compiled loops where they run (:func:`active`), else ``None``."""
    return _extension() if enabled else None


def file_mapping() -> type | None:
    """``_loops.Mapping`` (a read-only memory map of part of a file, made and released without
    holding the GIL) where the loops were built for a system with mmap, else ``None``. It is not
    a merge loop: switching the accelerator off leaves it on."""
    compiled = _extension()
    return getattr(compiled, "Mapping", None) if compiled is not None else None


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled loops run for these tensors: active, and all of them on the CPU
    (inputs in other dtypes than bfloat16 and float32 are cast chunk by chunk)."""
    return active() and all(t.device.type == "cpu" for t in tensors)


def all_finite_compiled(x: torch.Tensor) -> bool | None:
    """Whether ``x`` has no NaN/Inf, by a compiled loop, where the loops run and ``x`` is a
    contiguous bfloat16 or float32 CPU tensor; else ``None`` (check with torch)."""
    compiled = active_loops()
    if compiled is None or x.device.type != "cpu" or x.dtype not in _NATIVE:
        return None
    if not x.is_contiguous():
        return None
    return bool(compiled.all_finite(x.data_ptr(), x.dtype == torch.bfloat16, x.numel()))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1)  # the loops read raw memory: contiguous, no copy if already


# --- Python side: parameters and calls ----------------------------------------------------------


def _f32(x: float) -> float:
    return float(np.float32(x))


def _plain(weights: Sequence[float] | None) -> bool:
    """steps._weighted_rows_sum's test for a plain sum (no multiplications)."""
    return weights is None or all(w == 1 for w in weights)


def _flip(w: float) -> float:
    return math.copysign(1.0, w) * (w != 0)


def elect_plan(
    weights: Sequence[float],
    *,
    lambda_: float,
    majority_sign: str,
    weighted_sign: bool,
    divide_by: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """merge_chunk's (params, scalars, flags) for TIES' elect and disjoint merge (kind ELECT);
    per-expert trim/DARE columns are filled in by the caller. Mirrors steps.elect_sign and
    steps.disjoint_merge_ (which raise on unknown options before this runs)."""
    n = len(weights)
    params = np.zeros((n, 9), dtype=np.float32)
    params[:, P_LOW] = -1.0  # hardshrink with λ < 0 keeps everything
    params[:, P_HIGH] = np.inf
    flags = np.zeros(11, dtype=np.int64)
    flags[F_KIND] = KIND_ELECT
    vote_weights = list(weights) if weighted_sign else None
    if majority_sign == "count" and vote_weights is not None:
        vote_weights = [_flip(w) for w in vote_weights]
    flags[F_VOTE_COUNT] = majority_sign == "count"
    flags[F_VOTE_PLAIN] = _plain(vote_weights)
    if vote_weights is not None:
        params[:, P_VOTE_W] = vote_weights
    flips = [_flip(w) if weighted_sign else 1.0 for w in weights]
    params[:, P_FLIP] = flips
    flags[F_ANY_FLIP] = any(f != 1 for f in flips)
    merge_weights = [w * f for w, f in zip(weights, flips)]
    params[:, P_MERGE_W] = merge_weights
    flags[F_MERGE_PLAIN] = _plain(merge_weights)
    flags[F_DIVIDE_BY] = {"none": DIVIDE_NONE, "count": DIVIDE_COUNT}.get(
        divide_by, DIVIDE_WEIGHT_SUM
    )
    params[:, P_DIVISOR_W] = weights
    flags[F_DIVISOR_PLAIN] = _plain(weights)
    flags[F_ALL_POSITIVE] = all(w > 0 for w in weights)
    scalars = np.array([lambda_, 0.0, min(weights)], dtype=np.float32)
    return params, scalars, flags


def sum_plan(
    weights: Sequence[float], *, lambda_: float, normalize: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """merge_chunk's (params, scalars, flags) for θ_b + λ Σ w_i τ_i (steps.weighted_sum, then add_scaled_)."""
    n = len(weights)
    params = np.zeros((n, 9), dtype=np.float32)
    params[:, P_LOW] = -1.0
    params[:, P_HIGH] = np.inf
    params[:, P_SUM_W] = weights
    flags = np.zeros(11, dtype=np.int64)
    flags[F_KIND] = KIND_SUM
    total = sum(weights)
    flags[F_SUM_DIVIDE] = normalize and abs(total) >= 1e-8
    flags[F_SCALE] = lambda_ != 1
    scalars = np.array([lambda_, total, 0.0], dtype=np.float32)
    return params, scalars, flags


def half_plan(
    weights: Sequence[float],
    dtype: torch.dtype,
    *,
    lambda_: float,
    normalize: bool = False,
    elect: dict[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """half_chunk's (params, scalars, flags) for a merge computed in ``dtype`` (bfloat16 or
    float16): Σ w_i τ_i (steps.half_weighted_sum, then add_scaled_), or with ``elect`` (TIES'
    ``majority_sign``, ``weighted_sign`` and ``divide_by``) elect_sign and disjoint_merge_ in
    that dtype, then add_scaled_. Every weight is rounded to ``dtype`` as the steps round it
    (steps.in_dtype); per-expert trim columns are filled in by the caller."""
    n = len(weights)

    def rounded(values: Sequence[float]) -> list[float]:
        return [float(in_dtype(float(v), dtype)) for v in values]

    params = np.zeros((n, 9), dtype=np.float32)
    params[:, P_LOW] = -1.0  # hardshrink with λ < 0 keeps everything
    params[:, P_HIGH] = np.inf
    flags = np.zeros(11, dtype=np.int64)
    scalars = np.array([lambda_, 0.0, 0.0], dtype=np.float32)
    flags[F_SCALE] = lambda_ != 1
    if elect is None:
        flags[F_KIND] = KIND_SUM
        params[:, P_SUM_W] = rounded(weights)
        total = half_total(weights, dtype)
        flags[F_SUM_DIVIDE] = normalize and abs(total) >= 1e-8
        scalars[S_TOTAL] = total
        return params, scalars, flags
    flags[F_KIND] = KIND_ELECT
    weighted_sign = elect["weighted_sign"]
    votes = list(weights) if weighted_sign else [1.0] * n
    if elect["majority_sign"] == "count":
        votes = [_flip(w) for w in votes]
    flags[F_VOTE_COUNT] = elect["majority_sign"] == "count"
    params[:, P_VOTE_W] = rounded(votes)
    flips = [_flip(w) if weighted_sign else 1.0 for w in weights]
    params[:, P_FLIP] = flips
    flags[F_ANY_FLIP] = any(f != 1 for f in flips)
    params[:, P_MERGE_W] = rounded([w * f for w, f in zip(weights, flips)])
    flags[F_DIVIDE_BY] = {"none": DIVIDE_NONE, "count": DIVIDE_COUNT}.get(
        elect["divide_by"], DIVIDE_WEIGHT_SUM
    )
    params[:, P_DIVISOR_W] = rounded(weights)
    flags[F_ALL_POSITIVE] = all(w > 0 for w in weights)
    scalars[S_MIN_W] = rounded([min(weights)])[0]
    return params, scalars, flags


def half_merge(
    base: torch.Tensor | None,
    rows: Sequence[torch.Tensor],
    out: torch.Tensor,
    plan: tuple[np.ndarray, np.ndarray, np.ndarray],
    *,
    drops: Sequence[tuple[np.ndarray, int, float] | None] | None = None,
) -> bool:
    """half_chunk over every chunk of ``out`` on every core: the merge ``plan``
    (:func:`half_plan`) of ``base`` (``None``: a sum without one) and the experts ``rows``,
    computed in ``out``'s dtype, written into ``out``.
    Every tensor contiguous, on the CPU, in that dtype (bfloat16 or float16), of one size.
    ``drops``: per row, ``None`` or DARE's drop of that row's task vector
    (:func:`dare_keep_bits`), applied in the loop after the trim.

    Returns False where it does not apply (the loops not active, another dtype or layout) or
    where the loop met NaN or Inf in an input, a vote, a sum or a result: ``out`` then holds
    anything, and the caller runs the steps."""
    compiled = active_loops()
    inputs = ([] if base is None else [base]) + list(rows)
    if compiled is None or out.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not all(
        x.dtype == out.dtype
        and x.device.type == "cpu"
        and x.is_contiguous()
        and x.numel() == out.numel()
        for x in [*inputs, out]
    ):
        return False
    params, scalars, flags = plan
    drops = list(drops or [None] * len(rows))
    if any(d is not None for d in drops):
        params = params.copy()
        for i, d in enumerate(drops):
            if d is not None:  # the loop's drop modes: 1 keep only, 2 multiply, 3 divide
                mode, scale = d[1], d[2]
                params[i, P_DARE_LIMIT] = {_KEEP_ONLY: 1, _MULTIPLY: 2, _DIVIDE: 3}[mode]
                params[i, P_DARE_DIVISOR] = scale
    keeps = np.array([0 if d is None else d[0].ctypes.data for d in drops], dtype=np.int64)
    fp16 = out.dtype == torch.float16
    starts = np.array([x.data_ptr() for x in inputs], dtype=np.int64)
    out_start, item = out.data_ptr(), out.element_size()

    def part(s: slice) -> int:
        return compiled.half_chunk(
            starts + s.start * item,
            base is not None,
            fp16,
            s.stop - s.start,
            out_start + s.start * item,
            params,
            scalars,
            flags,
            np.where(keeps != 0, keeps + s.start // 8, 0),
        )

    # chunks (chunks.CHUNK entries) start at multiples of 8: each keep bit is its entry's bit j % 8
    return not any(chunks.for_chunks(out.numel(), part))


def trim_below(threshold: float) -> float:
    """The hardshrink λ of steps.threshold_trim_: keep |τ| ≥ ``threshold`` (−1: keep all,
    inf: none)."""
    if threshold == math.inf:
        return math.inf
    if threshold <= 0:
        return -1.0
    as_float32 = np.float32(threshold)
    if float(as_float32) >= threshold:
        as_float32 = np.nextafter(as_float32, np.float32(0))
    return float(as_float32)


def dare_limit(density: float) -> float:
    """The float32 comparison limit of steps.dare_keep_block (0: no drop)."""
    if density >= 1:
        return 0.0
    return _f32(1 + round(density * (1 << 23)) / (1 << 23))


def dare_chunk(numel: int, n_dropping: int) -> int:
    """Entries per chunk of a DARE merge of ``numel``-entry tensors: whole blocks of
    ``steps.DARE_BLOCK``, as many as fill the DARE_LANES streams one merge loop advances
    together (one per block and expert that drops), but no more than leave every worker
    thread a chunk."""
    blocks = -(-numel // DARE_BLOCK)
    fill = DARE_LANES // max(1, n_dropping)
    share = blocks // max(1, torch.get_num_threads())
    return max(1, min(fill, share)) * DARE_BLOCK


@functools.lru_cache(maxsize=1 << 14)
def sfc64_state(seed: int, expert: int, block: int) -> np.ndarray:
    """SFC64's state [a, b, c, counter] for ``SeedSequence(seed, spawn_key=(expert, block))``,
    the stream steps.dare_keep_block draws from (read-only: every tensor of a merge starts its
    blocks' streams from the same states, so they are made once)."""
    generator = np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(expert, block)))
    state = np.asarray(generator.state["state"]["state"], dtype=np.uint64)
    state.flags.writeable = False
    return state


# DARE's drop in half precision: how dare_drop_ scales the kept entries (dare_drop_apply's mode)
_KEEP_ONLY, _MULTIPLY, _DIVIDE = 0, 1, 2


def dare_drop_(
    tau: torch.Tensor,
    density: float,
    seed: int,
    expert: int,
    rescale: str,
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> bool:
    """``steps.random_drop_(tau, steps.dare_keep_mask(tau.shape, density, seed, expert),
    density, rescale)`` on a contiguous bfloat16/float16 CPU task vector, the same bits, in two
    compiled passes over it and no tensor-sized temporaries: :func:`dare_keep_bits`, then one
    that drops and rescales in place, rounding as torch's ``mul_``/``div_`` do.

    Returns False where it does not apply (see :func:`dare_keep_bits`): ``tau`` is then
    untouched or, with ``inputs``, may hold the difference; the caller runs the method's steps."""
    drop = dare_keep_bits(tau, density, seed, expert, rescale, inputs)
    if drop is None:
        return False
    apply_keep_bits_(tau, drop)
    return True


def apply_keep_bits_(tau: torch.Tensor, drop: tuple[np.ndarray, int, float]) -> None:
    """The second pass of :func:`dare_drop_`: ``tau``'s drop (:func:`dare_keep_bits`) in place."""
    compiled, (keep, mode, scale) = loops(), drop
    flat, numel = tau.view(-1), tau.numel()
    address, item, fp16 = flat.data_ptr(), flat.element_size(), tau.dtype == torch.float16

    def apply(part: slice) -> None:
        bits = keep[part.start // 8 : (part.stop + 7) // 8]
        start = address + part.start * item
        compiled.dare_drop_apply(start, part.stop - part.start, fp16, bits, mode, scale)

    chunks.for_chunks(numel, apply, dare_chunk(numel, 1))


def dare_keep_bits(
    tau: torch.Tensor | None,
    density: float,
    seed: int,
    expert: int,
    rescale: str,
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[np.ndarray, int, float] | None:
    """The first pass of :func:`dare_drop_`: each entry's keep bit (:func:`dare_counts`) and
    the drop's mode and scale (``_KEEP_ONLY``; ``_DIVIDE`` by the keep rate; ``_MULTIPLY`` by
    Σ|τ| / Σ kept |τ|, both summed exactly and rounded once, as ``steps.random_drop_`` does).

    ``None`` where it does not apply: the loops not active, another dtype or layout, a NaN or
    an Inf in ``tau``, a rescale that is not finite."""
    if rescale not in ("keep_rate", "l1", "none"):
        return None
    counted = dare_counts(tau, density, seed, expert, inputs)  # raises without tau or inputs
    dtype = (tau if tau is not None else inputs[0]).dtype
    return None if counted is None else _drop_of(counted, density, rescale, dtype)


def dare_keep_bits_many(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    densities: Sequence[float],
    seed: int,
    indices: Sequence[int],
    rescale: str,
) -> list[tuple[np.ndarray, int, float]] | None:
    """:func:`dare_keep_bits` of τ_i = experts[i] − base for every expert at once (expert
    number ``indices[i]``, density ``densities[i]``), in one pass that reads each tile of the
    base once (:func:`dare_counts_many`); ``None`` where any of them does not apply."""
    if rescale not in ("keep_rate", "l1", "none"):
        return None
    counted = dare_counts_many(base, experts, densities, seed, indices)
    if counted is None:
        return None
    drops = [_drop_of(c, d, rescale, base.dtype) for c, d in zip(counted, densities)]
    return None if any(d is None for d in drops) else drops


def _drop_of(
    counted: tuple[np.ndarray, list[int], list[int]], density: float, rescale: str, dtype
) -> tuple[np.ndarray, int, float] | None:
    """The drop (keep bits, mode, scale) of one expert's :func:`dare_counts`."""
    keep, every, kept = counted
    mode, scale = _KEEP_ONLY, 1.0
    if rescale == "keep_rate":
        mode, scale = _DIVIDE, density
    elif rescale == "l1":  # steps.random_drop_'s test and ratio, on the same 0-d tensors
        _, mantissa_bits, bias = FLOAT_LAYOUT[dtype]
        before = torch.tensor(round_exact_sum(every, mantissa_bits, bias), dtype=dtype)
        after = torch.tensor(round_exact_sum(kept, mantissa_bits, bias), dtype=dtype)
        if before >= 1e-7 and after >= 1e-7:
            mode, scale = _MULTIPLY, float(before / after)
            if not math.isfinite(scale):
                return None
    return keep, mode, scale


def dare_counts(
    tau: torch.Tensor | None,
    density: float,
    seed: int,
    expert: int,
    inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[np.ndarray, list[int], list[int]] | None:
    """One compiled pass over a half-precision task vector: each entry's keep bit (bit j of
    byte j // 8; ``steps.dare_keep_mask``'s draws, compared as integers) and the exact sums
    Σ|τ| and Σ kept |τ| as :func:`steps.round_exact_sum` takes them (per exponent bin; a bin
    may hold a whole tile's sum, so the lists are equal to ``steps.exact_sum_per_exponent``'s
    in total, not bin by bin). With ``inputs`` (base, expert: contiguous, tau's dtype and size)
    it writes ``tau = expert − base`` first, as ``torch.sub`` does (``steps.task_vectors``), or
    with ``tau`` ``None`` only forms it (a merge that forms it again, :func:`half_merge`, needs
    no stored copy).

    ``None`` where it does not apply: the loops not active, another dtype or layout, a density
    outside (0, 1), a NaN or an Inf in ``tau``."""
    if tau is None and inputs is None:
        raise ValueError("dare_counts: no task vector and no inputs to form it from")
    base, experts = (None, None) if inputs is None else (inputs[0], [inputs[1]])
    found = _counts([tau], base, experts, [density], seed, [expert])
    return None if found is None else found[0]


def dare_counts_many(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    densities: Sequence[float],
    seed: int,
    indices: Sequence[int],
) -> list[tuple[np.ndarray, list[int], list[int]]] | None:
    """:func:`dare_counts` of τ_i = experts[i] − base (formed, not stored) for every expert in
    one pass: the experts take turns tile by tile, so each tile of the base is read from memory
    once. ``None`` where any of them does not apply."""
    return _counts([None] * len(experts), base, list(experts), densities, seed, indices)


def _counts(
    taus: list[torch.Tensor | None],
    base: torch.Tensor | None,
    experts: list[torch.Tensor] | None,
    densities: Sequence[float],
    seed: int,
    indices: Sequence[int],
) -> list[tuple[np.ndarray, list[int], list[int]]] | None:
    """``_loops.dare_drop_counts`` over the chunks of k task vectors (stored ``taus``, or
    formed from ``base`` and ``experts``)."""
    compiled = active_loops()
    like = base if base is not None else taus[0]
    if compiled is None or like.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not all(0 < d < 1 for d in densities):
        return None
    tensors = [x for x in [*taus, base, *(experts or [])] if x is not None]
    if not all(
        x.dtype == like.dtype and x.is_contiguous() and x.device.type == "cpu" for x in tensors
    ) or any(x.numel() != like.numel() for x in tensors):
        return None
    k, numel = len(taus), like.numel()
    fp16 = like.dtype == torch.float16
    _, mantissa_bits, _ = FLOAT_LAYOUT[like.dtype]
    bins = 1 << (15 - mantissa_bits)
    size = dare_chunk(numel, 1)
    keeps = np.empty((k, (numel + 7) // 8), dtype=np.uint8)
    limits = np.array([round(d * (1 << 23)) for d in densities], dtype=np.int64)
    item = like.element_size()
    tau_addresses = [0 if t is None else t.data_ptr() for t in taus]
    base_address = 0 if base is None else base.data_ptr()
    expert_addresses = [0] * k if experts is None else [x.data_ptr() for x in experts]
    keep_addresses = np.array([row.ctypes.data for row in keeps], dtype=np.int64)

    def count(part: slice) -> tuple[np.ndarray, np.ndarray]:
        first, m = part.start // DARE_BLOCK, part.stop - part.start
        blocks = -(-m // DARE_BLOCK)
        states = np.zeros((k, -(-blocks // DARE_LANES), 4, DARE_LANES), dtype=np.uint64)
        for i, expert in enumerate(indices):
            for b in range(blocks):
                states[i, b // DARE_LANES, :, b % DARE_LANES] = sfc64_state(seed, expert, first + b)
        # bin e's sum: [e] + ([bins + e] << 32), the high parts after the low ones
        every, kept = np.zeros((k, 2 * bins), dtype=np.int64), np.zeros((k, 2 * bins), np.int64)
        offset = part.start * item

        def shifted(addresses: list[int]) -> np.ndarray:
            return np.array([a + offset if a else 0 for a in addresses], dtype=np.int64)

        compiled.dare_drop_counts(
            shifted(tau_addresses),
            base_address + offset if base_address else 0,
            shifted(expert_addresses),
            m,
            fp16,
            limits,
            states,
            DARE_BLOCK,
            keep_addresses + part.start // 8,
            every,
            kept,
        )
        return every, kept

    counted = chunks.for_chunks(numel, count, size)
    # a chunk (at most DARE_LANES blocks, 2^21 entries) adds parts below 2^32 per tile of 2^13
    # entries (or a mantissa below 2^11 per entry): below 2^41 a chunk, so int64 sums are exact
    sums = [sum(c[j] for c in counted).astype(object) for j in (0, 1)]
    every, kept = ((s[:, :bins] + (s[:, bins:] << 32)).tolist() for s in sums)
    if any(row[-1] for row in every):  # the top exponent: a NaN or an Inf
        return None
    return [(keeps[i], every[i], kept[i]) for i in range(k)]


class ChunkMerger:
    """Runs ``_loops.merge_chunk`` over the chunks of one tensor: ``merger(part)``
    merges ``part`` into ``out`` (to hand to ``chunks.for_chunks``). Inputs in another dtype than
    bfloat16 or float32 are cast to float32 per chunk, and an output in another dtype is rounded
    from a float32 scratch buffer, with torch, as the torch path does."""

    def __init__(
        self,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        out: torch.Tensor,
        params: np.ndarray,
        scalars: np.ndarray,
        flags: np.ndarray,
        dare_seed: int | None = None,
    ) -> None:
        self.inputs = _Inputs(base, experts)
        self.out = out.view(-1)
        self.params, self.scalars, self.flags = params, scalars, flags
        self.dare_seed = dare_seed
        self.dare = [i for i in range(len(experts)) if params[i, P_DARE_LIMIT] != 0]
        self.n_experts = len(experts)
        self.no_lanes = np.zeros((0, len(experts)), dtype=np.int64)
        self.no_states = np.zeros((0, 4, DARE_LANES), dtype=np.uint64)

    def __call__(self, part: slice) -> None:
        m = part.stop - part.start
        addresses = np.array(self.inputs.addresses(part), dtype=np.int64)
        states, lanes = self.no_states, self.no_lanes
        if self.dare:
            if part.start % DARE_BLOCK:
                raise ValueError("DARE chunks start at a multiple of steps.DARE_BLOCK entries")
            states, lanes = self._streams(part.start // DARE_BLOCK, -(-m // DARE_BLOCK))
        direct = self.out.dtype in _NATIVE
        result = self.out[part] if direct else scratch("kernel-out", m)
        bf16_out = result.dtype == torch.bfloat16
        found = loops().merge_chunk(
            addresses,
            self.inputs.bf16,
            m,
            result.data_ptr(),
            bf16_out,
            self.params,
            self.scalars,
            self.flags,
            states,
            lanes,
            DARE_BLOCK,
        )
        return _finish(self.out, part, result, direct, found)

    def _streams(self, first: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """merge_chunk's ``states`` and ``lanes`` for blocks ``first`` … ``first + blocks − 1``:
        one stream per block and expert that drops, DARE_LANES to a vector."""
        lanes = np.full((blocks, self.n_experts), -1, dtype=np.int64)
        pairs = [(block, i) for block in range(blocks) for i in self.dare]
        states = np.zeros((-(-len(pairs) // DARE_LANES), 4, DARE_LANES), dtype=np.uint64)
        for lane, (block, i) in enumerate(pairs):
            states[lane // DARE_LANES, :, lane % DARE_LANES] = sfc64_state(
                self.dare_seed, i, first + block
            )
            lanes[block, i] = lane
        return states, lanes


def _finish(out: torch.Tensor, part: slice, result: torch.Tensor, direct: bool, found: int) -> int:
    """A loop's flags for ``out[part]``, after rounding a float32 ``result`` into an output
    of another dtype (whose stored entries the loop did not see: checked here)."""
    if direct:
        return int(found)
    target = out[part]
    target.copy_(result)
    return (int(found) & FOUND_IN_INPUT) | (0 if all_finite_chunk(target) else FOUND_IN_RESULT)


class ChunkSummer:
    """Runs ``_loops.sum_chunk`` (the weighted sum of linear and task arithmetic) over the chunks of one tensor, as :class:`ChunkMerger` runs merge_chunk;
    ``summer(part)`` returns the chunk's NaN/Inf flags."""

    def __init__(
        self,
        base: torch.Tensor | None,
        experts: Sequence[torch.Tensor],
        out: torch.Tensor,
        weights: Sequence[float],
        *,
        lambda_: float,
        normalize: bool,
    ) -> None:
        self.inputs = _Inputs(base, experts)
        self.has_base = base is not None
        self.out = out.view(-1)
        total = sum(weights)
        self.weights = np.array(weights, dtype=np.float32)
        self.scalars = np.array([lambda_, total, 0.0], dtype=np.float32)
        self.flags = np.zeros(11, dtype=np.int64)
        self.flags[F_SUM_DIVIDE] = normalize and abs(total) >= 1e-8

    def __call__(self, part: slice) -> int:
        m = part.stop - part.start
        direct = self.out.dtype in _NATIVE
        result = self.out[part] if direct else scratch("kernel-out", m)
        found = loops().sum_chunk(
            np.array(self.inputs.addresses(part), dtype=np.int64),
            self.has_base,
            self.inputs.bf16,
            m,
            result.data_ptr(),
            result.dtype == torch.bfloat16,
            self.weights,
            self.scalars,
            self.flags,
        )
        return _finish(self.out, part, result, direct, found)


class _Inputs:
    """Base (if any) and expert tensors as the loops read them: flat, contiguous, bfloat16 or
    float32 (anything else is cast to float32 chunk by chunk, into this thread's scratch
    buffers)."""

    def __init__(self, base: torch.Tensor | None, experts: Sequence[torch.Tensor]) -> None:
        self.tensors = ([] if base is None else [_flat(base)]) + [_flat(e) for e in experts]
        dtype = self.tensors[0].dtype
        self.cast = dtype not in _NATIVE
        self.bf16 = dtype == torch.bfloat16
        self.itemsize = dtype.itemsize
        self.starts = [x.data_ptr() for x in self.tensors]

    def addresses(self, part: slice) -> list[int]:
        """Where entry ``part.start`` of each input is (the base first, if any)."""
        if self.cast:
            m = part.stop - part.start
            return [
                scratch(f"kernel-in-{i}", m).copy_(x[part]).data_ptr()
                for i, x in enumerate(self.tensors)
            ]
        return [a + part.start * self.itemsize for a in self.starts]


class TauHistograms:
    """:class:`.thresholds.KthLargestAbs` passes over |τ_i| = |θ_i − θ_b|, τ formed in float32 straight
    from the stored inputs (what thresholds._tau_histograms computes with torch)."""

    def __init__(self, base: torch.Tensor, experts: Sequence[torch.Tensor]) -> None:
        self.inputs = _Inputs(base, experts)

    def pass_counts(self, finders: Sequence[tuple[int, int, tuple | None]]) -> PassCounts:
        """The counting function of one pass of finders given as (expert, stride,
        ``KthLargestAbs.pass_bins()``)."""
        return PassCounts(self.inputs, finders)

    def count(self, part: slice, finders: Sequence[tuple[int, int, tuple | None]]) -> list:
        """One chunk's counts per finder, as :meth:`PassCounts.totals` gives them."""
        counting = self.pass_counts(finders)
        counting(part)
        return counting.totals()


def one_call_kth(base: torch.Tensor, experts: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`tau_kth` takes these inputs: the loops run, all of them on the CPU in the
    same stored dtype, bfloat16 or float32, with the same number of entries, below 2³¹."""
    return (
        usable(base, *experts)
        and base.dtype in _NATIVE
        and all(e.dtype == base.dtype and e.numel() == base.numel() for e in experts)
        and 0 < base.numel() < 2**31
    )


def tau_kth(
    base: torch.Tensor, experts: Sequence[torch.Tensor], ranks: Sequence[Sequence[int]]
) -> tuple[list[list[int]], int]:
    """For every expert i and every k in ``ranks[i]`` (1 ≤ k ≤ numel): the exact k-th largest
    |τ_i| = |θ_i − θ_b| (τ in float32) of one tensor, as float32 bit patterns, and how many
    passes over the inputs that took. The passes of
    :class:`.thresholds.KthLargestAbs` (sampled first pass, band, two exact passes where the band
    missed), each expert's ranks sharing them and the base read once for all experts, in one
    compiled call on the calling thread: none of the per-pass Python of the chunked passes
    (:func:`.thresholds._find_many`), whose sample it takes (the runs of every chunk of
    ``sampling.histogram_chunk`` entries), so it makes the same passes. Inputs as
    :func:`one_call_kth` takes them."""
    flat = [_flat(base), *(_flat(e) for e in experts)]
    which = np.array([i for i, ks in enumerate(ranks) for _ in ks], dtype=np.int64)
    ks = np.array([k for group in ranks for k in group], dtype=np.int64)
    out = np.zeros(len(ks), dtype=np.int64)
    passes = 0
    if len(ks):
        passes = loops().tau_kth(
            np.array([x.data_ptr() for x in flat], dtype=np.int64),
            base.dtype == torch.bfloat16,
            base.numel(),
            sampling.sample_stride(base.numel()),
            sampling.SAMPLE_RUN,
            sampling.histogram_chunk(base.numel()),
            sampling.COLLECT_MAX,
            sampling.MAX_BAND_BUCKETS,
            which,
            ks,
            out,
        )
    found = iter(out.tolist())
    return [[next(found) for _ in group] for group in ranks], passes


# A worker thread's int32 counts of a PassCounts move to int64 after this many entries (each
# call of the loop counts fewer than 2³¹).
WIDEN_ENTRIES = 1 << 30


class PassCounts:
    """One histogram pass: ``self(part)`` counts a chunk of the bound inputs (``count(inputs,
    part)`` of any inputs: one pass over many tensors) into this worker thread's own arrays
    (and returns ``None`` per finder: nothing to add per chunk); ``totals()`` adds the threads'
    arrays up, once. Passes with the same stride share one read of each chunk. A collecting
    pass (``KthLargestAbs`` "collect") keeps the bit patterns in its band in the thread's own
    array too, up to ``sampling.COLLECT_MAX`` per thread. The loops count into int32 (half the cache
    footprint of the band's random increments); a thread's counts move to int64 before they
    could overflow, so a pass may cover any number of entries."""

    def __init__(
        self, inputs: _Inputs | None, finders: Sequence[tuple[int, int, tuple | None]]
    ) -> None:
        self.inputs = inputs
        self.n = len(finders)
        self.groups = []  # (stride, finder indices, experts, top_bits, lows, widths, collect,
        #                   sizes, capacity)
        live = [(k, f) for k, f in enumerate(finders) if f[2] is not None]
        for step in sorted({f[1] for _, f in live}):
            group = sorted((f[0], k) for k, f in live if f[1] == step)
            ks = [k for _, k in group]
            bins = [finders[k][2] for k in ks]
            collect = [b[2] for b in bins]
            self.groups.append(
                (
                    step,
                    ks,
                    np.array([e for e, _ in group], dtype=np.int64),
                    np.array([b[0] is None for b in bins], dtype=np.bool_),
                    np.array([b[0] or 0 for b in bins], dtype=np.int64),
                    np.array([b[1] for b in bins], dtype=np.int64),
                    np.array(collect, dtype=np.bool_),
                    [2 if c else b[1] + (0 if b[0] is None else 2) for b, c in zip(bins, collect)],
                    sampling.COLLECT_MAX if any(collect) else 0,
                )
            )
        self.per_thread: dict[int, _ThreadCounts] = {}
        self.lock = threading.Lock()

    def __call__(self, part: slice) -> list[None]:
        return self.count(self.inputs, part)

    def counting(self, base: torch.Tensor, experts: Sequence[torch.Tensor]) -> Callable:
        """The counting function of this pass's chunks of another tensor's inputs."""
        return functools.partial(self.count, _Inputs(base, experts))

    def count(self, inputs: _Inputs, part: slice) -> list[None]:
        """Count ``part`` of ``inputs`` into this thread's arrays."""
        mine = self.per_thread.get(threading.get_ident())
        if mine is None:
            mine = _ThreadCounts(self.groups)
            with self.lock:
                self.per_thread[threading.get_ident()] = mine
        m = part.stop - part.start
        addresses = np.array(inputs.addresses(part), dtype=np.int64)
        for (step, _, experts, top_bits, lows, widths, collect, *_), counts, values, filled in zip(
            self.groups, mine.counts, mine.values, mine.filled
        ):
            loops().tau_abs_histograms(
                addresses,
                inputs.bf16,
                m,
                step,
                sampling.SAMPLE_RUN,
                experts,
                top_bits,
                lows,
                widths,
                collect,
                counts,
                values,
                filled,
            )
        mine.entries += m
        if mine.entries >= WIDEN_ENTRIES:  # before any int32 bin could pass 2³¹ − 1
            mine.widen()
        return [None] * self.n

    def totals(self) -> list[Any]:
        """Per finder: its counts (an int64 tensor), or for a collecting pass the pair (counts
        below and above the band, the collected bit patterns: ``None`` if a thread met more
        than it could keep); ``None`` for a finished finder."""
        out: list[Any] = [None] * self.n
        threads = list(self.per_thread.values())
        for g, (_, ks, *_, collect, sizes, capacity) in enumerate(self.groups):
            if not threads:
                break
            total = np.zeros(threads[0].counts[g].shape, dtype=np.int64)
            for t in threads:
                total += t.counts[g]
                if t.wide is not None:
                    total += t.wide[g]
            for row, (k, size) in enumerate(zip(ks, sizes)):
                if not collect[row]:
                    out[k] = torch.from_numpy(total[row, :size])  # the finder adds it up
                    continue
                kept = [(t.values[g][row], int(t.filled[g][row])) for t in threads]
                found = None
                if all(n <= capacity for _, n in kept):
                    found = np.concatenate([v[:n] for v, n in kept])
                out[k] = (total[row, :2], found)
        return out


class _ThreadCounts:
    """One worker thread's arrays of a :class:`PassCounts`, per group: the loops' int32 counts,
    their int64 running totals, the collected bit patterns (uninitialised until written) and
    how many each row collected."""

    def __init__(self, groups: list) -> None:
        self.counts = [np.zeros((len(g[1]), max(g[7])), dtype=np.int32) for g in groups]
        self.wide: list[np.ndarray] | None = None  # made by the first widen()
        self.values = [np.empty((len(g[1]), g[8]), dtype=np.int32) for g in groups]
        self.filled = [np.zeros(len(g[1]), dtype=np.int64) for g in groups]
        self.entries = 0  # counted into the int32 arrays since they were last widened

    def widen(self) -> None:
        if self.wide is None:
            self.wide = [np.zeros(c.shape, dtype=np.int64) for c in self.counts]
        for wide, counts in zip(self.wide, self.counts):
            wide += counts
            counts[:] = 0
        self.entries = 0


# --- checks and copies on every core --------------------------------------------------------------


def all_finite_chunk(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``: by a compiled loop where the loops run (exponent bits, one pass), else
    with torch: a sum is finite whenever ``x`` is (unless it overflows); only a non-finite sum
    needs the exact element-wise check."""
    compiled = all_finite_compiled(x)
    if compiled is not None:
        return compiled
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def parallel_copy_(
    dst: torch.Tensor, src: torch.Tensor, *, check: Literal["src", "dst"] | None = None
) -> bool:
    """``dst.copy_(src)`` (casting) chunk by chunk on every core; ``dst`` contiguous, same numel.

    With ``check`` ("src" or "dst"), returns whether every entry of that side is finite (one
    cheap pass per chunk while it is in cache, see :func:`all_finite_chunk`); otherwise True.
    """
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)

    def copy(part: slice) -> bool:
        out = flat_dst[part].copy_(flat_src[part])
        if check is None:
            return True
        return all_finite_chunk(out if check == "dst" else flat_src[part])

    return all(chunks.for_chunks(flat_dst.numel(), copy))


def all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``, checked chunk by chunk on every core."""
    flat = x.reshape(-1)
    return all(chunks.for_chunks(flat.numel(), lambda part: all_finite_chunk(flat[part])))


def _where(x: torch.Tensor) -> tuple[int, int, torch.dtype]:
    return (x.data_ptr(), x.numel(), x.dtype)


@dataclass(frozen=True)
class LoopChecks:
    """Whether a compiled merge loop met NaN or Inf among its inputs and among the result
    entries it stored, and which tensors those were (so a check is only reused for them): what
    a fast path leaves in ``TensorContext.checks``."""

    inputs_finite: bool
    result_finite: bool
    inputs: tuple[tuple[int, int, torch.dtype], ...]
    result: tuple[int, int, torch.dtype]

    @classmethod
    def of(cls, found: int, inputs: Sequence[torch.Tensor], result: torch.Tensor) -> LoopChecks:
        """From the loops' flags (:data:`FOUND_IN_INPUT` / :data:`FOUND_IN_RESULT` bits)."""
        return cls(
            inputs_finite=not found & FOUND_IN_INPUT,
            result_finite=not found & FOUND_IN_RESULT,
            inputs=tuple(_where(x) for x in inputs),
            result=_where(result),
        )

    def covers_inputs(self, inputs: Sequence[torch.Tensor]) -> bool:
        return self.inputs == tuple(_where(x) for x in inputs)

    def covers_result(self, result: torch.Tensor) -> bool:
        return self.result == _where(result)
