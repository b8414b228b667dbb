"""The steps merge methods are built from: plain torch functions on tensors, each testable alone.

This module and the methods built from it (:mod:`mergelab.merge.methods`) are the specification
of every merge: what they compute is what a merge writes, bit for bit. The engines stream
tensors through them; where the accelerator (:mod:`mergelab.merge.accelerator`) has a faster
equivalent of a method, tests pin it to these functions' bits.

Shapes: a *stack* of task vectors is ``[n_experts, *param_shape]``; per-expert scalars are lists
of floats, one per expert. Functions whose name ends in ``_`` modify their first argument in place
(torch's convention) and are only ever applied to buffers the method itself allocated — never to
the caller's tensors, which may be the model's own parameters.

Magnitude thresholds are *exact* k-th largest values of |τ| (float32). Over one tensor they come
from ``torch.kthvalue``; over a whole model (TIES' global trim) from two radix-histogram passes
over the float32 bit patterns of |τ| (non-negative floats order like their bits): the top 16 bits
place the k-th largest in one of 2¹⁵ buckets, the low 16 bits pin it down inside it, with memory
for one tensor at a time.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

# (name, base, experts) triples, one per tensor: what a whole-model statistics pass walks.
TensorTriples = Iterable[tuple[str, torch.Tensor, list[torch.Tensor]]]

# DARE's masks are drawn in blocks of this many entries, one random stream per block; l1_norm
# (DELLA's rescale) sums in blocks of this many entries too.
DARE_BLOCK = 1 << 18


def bits_to_float(bits: int) -> float:
    """The float32 whose bit pattern is the int32 ``bits``."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


# --- sums ---------------------------------------------------------------------------------------


def weighted_sum(
    tensors: Iterable[torch.Tensor], weight: list[float], normalize: bool
) -> torch.Tensor:
    """Σ_i w_i x_i into a new tensor, divided by Σ_i w_i when ``normalize``.

    Accumulates one tensor at a time, so a generator of task vectors never needs a full stack.
    A (near-)zero total, |Σ w_i| < 1e-8, is not divided by (mergekit's rule). In half precision
    the sum is mergekit's (:func:`half_weighted_sum`).
    """
    items = iter(tensors)
    first = next(items)
    if first.dtype in HALF_DTYPES:
        return half_weighted_sum(itertools.chain([first], items), weight, normalize)
    merged = torch.mul(first, weight[0])
    for w, x in zip(weight[1:], items):
        merged.add_(x, alpha=w)
    if normalize:
        total = sum(weight)
        if abs(total) >= 1e-8:
            merged.div_(total)
    return merged


# The half-precision compute dtypes: their weighted sums are mergekit's (half_weighted_sum), and
# DARE's L1 rescale sums them exactly (exact_l1_norm).
HALF_DTYPES = (torch.bfloat16, torch.float16)


def in_dtype(w: float, dtype: torch.dtype) -> torch.Tensor:
    """The 0-d tensor of ``w`` rounded to ``dtype`` (mergekit's ``torch.tensor(weights,
    dtype=...)``); as a factor, torch multiplies by its float32 value and rounds the product."""
    return torch.tensor(w, dtype=dtype)


def half_weighted_sum(
    tensors: Iterable[torch.Tensor],
    weight: Sequence[float] | None,
    normalize: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_i w_i x_i in a half-precision dtype, as mergekit computes it (``(deltas *
    weights).sum(dim=0)``): each w_i rounded to the dtype, each product x_i · w_i rounded to
    it, the products summed in float32 in order and the sum rounded once (torch's ``sum`` of a
    half-precision stack accumulates in float32). ``normalize`` divides by Σ_i w_i computed the
    same way (unless |Σ| < 1e-8, mergekit's rule). ``weight`` ``None``: all 1 (no products).
    Every entry's bits depend on that entry alone, so any chunking of the tensor gives them."""
    acc: torch.Tensor | None = None
    dtype = None
    for i, x in enumerate(tensors):
        dtype = x.dtype
        term = x if weight is None else torch.mul(x, in_dtype(weight[i], dtype))
        acc = term.float() if acc is None else acc.add_(term)
    assert acc is not None and dtype is not None
    if normalize and weight is not None:
        total = half_total(weight, dtype)
        if abs(total) >= 1e-8:
            acc = acc.to(dtype).div_(total)
    merged = acc.to(dtype)
    return merged if out is None else out.copy_(merged)


def half_total(weight: Sequence[float], dtype: torch.dtype) -> float:
    """Σ_i w_i as :func:`half_weighted_sum` divides by it: the w_i rounded to ``dtype``, summed
    in float32, rounded to ``dtype`` (mergekit's ``weights.sum(dim=0)``)."""
    rounded = torch.tensor([float(in_dtype(w, dtype)) for w in weight], dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32)
    for w in rounded:
        total += w
    return float(total.to(dtype))


def add_scaled_(delta: torch.Tensor, lambda_: float, base: torch.Tensor) -> torch.Tensor:
    """θ_b + λ δ, reusing δ's storage (``delta`` is the method's own buffer): δ · λ, then + θ_b."""
    if lambda_ != 1:
        delta.mul_(lambda_)
    return delta.add_(base)


# How each float dtype stores a magnitude: (integer view, mantissa bits, exponent bias).
FLOAT_LAYOUT = {
    torch.bfloat16: (torch.int16, 7, 127),
    torch.float16: (torch.int16, 10, 15),
    torch.float32: (torch.int32, 23, 127),
    torch.float64: (torch.int64, 52, 1023),
}


def l1_norm(x: torch.Tensor) -> torch.Tensor:
    """Σ |x| as a 0-d tensor of x's dtype, as torch sums (and mergekit's DELLA rescale, bit for
    bit on tensors of one block): the sums of blocks of :data:`DARE_BLOCK` entries, each summed
    whole, added in order. DARE's rescale in half precision uses :func:`exact_l1_norm`.

    The order is fixed so the rounding does not depend on the number of threads: torch splits
    one long sum across its threads, but reduces each row of a matrix on one thread (hence the
    rows below, and the zero row beside a lone block).
    """
    flat = x.detach().reshape(-1).abs()
    blocks = flat.numel() // DARE_BLOCK
    sums = []
    if blocks:
        rows = flat[: blocks * DARE_BLOCK].view(blocks, DARE_BLOCK)
        if blocks == 1:
            rows = torch.cat([rows, torch.zeros_like(rows)])
        sums.append(rows.sum(1)[:blocks])
    tail = flat[blocks * DARE_BLOCK :]
    if tail.numel():
        sums.append(torch.stack([tail, torch.zeros_like(tail)]).sum(1)[:1])
    return torch.cat(sums).sum() if sums else flat.new_zeros(())


def exact_l1_norm(x: torch.Tensor) -> torch.Tensor:
    """Σ |x| as a 0-d tensor of x's dtype: the exact sum, rounded once (to nearest, ties to
    even), so it depends on no summation order, block size or thread count.

    A finite |x_j| is m_j · 2^(max(e_j, 1) − 1) · u, with e_j its exponent field, m_j its
    mantissa with the leading 1 (none for subnormals, e_j = 0) and u the dtype's smallest
    subnormal: the sum is the integers Σ_{e_j = e} m_j, one per exponent, shifted and added
    (:func:`exact_sum_per_exponent`, :func:`round_exact_sum`). With a NaN or an Inf among x the
    sum is NaN or +Inf, as torch's.
    """
    if x.dtype not in FLOAT_LAYOUT:
        raise TypeError(f"exact_l1_norm: no exact sum for {x.dtype}")
    flat = x.detach().reshape(-1)
    _, mantissa_bits, bias = FLOAT_LAYOUT[x.dtype]
    per_exponent = exact_sum_per_exponent(flat)
    if per_exponent is None:  # a NaN or an Inf
        return flat.abs().sum()
    return torch.tensor(round_exact_sum(per_exponent, mantissa_bits, bias), dtype=x.dtype)


def exact_sum_per_exponent(flat: torch.Tensor) -> list[int] | None:
    """Σ_{e_j = e} m_j for each exponent field e of a flat float tensor (the terms of
    :func:`exact_l1_norm`), as Python integers; ``None`` if it holds a NaN or an Inf."""
    view, mantissa_bits, _ = FLOAT_LAYOUT[flat.dtype]
    width = torch.finfo(flat.dtype).bits
    exponents = 1 << (width - 1 - mantissa_bits)
    if width == 16:  # a count of every magnitude's bit pattern, then Σ count · m per exponent
        bits = flat.view(view).to(torch.int32).bitwise_and_(0x7FFF)
        counts = torch.bincount(bits, minlength=1 << 15).view(exponents, 1 << mantissa_bits)
        mantissa = torch.arange(1 << mantissa_bits, dtype=torch.int64).expand_as(counts).clone()
        mantissa[1:] += 1 << mantissa_bits  # the leading 1 of every exponent field but 0
        if int(counts[-1].sum()):
            return None
        return (counts * mantissa).sum(1).tolist()
    bits = flat.view(view).to(torch.int64) & ((1 << (width - 1)) - 1)  # |x|'s bits
    exponent = bits >> mantissa_bits
    if bool((exponent == exponents - 1).any()):
        return None
    fraction = bits & ((1 << mantissa_bits) - 1)
    mantissa = fraction | (exponent > 0).to(torch.int64) << mantissa_bits
    if mantissa_bits <= 30:  # Σ m_j < 2⁶³ for any tensor under 2³² entries
        parts = [(mantissa, 0)]
    else:  # float64: two halves of the 53-bit mantissa, each summed exactly
        parts = [(mantissa >> 26, 26), (mantissa & ((1 << 26) - 1), 0)]
    sums = [0] * exponents
    for part, shift in parts:
        summed = torch.zeros(exponents, dtype=torch.int64).index_add_(0, exponent, part)
        for e, total in enumerate(summed.tolist()):
            sums[e] += total << shift
    return sums


def round_exact_sum(per_exponent: Sequence[int], mantissa_bits: int, bias: int) -> float:
    """Σ_e per_exponent[e] · 2^(max(e, 1) − 1) · u (u = 2^(1 − bias − mantissa_bits), the
    smallest subnormal) rounded to the nearest float of that layout, ties to even (+Inf past
    its largest), as a Python float (exact: every such float is a float64, or an Inf)."""
    total = sum(s << (max(e, 1) - 1) for e, s in enumerate(per_exponent) if s)
    precision = mantissa_bits + 1
    dropped = max(0, total.bit_length() - precision)  # low bits below the result's last place
    q, r = divmod(total, 1 << dropped)
    if dropped and (2 * r > 1 << dropped or (2 * r == 1 << dropped and q & 1)):
        q += 1
    exponent = dropped + 1 - bias - mantissa_bits  # result = q · 2^exponent
    if q and q.bit_length() - 1 + exponent > bias:  # beyond the largest finite value
        return math.inf
    return math.ldexp(q, exponent)


# --- task vectors and per-expert scalars -------------------------------------------------------


def task_vectors(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """τ_i = θ_i − θ_b stacked into a new ``[n_experts, *base.shape]`` tensor."""
    out = torch.empty((len(experts), *base.shape), dtype=base.dtype, device=base.device)
    for i, expert in enumerate(experts):
        torch.sub(expert, base, out=out[i])
    return out


def per_expert(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-expert scalars as ``[n, 1, 1, ...]`` so they broadcast against a stack like ``like``."""
    t = torch.tensor(values, dtype=like.dtype, device=like.device)
    return t.view(-1, *([1] * (like.dim() - 1)))


def kept_count(density: float, numel: int) -> int:
    """How many entries a magnitude trim at ``density`` keeps: ``max(1, int(density · numel))``.

    Same rule as mergekit (a positive density keeps at least one entry). PEFT uses
    ``int(density · numel)`` without the floor of one; they differ only when density·numel < 1.
    """
    if density >= 1:
        return numel
    if density <= 0 or numel == 0:
        return 0
    return max(1, int(density * numel))


# --- exact k-th largest |x| ---------------------------------------------------------------------


def kth_largest_abs_many(x: torch.Tensor, ks: Iterable[int]) -> list[float]:
    """Exact k-th largest |x| (as float32) of one tensor for every k in ``ks`` (1-based; ``k`` ≥
    numel gives the smallest |x|, ``k`` ≤ 0 gives ``inf``)."""
    magnitudes = x.detach().reshape(-1).float().abs()
    n = magnitudes.numel()
    out = []
    for k in ks:
        if k <= 0:
            out.append(math.inf)
        else:  # the k-th largest is the (n − k + 1)-th smallest
            out.append(float(torch.kthvalue(magnitudes, n - min(k, n) + 1).values))
    return out


def kth_largest_abs(x: torch.Tensor, k: int) -> float:
    """Exact k-th largest |x| of one tensor (1-based; ``k`` ≥ numel gives the smallest |x|)."""
    return kth_largest_abs_many(x, [k])[0]


def magnitude_threshold(x: torch.Tensor, density: float) -> float:
    """|x| threshold keeping the top ``kept_count(density, x.numel())`` entries (0.0 keeps all)."""
    if density >= 1:
        return 0.0
    return kth_largest_abs(x, kept_count(density, x.numel()))


_HIGH_BUCKETS = 1 << 15  # |x| has sign bit 0, so the top 16 bits of its float32 pattern are < 2¹⁵
_LOW_BUCKETS = 1 << 16


def _locate(counts: torch.Tensor, k: int) -> tuple[int, int]:
    """The bucket of a histogram holding its k-th largest item (1-based), and its rank inside."""
    from_top = counts.flip(0).cumsum(0)
    i = int(torch.searchsorted(from_top, k))  # the first bucket from the top reaching k
    bucket = counts.numel() - 1 - i
    return bucket, k - (int(from_top[i]) - int(counts[bucket]))


def model_magnitude_thresholds(
    make_iter: Callable[[], TensorTriples], densities: list[float]
) -> list[float]:
    """Per-expert |τ_i| thresholds over every tensor ``make_iter()`` yields (whole-model top-k):
    expert i keeps the entries with |τ_i| ≥ its threshold, i.e. its ``kept_count(density_i, N)``
    largest of all N parameters (plus any exact ties with the k-th); 0.0 where density_i ≥ 1.

    ``make_iter()`` returns a fresh iterable of ``(name, base, experts)`` and is called once per
    pass (two passes; none where every density is 1): only the current tensor is held. Over the
    whole model this is the TIES paper's trim; over one tensor, mergekit's.
    """
    trimming = [i for i, d in enumerate(densities) if d < 1]
    thresholds = [0.0] * len(densities)
    if not trimming:
        return thresholds

    def magnitude_bits() -> Iterable[list[torch.Tensor]]:
        for _, base, experts in make_iter():
            yield [
                (experts[i] - base).float().abs().view(torch.int32).reshape(-1) for i in trimming
            ]

    high = torch.zeros(len(trimming), _HIGH_BUCKETS, dtype=torch.int64)
    count = 0
    for bits in magnitude_bits():
        count += bits[0].numel()
        for row, b in zip(high, bits):
            row += torch.bincount(b >> 16, minlength=_HIGH_BUCKETS)
    ks = [kept_count(densities[i], count) for i in trimming]
    if any(k <= 0 for k in ks):  # nothing to keep (an empty model)
        return [math.inf if d < 1 else 0.0 for d in densities]
    located = [_locate(row, k) for row, k in zip(high, ks)]
    low = torch.zeros(len(trimming), _LOW_BUCKETS, dtype=torch.int64)
    for bits in magnitude_bits():
        for row, b, (bucket, _) in zip(low, bits, located):
            row += torch.bincount(b[(b >> 16) == bucket] & 0xFFFF, minlength=_LOW_BUCKETS)
    for i, row, (bucket, rank) in zip(trimming, low, located):
        thresholds[i] = bits_to_float((bucket << 16) | _locate(row, rank)[0])
    return thresholds


# --- sparsification (in place on a method's own buffers) ---------------------------------------


def threshold_trim_(tau: torch.Tensor, threshold: float) -> torch.Tensor:
    """Zero the entries with |τ| < ``threshold`` (in place); ``inf`` zeroes everything.

    With a whole-model threshold from :func:`model_magnitude_thresholds` this is global trimming.
    """
    if threshold == math.inf:
        return tau.zero_()
    if threshold > 0:
        if tau.dtype == torch.float32:
            # hardshrink zeroes |x| ≤ λ; with λ the largest float32 below the threshold that is
            # exactly |x| < threshold, in one float kernel instead of abs + compare + fill.
            as_float32 = torch.tensor(threshold, dtype=torch.float32)
            below = float(as_float32)
            if below >= threshold:
                below = bits_to_float(int(as_float32.view(torch.int32)) - 1)
            torch.hardshrink(tau, below, out=tau)
        else:
            tau.masked_fill_(tau.abs().float() < threshold, 0)
    return tau


def magnitude_trim_(tau: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the ``kept_count(density, numel)`` largest |τ| of this tensor, zero the rest (in place).

    Per-tensor trimming (mergekit, PEFT ``prune(..., "magnitude")``). Entries tied with the k-th
    largest are all kept, where a sort keeps exactly k.
    """
    return threshold_trim_(tau, magnitude_threshold(tau, density))


def outlier_ranks(numel: int, density: float, gamma: float) -> list[int] | None:
    """Model Breadcrumbs' kept band as ranks of |τ| from the top: ``[k_low, k_high]``, the
    smallest kept is the ``k_low``-th largest and the largest kept the ``k_high``-th largest
    (see :func:`magnitude_outlier_trim_`); ``[]`` keeps everything, ``None`` nothing."""
    if density >= 1:
        return []
    n_keep, n_top = int(density * numel), int(gamma * numel)
    n_bot = max(0, numel - n_keep - n_top)
    if n_keep == 0:
        return None
    return [numel - n_bot, numel - n_bot - n_keep + 1]


def band_trim_(tau: torch.Tensor, smallest: float, largest: float) -> torch.Tensor:
    """Zero the entries with |τ| < ``smallest`` or |τ| > ``largest`` (in place)."""
    if tau.dtype != torch.float32:
        magnitude = tau.abs().float()
        return tau.masked_fill_((magnitude < smallest) | (magnitude > largest), 0)
    above = torch.hardshrink(tau, largest)  # τ where |τ| > largest, else 0
    return threshold_trim_(tau, smallest).sub_(above)  # τ − τ = 0 above the band


def magnitude_outlier_trim_(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask (mergekit ``magnitude_outliers``), in place.

    Sorting |τ| ascending, keep ranks ``[n_bot, n_bot + int(density·n))`` where the top
    ``int(gamma·n)`` are dropped as outliers and ``n_bot = max(0, n − int(density·n) − int(gamma·n))``
    smallest are dropped as noise; ``density`` ≥ 1 keeps everything (as mergekit does).
    """
    ranks = outlier_ranks(tau.numel(), density, gamma)
    if ranks is None:
        return tau.zero_()
    if not ranks:
        return tau
    smallest_kept, largest_kept = kth_largest_abs_many(tau, ranks)  # one shared first pass
    return band_trim_(tau, smallest_kept, largest_kept)


# Keep probabilities are multiples of 2⁻²³: a float in [1, 2) has 23 random mantissa bits.
_KEEP_RESOLUTION = 1 << 23


def dare_keep_block(seed: int, expert: int, block: int, numel: int, density: float) -> torch.Tensor:
    """DARE's keep mask for entries ``[block · DARE_BLOCK, block · DARE_BLOCK + numel)`` of one
    tensor's expert ``expert``: float32, 1.0 (kept) or 0.0, each entry kept independently with
    probability ``density`` rounded to a multiple of 2⁻²³.

    Drawn from NumPy's SFC64 seeded with ``SeedSequence(seed, spawn_key=(expert, block))``: one
    independent stream per block, so blocks can be drawn in parallel, in any order, and the mask
    of a tensor depends only on (seed, expert, its size). Each 32-bit half of the raw 64-bit
    output (low half first) gives u = its low 23 bits; the entry is kept iff u < round(density ·
    2²³). The comparison runs in float arithmetic: 1 + u·2⁻²³ is a float in [1, 2).
    """
    generator = np.random.SFC64(np.random.SeedSequence(seed, spawn_key=(expert, block)))
    bits = torch.from_numpy(generator.random_raw((numel + 1) // 2).view(np.int32))[:numel]
    uniform = bits.bitwise_and_(_KEEP_RESOLUTION - 1).bitwise_or_(0x3F800000).view(torch.float32)
    limit = 1 + round(density * _KEEP_RESOLUTION) / _KEEP_RESOLUTION
    # (limit − x) · 2²⁴ is ≥ 2 where x < limit and ≤ 0 elsewhere (exact: both lie in [1, 2])
    return uniform.sub_(limit).mul_(-(2.0**24)).clamp_(0, 1)


def dare_keep_range(seed: int, expert: int, start: int, numel: int, density: float) -> torch.Tensor:
    """The float mask of :func:`dare_keep_block` for entries ``[start, start + numel)``
    (``start`` a multiple of :data:`DARE_BLOCK`), block by block."""
    if start % DARE_BLOCK:
        raise ValueError(f"DARE masks start at a multiple of {DARE_BLOCK}, not {start}")
    first = start // DARE_BLOCK
    blocks = [
        dare_keep_block(seed, expert, first + i, min(DARE_BLOCK, numel - offset), density)
        for i, offset in enumerate(range(0, numel, DARE_BLOCK))
    ]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def dare_keep_mask(
    shape: torch.Size | tuple[int, ...], density: float, seed: int, expert: int = 0
) -> torch.Tensor:
    """DARE's random mask for a whole tensor (True = kept), the same as the chunked methods
    draw (:func:`dare_keep_block`); ``seed`` is the tensor's (``TensorContext.tensor_seed``)."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(tuple(shape), dtype=torch.bool)
    return dare_keep_range(seed, expert, 0, numel, density).view(tuple(shape)) > 0


DareRescale = Literal["keep_rate", "l1", "none"]


def random_drop_(
    tau: torch.Tensor,
    keep: torch.Tensor,
    density: float,
    rescale: DareRescale = "keep_rate",
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Drop the entries where ``keep`` is False and rescale the survivors (in place).

    ``rescale``: "keep_rate" divides by the keep rate, τ/(1−p) with p = 1 − density (DARE paper,
    PEFT ``prune(..., "random", rescale=True)``); "l1" scales so the L1 norm equals the pre-drop
    one (mergekit's ``rescale``; skipped when either norm < 1e-7, as mergekit does; the norms are
    ``norm``'s, by default :func:`exact_l1_norm` in bfloat16/float16 (exact sums rounded once, so
    a compiled drop reproduces them in any order) and :func:`l1_norm` otherwise); "none".
    ``density`` ≥ 1 leaves τ untouched and ≤ 0 zeroes it (both tools agree).
    """
    if density >= 1:
        return tau
    if density <= 0:
        return tau.zero_()
    if rescale == "l1":
        norm = norm or (exact_l1_norm if tau.dtype in HALF_DTYPES else l1_norm)
        before = norm(tau)
        tau.mul_(keep)
        after = norm(tau)
        if before >= 1e-7 and after >= 1e-7:
            tau.mul_(before / after)
    elif rescale == "keep_rate":
        tau.mul_(keep).div_(density)
    elif rescale == "none":
        tau.mul_(keep)
    else:
        raise ValueError(f"unknown DARE rescale {rescale!r}; use 'keep_rate', 'l1' or 'none'")
    return tau


def magprune_keep_probabilities(tau: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """MAGPRUNE's keep probability of every entry of τ (DELLA), same shape as τ.

    Within each row (axis 1; a 1-D τ is one row) the entries are ranked by |τ| ascending,
    r = 0 … n−1, and kept with probability p = density − ε + 2ε · r/(n − 1): density − ε for the
    smallest, density + ε for the largest, density on average. A row of one entry gets density
    (mergekit divides 0 by 0 there). Tied magnitudes are ranked in the order ``argsort`` returns
    them, as in mergekit. Computed in mergekit's dtype, rounding included, since it decides the
    draws: τ's own on an accelerator or for bfloat16 (where ranks above 256 round), else float32
    (CPU ``bernoulli`` lacks float16).
    """
    keep_own = tau.device.type != "cpu" or tau.dtype == torch.bfloat16
    dtype = tau.dtype if keep_own else torch.float32
    rows = tau if tau.dim() >= 2 else tau.unsqueeze(0)
    n = rows.shape[1]
    if n == 1:
        return torch.full(tau.shape, density, dtype=dtype, device=tau.device)
    order = rows.abs().argsort(dim=1)  # the same call as mergekit's: ties in the same order
    # Ranks 1 … n and their spread computed as mergekit does, rounding included (bfloat16
    # rounds ranks above 256), so that the same draws keep the same entries.
    rank = order.argsort(dim=1).to(dtype).add_(1)
    low, high = rank.amin(dim=1, keepdim=True), rank.amax(dim=1, keepdim=True)
    fraction = ((rank - low) / (high - low)).clamp_(0, 1)
    probability = fraction.mul_(2).mul_(epsilon).add_(density - epsilon)
    return probability.view(tau.shape)


def magprune_(
    tau: torch.Tensor,
    density: float,
    epsilon: float,
    generator: torch.Generator,
    rescale: DareRescale = "keep_rate",
) -> torch.Tensor:
    """DELLA's MAGPRUNE in place: drop entries at random, the small ones more often, and rescale.

    Entry j is kept with probability p_j from :func:`magprune_keep_probabilities` (one
    ``torch.bernoulli`` draw from ``generator``). ``rescale``: "keep_rate" divides each survivor by
    its own p_j (DELLA paper and its authors' code); "l1" matches τ's pre-drop L1 norm (mergekit's
    ``rescale: true``); "none". ``density`` ≥ 1 leaves τ untouched and ≤ 0 zeroes it, drawing
    nothing (as mergekit). Drop and rescale happen in the probabilities' dtype (float32 for a
    float16 τ on CPU), as in mergekit.
    """
    if density >= 1:
        return tau
    if density <= 0:
        return tau.zero_()
    probability = magprune_keep_probabilities(tau, density, epsilon)
    keep = torch.bernoulli(probability, generator=generator)
    work = tau.to(probability.dtype)  # mergekit's work dtype; τ itself when it already is
    if rescale == "keep_rate":
        work.mul_(keep).div_(probability)
    else:
        random_drop_(work, keep, density, rescale, norm=l1_norm)  # torch's sums, as mergekit's
    return tau if work is tau else tau.copy_(work)


def variance_selection_mask(stack: torch.Tensor, fraction: float) -> torch.Tensor:
    """SCE's *select* step: 1.0 where the variance across experts is among the largest, else 0.

    ``stack`` ``[n, ...]`` → mask ``[...]``. The population variance of each position over the
    experts is ranked and the top ``int(fraction · #nonzero variances)`` positions are kept (the
    count rounded in float32, as mergekit does); exact ties with the last one kept are all kept,
    where mergekit's ``topk`` keeps exactly that many. ``fraction`` ≥ 1 keeps all, ≤ 0 none.
    """
    if fraction >= 1:
        return torch.ones_like(stack[0])
    variance = stack.var(dim=0, correction=0)
    k = int(torch.count_nonzero(variance) * fraction) if fraction > 0 else 0
    if k == 0:
        return torch.zeros_like(variance)
    return (variance >= kth_largest_abs(variance, k)).to(stack.dtype)


def sce_coefficients(stack: torch.Tensor) -> torch.Tensor:
    """SCE's *calculate* step: η_i = mean(τ_i²) / Σ_j mean(τ_j²), one per expert, shape ``[n]``.

    Uniform (1/n) when Σ_j mean(τ_j²) < 1e-6, mergekit's guard against dividing by ~0; note that
    this also catches small real task vectors (RMS below ~1e-3 for a single expert).
    """
    energy = stack.square().reshape(stack.shape[0], -1).mean(dim=1)
    total = energy.sum().item()
    if abs(total) < 1e-6:
        return torch.full_like(energy, 1 / stack.shape[0])
    return energy / total


def fusion_importance(expert: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Arcee Fusion's importance score per entry: |θ_e − θ_b| · KL(softmax(θ_e) ‖ softmax(θ_b)).

    The softmaxes (each + 1e-8) and the KL divergence are taken along the last axis, so every
    row has one KL factor (a 1-D tensor is one row). Same shape as ``base``.
    """
    p = F.softmax(expert, dim=-1) + 1e-8
    q = F.softmax(base, dim=-1) + 1e-8
    kl = torch.sum(p * torch.log(p / q), dim=-1, keepdim=True)
    return (expert - base).abs() * kl


QUANTILE_SAMPLE_SIZE = 1_000_000


def iqr_outlier_threshold(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """median + 1.5 · (Q3 − Q1) of ``scores`` (Tukey's outlier fence), as a 0-d tensor.

    Quantiles are order statistics at index ⌊q · (n − 1)⌋ of the sorted values; above
    :data:`QUANTILE_SAMPLE_SIZE` values they are those of that many values drawn with
    replacement with ``generator`` (mergekit draws the same sample from torch's global RNG).
    """
    flat = scores.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE_SIZE:
        picks = torch.randint(
            flat.numel(), (QUANTILE_SAMPLE_SIZE,), generator=generator, device=flat.device
        )
        flat = flat[picks]
    ordered = flat.sort().values
    index = (torch.tensor([0.25, 0.5, 0.75]) * (ordered.numel() - 1)).long()
    q1, median, q3 = ordered[index.to(ordered.device)]
    return median + 1.5 * (q3 - q1)


# --- TIES sign election and disjoint merge ------------------------------------------------------

MajoritySign = Literal["sum", "count"]
DivideBy = Literal["count", "weight_sum", "none"]


def _all_ones(weights: list[float] | None) -> bool:
    return weights is None or all(w == 1 for w in weights)


def _weighted_rows_sum(
    stack: torch.Tensor, weights: list[float] | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_i w_i stack_i over the first axis (a plain sum when there are no weights or all are 1),
    into ``out`` when given. In half precision, mergekit's sum (:func:`half_weighted_sum`)."""
    if stack.dtype in HALF_DTYPES:
        return half_weighted_sum(stack, None if _all_ones(weights) else weights, out=out)
    if weights is None or all(w == 1 for w in weights):
        if stack.shape[0] == 1:
            return stack[0].clone() if out is None else out.copy_(stack[0])
        total = torch.add(stack[0], stack[1], out=out)  # row by row: faster than sum(0)
        for row in stack[2:]:
            total.add_(row)
        return total
    # row by row rather than tensordot: the same operations, in the same order, as the
    # accelerator's loops
    total = torch.mul(stack[0], weights[0], out=out)
    for row, w in zip(stack[1:], weights[1:]):
        total.add_(row, alpha=w)
    return total


def elect_sign(
    stack: torch.Tensor,
    method: MajoritySign = "sum",
    sign_weights: list[float] | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The elected sign (+1.0 or −1.0) of every position of a stack ``[n, ...]`` → ``[...]``.

    + where Σ_i τ_i ≥ 0 ("sum": TIES paper, PEFT "total", mergekit "sum"), or where
    Σ_i sign(τ_i) ≥ 0, i.e. positives at least as many as negatives ("count": PEFT "frequency",
    mergekit "count"). With ``sign_weights`` the election is on w_i τ_i instead (mergekit).
    A tie (0) elects +, as in every implementation. Written into ``out`` when given.
    """
    if method == "sum":
        votes = _weighted_rows_sum(stack, sign_weights, out)
    elif method == "count":
        flips = (
            None
            if sign_weights is None
            else [math.copysign(1.0, w) * (w != 0) for w in sign_weights]
        )
        votes = _weighted_rows_sum(stack.sign(), flips, out)
    else:
        raise ValueError(f"unknown majority_sign {method!r}; use 'sum' or 'count'")
    return votes.sign_().add_(0.5).sign_()  # −1, 0, +1 → −1, +1, +1


def disjoint_merge_(
    stack: torch.Tensor,
    elected: torch.Tensor,
    weights: list[float] | None = None,
    *,
    divide_by: DivideBy = "count",
    weighted_sign: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_i w_i τ_i over the entries whose sign agrees with ``elected``, divided per entry.

    ``stack``: the unweighted τ_i ``[n, ...]`` (overwritten); ``elected`` from
    :func:`elect_sign`. Agreement is judged on τ_i, or on w_i τ_i when ``weighted_sign`` (they
    differ only for negative weights); zeros never agree. ``divide_by``: "count" of agreeing
    experts (TIES paper, PEFT), "weight_sum" Σ of their w_i (mergekit ``normalize: true``) or
    "none" (mergekit ``normalize: false``). A position where nobody agrees gets 0. The result
    goes into ``out`` when given.
    """
    if divide_by not in ("count", "weight_sum", "none"):
        raise ValueError(f"unknown divide_by {divide_by!r}; use 'count', 'weight_sum' or 'none'")
    weights = [1.0] * stack.shape[0] if weights is None else list(weights)
    # f_i = sign(w_i) when agreement is judged on w_i τ_i, else 1; an agreeing entry has
    # f_i · e · τ_i = |τ_i| > 0, so relu keeps exactly the agreeing magnitudes.
    flips = [math.copysign(1.0, w) * (w != 0) if weighted_sign else 1.0 for w in weights]
    magnitudes = stack.mul_(elected)
    if any(f != 1 for f in flips):
        magnitudes.mul_(per_expert(flips, magnitudes))
    magnitudes.relu_()
    # w_i τ_i = (w_i f_i) · e · |τ_i| on the agreeing entries
    merged = _weighted_rows_sum(magnitudes, [w * f for w, f in zip(weights, flips)], out)
    merged.mul_(elected)
    if divide_by == "none":
        return merged
    agrees = magnitudes.sign_()  # 1 where expert i agrees, else 0
    if divide_by == "count":
        return merged.div_(agrees.sum(0).clamp_(min=1))
    divisor = _weighted_rows_sum(agrees, weights).view(merged.shape)
    if all(w > 0 for w in weights):  # then divisor is 0 (nobody agrees, merged = 0) or ≥ min w
        return merged.div_(divisor.clamp_(min=min(weights)))
    return merged.div_(divisor.masked_fill_(divisor == 0, 1))


def elect_and_merge(
    stack: torch.Tensor,
    weight: list[float],
    *,
    majority_sign: MajoritySign = "sum",
    weighted_sign: bool = False,
    divide_by: DivideBy = "count",
) -> torch.Tensor:
    """TIES' sign election then disjoint merge of a stack of (trimmed) task vectors: τ_merged.
    ``stack`` is overwritten. Parameters as in :func:`elect_sign` and :func:`disjoint_merge_`."""
    elected = elect_sign(stack, majority_sign, weight if weighted_sign else None)
    return disjoint_merge_(stack, elected, weight, divide_by=divide_by, weighted_sign=weighted_sign)


def elect_merge(
    base: torch.Tensor,
    stack: torch.Tensor,
    weight: list[float],
    *,
    lambda_: float = 1.0,
    majority_sign: MajoritySign = "sum",
    weighted_sign: bool = False,
    divide_by: DivideBy = "count",
) -> torch.Tensor:
    """θ_b + λ · :func:`elect_and_merge` (``stack`` is overwritten)."""
    merged = elect_and_merge(
        stack, weight, majority_sign=majority_sign, weighted_sign=weighted_sign, divide_by=divide_by
    )
    if merged.dtype in HALF_DTYPES:  # mergekit's order: λ · merged rounded, then + θ_b
        return add_scaled_(merged, lambda_, base)
    return torch.add(base, merged, alpha=lambda_)
