"""The steps merge methods are built from, each a small function you can test alone.

Shapes: a *stack* of task vectors is ``[n_experts, *param_shape]``; per-expert scalars are lists
of floats, one per expert. Functions whose name ends in ``_`` modify their first argument in place
(torch's convention) and are only ever applied to buffers the method itself allocated — never to
the caller's tensors, which may be the model's own parameters.

Magnitude thresholds are *exact* k-th largest values of |τ|, found with two histogram passes over
the float32 bit patterns of |τ| instead of a sort: non-negative floats order like their bits, so
the top 16 bits place the k-th largest in one of 2¹⁵ buckets and the low 16 bits in a second pass
pin it down exactly. This costs two ``bincount`` sweeps (≈10× faster than ``argsort`` on CPU),
needs O(1) memory beyond the tensor, and works across tensors streamed from disk, which is what
whole-model ("global") TIES trimming needs.

Speed notes (CPU): the hot loops walk tensors in chunks of :data:`CHUNK` entries so temporaries
stay in cache and are reused, and they use float arithmetic (``hardshrink``, ``relu``, ``sign``)
rather than boolean masks, ``where`` or indexing, which are several times slower per element.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Literal

import torch
import torch.nn.functional as F

TensorTriples = Iterable[tuple[str, torch.Tensor, list[torch.Tensor]]]

_HIGH_BUCKETS = 1 << 15  # |x| has sign bit 0, so the top 16 bits of its float32 pattern are < 2¹⁵
_LOW_BUCKETS = 1 << 16
CHUNK = 1 << 16  # entries per chunk in the elementwise loops: 256 KiB of float32, cache-sized
# Histogram passes pay a fixed cost per chunk (the 2¹⁵/2¹⁶-bin output), so they take bigger ones.
HISTOGRAM_CHUNK = 1 << 18


def chunks(numel: int, size: int | None = None) -> Iterable[slice]:
    """Consecutive slices of ``size`` (default :data:`CHUNK`) entries covering ``range(numel)``."""
    size = size or CHUNK
    return (slice(start, min(start + size, numel)) for start in range(0, numel, size))


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


# --- exact k-th largest |x| by radix histograms ------------------------------------------------


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as float32 reinterpreted as int32, flattened; for |x| ≥ 0 the order of bits = of values."""
    a = x.detach().abs()
    if a.dtype != torch.float32:
        a = a.float()  # exact for bf16/fp16; float64 is compared after rounding to float32
    return a.reshape(-1).view(torch.int32)


def _bits_to_float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())


def _locate(counts: torch.Tensor, k: int) -> tuple[int, int]:
    """Bucket holding the k-th largest (1-based) item of a histogram, and its rank inside it."""
    from_top = counts.flip(0).cumsum(0)
    i = int(torch.searchsorted(from_top, torch.tensor([k], dtype=from_top.dtype)).item())
    bucket = counts.numel() - 1 - i
    above = int(from_top[i].item()) - int(counts[bucket].item())
    return bucket, k - above


class KthLargestAbs:
    """Exact k-th largest |x| over values seen in two passes (e.g. tensors streamed from disk).

    Pass 1: ``observe(x)`` for every chunk of values; then ``select(k)``; pass 2: ``observe(x)``
    again for the same values (any order, any chunking); ``value()`` returns the threshold as a
    float. Memory: two histograms (2¹⁵ + 2¹⁶ int64 counters), whatever the number of values.
    ``observe_`` does the same but may overwrite ``x`` (a float32 scratch buffer), saving a copy.
    """

    def __init__(self) -> None:
        self.count = 0
        self._high = torch.zeros(_HIGH_BUCKETS, dtype=torch.int64)
        self._low: torch.Tensor | None = None
        self._bucket = 0
        self._rank = 0
        self._k = 0

    def observe(self, x: torch.Tensor) -> None:
        self.observe_(_abs_bits(x).view(torch.float32))

    def observe_(self, x: torch.Tensor) -> None:
        if x.dtype != torch.float32 or not x.is_contiguous():
            return self.observe(x)
        bits = x.abs_().view(-1).view(torch.int32)
        if self._low is None:  # pass 1: histogram of the top 16 bits
            self.count += bits.numel()
            # without minlength the output only spans the buckets present: less to allocate/add
            counts = torch.bincount(bits.bitwise_right_shift_(16)).cpu()
            self._high[: counts.numel()] += counts
        elif self._k > 0:  # pass 2: low 16 bits inside the chosen bucket; the rest go to the ends
            bits.sub_((self._bucket << 16) - 1).clamp_(0, _LOW_BUCKETS + 1)
            counts = torch.bincount(bits, minlength=_LOW_BUCKETS + 2)
            self._low += counts[1:-1].cpu()

    def select(self, k: int) -> None:
        """End pass 1: remember which bucket holds the k-th largest value."""
        self._k = min(k, self.count)
        self._low = torch.zeros(_LOW_BUCKETS, dtype=torch.int64)
        if self._k > 0:
            self._bucket, self._rank = _locate(self._high, self._k)

    def value(self) -> float:
        """The k-th largest |x| (``inf`` for k = 0: nothing reaches it)."""
        if self._low is None:
            raise RuntimeError("KthLargestAbs.value() before select() and a second pass")
        if self._k == 0:
            return math.inf
        low, _ = _locate(self._low, self._rank)
        return _bits_to_float((self._bucket << 16) | low)


def kth_largest_abs(x: torch.Tensor, k: int) -> float:
    """Exact k-th largest |x| of one tensor (1-based; ``k`` ≥ numel gives the smallest |x|)."""
    if k <= 0:
        return math.inf
    finder = KthLargestAbs()
    flat = x.reshape(-1)
    for pass_ in range(2):
        for part in chunks(flat.numel(), HISTOGRAM_CHUNK):
            finder.observe(flat[part])
        if pass_ == 0:
            finder.select(k)
    return finder.value()


def magnitude_threshold(x: torch.Tensor, density: float) -> float:
    """|x| threshold keeping the top ``kept_count(density, x.numel())`` entries (0.0 keeps all)."""
    if density >= 1:
        return 0.0
    return kth_largest_abs(x, kept_count(density, x.numel()))


def global_magnitude_thresholds(
    make_iter: Callable[[], TensorTriples], densities: list[float]
) -> list[float]:
    """Per-expert |τ_i| thresholds over every tensor ``make_iter()`` yields (global top-k).

    ``make_iter()`` returns a fresh iterable of ``(name, base, experts)``; it is called twice
    (two passes) and nothing but the current tensor is held; τ_i is formed chunk by chunk in a
    reused buffer. Expert i keeps the entries with |τ_i| ≥ its threshold, i.e. its
    ``kept_count(density_i, N)`` largest over all N parameters (plus any exact ties with the
    k-th). Over the whole model this is the TIES paper's trim; over one tensor, mergekit's.
    """
    finders = [KthLargestAbs() for _ in densities]
    scratch: torch.Tensor | None = None

    def one_pass() -> None:
        nonlocal scratch
        for _, base, experts in make_iter():
            flat_base = base.reshape(-1)
            flat_experts = [e.reshape(-1) for e in experts]
            if base.dtype != torch.float32:  # τ is formed in the compute dtype, then widened
                for part in chunks(flat_base.numel(), HISTOGRAM_CHUNK):
                    for finder, expert in zip(finders, flat_experts):
                        finder.observe(expert[part] - flat_base[part])
                continue
            if scratch is None or scratch.device != base.device:
                scratch = torch.empty(HISTOGRAM_CHUNK, dtype=torch.float32, device=base.device)
            for part in chunks(flat_base.numel(), HISTOGRAM_CHUNK):
                buffer = scratch[: part.stop - part.start]
                for finder, expert in zip(finders, flat_experts):
                    torch.sub(expert[part], flat_base[part], out=buffer)
                    finder.observe_(buffer)

    one_pass()
    for finder, density in zip(finders, densities):
        finder.select(kept_count(density, finder.count))
    if any(0 < d < 1 for d in densities):
        one_pass()
    return [0.0 if d >= 1 else f.value() for f, d in zip(finders, densities)]


# --- sparsification (in place on a method's own buffers) ---------------------------------------


def threshold_trim_(tau: torch.Tensor, threshold: float) -> torch.Tensor:
    """Zero the entries with |τ| < ``threshold`` (in place); ``inf`` zeroes everything.

    With a whole-model threshold from :func:`global_magnitude_thresholds` this is global trimming.
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
                below = _bits_to_float(int(as_float32.view(torch.int32)) - 1)
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


def magnitude_outlier_trim_(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask (mergekit ``magnitude_outliers``), in place.

    Sorting |τ| ascending, keep ranks ``[n_bot, n_bot + int(density·n))`` where the top
    ``int(gamma·n)`` are dropped as outliers and ``n_bot = max(0, n − int(density·n) − int(gamma·n))``
    smallest are dropped as noise; ``density`` ≥ 1 keeps everything (as mergekit does).
    """
    if density >= 1:
        return tau
    n = tau.numel()
    n_keep, n_top = int(density * n), int(gamma * n)
    n_bot = max(0, n - n_keep - n_top)
    if n_keep == 0:
        return tau.zero_()
    smallest_kept = kth_largest_abs(tau, n - n_bot)  # the (n_bot+1)-th smallest
    largest_kept = kth_largest_abs(tau, n - n_bot - n_keep + 1)
    magnitude = tau.abs() if tau.dtype == torch.float32 else tau.abs().float()
    tau.masked_fill_((magnitude < smallest_kept) | (magnitude > largest_kept), 0)
    return tau


def dare_keep_mask(
    shape: torch.Size | tuple[int, ...], density: float, generator: torch.Generator
) -> torch.Tensor:
    """DARE's random mask: each entry kept (True) independently with probability ``density``."""
    return torch.rand(shape, generator=generator, device=generator.device) < density


DareRescale = Literal["keep_rate", "l1", "none"]


def random_drop_(
    tau: torch.Tensor, keep: torch.Tensor, density: float, rescale: DareRescale = "keep_rate"
) -> torch.Tensor:
    """Drop the entries where ``keep`` is False and rescale the survivors (in place).

    ``rescale``: "keep_rate" divides by the keep rate, τ/(1−p) with p = 1 − density (DARE paper,
    PEFT ``prune(..., "random", rescale=True)``); "l1" scales so the L1 norm equals the pre-drop
    one (mergekit's ``rescale``; skipped when either norm < 1e-7, as mergekit does); "none".
    ``density`` ≥ 1 leaves τ untouched and ≤ 0 zeroes it (both tools agree).
    """
    if density >= 1:
        return tau
    if density <= 0:
        return tau.zero_()
    if rescale == "l1":
        before = tau.abs().sum()
        tau.mul_(keep)
        after = tau.abs().sum()
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
        random_drop_(work, keep, density, rescale)
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


def _weighted_rows_sum(stack: torch.Tensor, weights: list[float] | None) -> torch.Tensor:
    """Σ_i w_i stack_i over the first axis (a plain sum when there are no weights or all are 1)."""
    if weights is None or all(w == 1 for w in weights):
        if stack.shape[0] == 1:
            return stack[0].clone()
        total = torch.add(stack[0], stack[1])  # row by row: faster than sum(0) on strided rows
        for row in stack[2:]:
            total.add_(row)
        return total
    w = torch.tensor(weights, dtype=stack.dtype, device=stack.device)
    return torch.tensordot(w, stack, dims=1)


def elect_sign(
    stack: torch.Tensor,
    method: MajoritySign = "sum",
    sign_weights: list[float] | None = None,
) -> torch.Tensor:
    """The elected sign (+1.0 or −1.0) of every position of a stack ``[n, ...]`` → ``[...]``.

    + where Σ_i τ_i ≥ 0 ("sum": TIES paper, PEFT "total", mergekit "sum"), or where
    Σ_i sign(τ_i) ≥ 0, i.e. positives at least as many as negatives ("count": PEFT "frequency",
    mergekit "count"). With ``sign_weights`` the election is on w_i τ_i instead (mergekit).
    A tie (0) elects +, as in every implementation.
    """
    if method == "sum":
        votes = _weighted_rows_sum(stack, sign_weights)
    elif method == "count":
        flips = (
            None
            if sign_weights is None
            else [math.copysign(1.0, w) * (w != 0) for w in sign_weights]
        )
        votes = _weighted_rows_sum(stack.sign(), flips)
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
) -> torch.Tensor:
    """Σ_i w_i τ_i over the entries whose sign agrees with ``elected``, divided per entry.

    ``stack``: the unweighted τ_i ``[n, ...]`` (overwritten); ``elected`` from
    :func:`elect_sign`. Agreement is judged on τ_i, or on w_i τ_i when ``weighted_sign`` (they
    differ only for negative weights); zeros never agree. ``divide_by``: "count" of agreeing
    experts (TIES paper, PEFT), "weight_sum" Σ of their w_i (mergekit ``normalize: true``) or
    "none" (mergekit ``normalize: false``). A position where nobody agrees gets 0.
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
    merged = _weighted_rows_sum(magnitudes, [w * f for w, f in zip(weights, flips)])
    merged.mul_(elected)
    if divide_by == "none":
        return merged
    agrees = magnitudes.sign_()  # 1 where expert i agrees, else 0
    if divide_by == "count":
        return merged.div_(agrees.sum(0).clamp_(min=1))
    divisor = _weighted_rows_sum(agrees, weights)
    if all(w > 0 for w in weights):  # then divisor is 0 (nobody agrees, merged = 0) or ≥ min w
        return merged.div_(divisor.clamp_(min=min(weights)))
    return merged.div_(divisor.masked_fill_(divisor == 0, 1))


# --- interpolation -------------------------------------------------------------------------------


def slerp(
    t: float,
    v0: torch.Tensor,
    v1: torch.Tensor,
    *,
    dot_threshold: float = 0.9995,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Spherical interpolation from ``v0`` (t = 0) to ``v1`` (t = 1), treating each as one vector.

    The angle is that of the normalised tensors; the result is
    sin((1−t)θ)/sin θ · v0 + sin(tθ)/sin θ · v1 on the raw tensors, and (1−t)·v0 + t·v1 when
    |cos θ| > ``dot_threshold`` (nearly colinear or antipodal). Norms ≤ ``eps`` count as 1.
    Same semantics as mergekit's ``slerp``.
    """
    norm0 = torch.linalg.vector_norm(v0)
    norm1 = torch.linalg.vector_norm(v1)
    norm0 = torch.where(norm0 > eps, norm0, 1)
    norm1 = torch.where(norm1 > eps, norm1, 1)
    dot = float(((v0 / norm0) * (v1 / norm1)).sum().clamp(-1, 1))
    if abs(dot) > dot_threshold:
        return (1 - t) * v0 + t * v1
    theta = math.acos(dot)
    sin_theta = math.sin(theta)
    return (math.sin((1 - t) * theta) / sin_theta) * v0 + (math.sin(t * theta) / sin_theta) * v1


def model_stock(
    base: torch.Tensor, experts: list[torch.Tensor], *, filter_wise: bool = False
) -> torch.Tensor:
    """Model Stock (Jang et al. 2024): θ_b + t (mean_i θ_i − θ_b), t = N c / (1 + (N − 1) c).

    c is the mean pairwise cosine between the experts' task vectors, computed over the whole
    tensor, or per vector along the last axis when ``filter_wise`` (1-D tensors then count as one
    row). Where 1 + (N − 1) c vanishes (|·| < 1e-6) t = 0, i.e. the base is kept. Same semantics
    as mergekit's ``model_stock``.
    """
    if len(experts) < 2:
        raise ValueError("model_stock needs at least two experts besides the base")
    shape = base.shape
    if filter_wise:
        view = (1, -1) if base.dim() == 1 else tuple(shape)
    else:
        view = (-1,)
    base_v = base.reshape(view)
    experts_v = [e.reshape(view) for e in experts]
    offsets = [e - base_v for e in experts_v]
    cosines = []
    for i, a in enumerate(offsets):
        for b in offsets[i + 1 :]:
            norms = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
            cosines.append(((a * b).sum(-1) / norms.clamp(min=1e-6)).clamp(-1, 1))
    cos_theta = torch.stack(cosines).mean(0).unsqueeze(-1)
    n = len(experts)
    denominator = 1 + (n - 1) * cos_theta
    singular = denominator.abs() < 1e-6
    t = torch.where(singular, 0.0, n * cos_theta / torch.where(singular, 1.0, denominator))
    average = sum(experts_v) / n
    return (t * average + (1 - t) * base_v).reshape(shape)


def nuslerp(
    t: float,
    v0: torch.Tensor,
    v1: torch.Tensor,
    *,
    row_wise: bool = False,
    flatten: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Spherical interpolation of many vectors at once, from ``v0`` (t = 0) to ``v1`` (t = 1).

    The vectors are the whole tensor (``flatten``), or else its rows (slices along the last axis)
    or, with ``row_wise``, its slices along axis 0 (mergekit's names). For each pair the angle θ is
    that of the normalised vectors (norms clamped to ≥ 1e-7) and the result is
    (sin((1−t)θ) v0 + sin(tθ) v1) / sin θ, or (1−t) v0 + t v1 where 1 − cos²θ ≤ ``eps``² (colinear).
    Same semantics as mergekit's ``nuslerp``. Returns a tensor of ``v0``'s shape.
    """
    shape = v0.shape
    if flatten:
        a, b = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        a, b = v0.transpose(0, -1), v1.transpose(0, -1)
    else:
        a, b = v0, v1

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=1e-7)

    cos_theta = (unit(a) * unit(b)).sum(dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos_theta.square()) <= eps**2
    theta = torch.acos(torch.where(colinear, 0, cos_theta))
    spherical = (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / torch.sin(theta)
    result = torch.where(colinear, (1 - t) * a + t * b, spherical)
    if row_wise and not flatten:
        result = result.transpose(0, -1)
    return result.reshape(shape)


def multislerp(
    tensors: list[torch.Tensor],
    weights: list[float],
    *,
    normalize_weights: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Barycentric interpolation of several tensors on the hypersphere (mergekit's ``multislerp``).

    Each tensor x_i (shape ``S``) is one vector. With weights w_i (divided by Σ w_i when
    ``normalize_weights``): the unit vectors u_i = x_i / (‖x_i‖ + eps) are averaged,
    m = Σ w_i u_i / ‖Σ w_i u_i‖; their tangent components at m, v_i = u_i − (u_i · m) m, are
    averaged, v = Σ w_i v_i; one exponential-map step gives m cos‖v‖ + v sin‖v‖ / ‖v‖ (‖v‖ + eps
    in place of ‖v‖), scaled to the weighted mean norm Σ w_i ‖x_i‖. Where Σ w_i u_i ≈ 0 (norm < eps)
    two tensors fall back to w_0 x_0 + w_1 x_1 and more are refused (no direction to average).
    """
    stack = torch.stack(tensors)
    flat = stack.view(len(tensors), -1)
    w = torch.tensor(weights, dtype=stack.dtype, device=stack.device)
    if normalize_weights:
        w = w / w.sum()
    column = w.view(-1, 1)
    norms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    mean = (units * column).sum(0)
    mean_norm = torch.linalg.vector_norm(mean)
    if mean_norm < eps:
        if len(tensors) == 2:
            return (stack[0] * w[0] + stack[1] * w[1]).view(stack.shape[1:])
        raise ValueError(
            "multislerp: the weighted mean direction of the models is zero (e.g. opposite "
            "tensors a, -a with equal weights); change the weights"
        )
    mean = mean / mean_norm
    tangents = units - (units * mean).sum(-1, keepdim=True) * mean
    step = (tangents * column).sum(0)
    step_norm = torch.linalg.vector_norm(step) + eps
    result = mean * torch.cos(step_norm) + step * (torch.sin(step_norm) / step_norm)
    return (result * (norms.squeeze(-1) * w).sum()).view(stack.shape[1:])


def karcher_mean(
    tensors: list[torch.Tensor],
    weights: list[float],
    *,
    max_iter: int = 10,
    tol: float = 1e-5,
) -> torch.Tensor:
    """Weighted Karcher (Fréchet) mean on the unit sphere, rescaled by the weighted mean norm.

    Each tensor x_i is one vector; α_i = w_i / Σ w_i. The directions u_i = x_i / ‖x_i‖ of the
    tensors with ‖x_i‖ > ``tol`` are averaged on the sphere by Riemannian gradient steps from their
    normalised (Euclidean) weighted mean: the tangent Σ α_i θ_i/sin θ_i (u_i − cos θ_i m) (α
    renormalised over those tensors; terms with θ_i < ``tol`` skipped) is followed along the great
    circle, at most ``max_iter`` times, stopping once its norm is < ``tol``. The result is
    (Σ_i α_i ‖x_i‖) · m over all tensors. Same algorithm as mergekit's ``karcher`` (which uses
    α_i = 1/n). All-zero inputs give zeros; one tensor gives itself. Norms and angles in float32
    (float64 for float64 input).
    """
    if len(tensors) == 1:
        return tensors[0].clone()
    total = sum(weights)
    alphas = [w / total for w in weights]
    dtype = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    norms = [torch.linalg.vector_norm(x.to(dtype)) for x in tensors]
    valid = [i for i, norm in enumerate(norms) if norm.item() > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    units = [(tensors[i] / norms[i]).to(tensors[i].dtype) for i in valid]
    valid_total = sum(alphas[i] for i in valid)
    valid_alphas = [alphas[i] / valid_total for i in valid]
    mean = torch.zeros_like(units[0])
    for alpha, u in zip(valid_alphas, units):
        mean += alpha * u
    mean_norm = torch.linalg.vector_norm(mean.to(dtype))
    # Directions that cancel out: start from the first one instead.
    mean = units[0].clone() if mean_norm.item() < tol else (mean / mean_norm).to(mean.dtype)
    for _ in range(max_iter):
        tangent = torch.zeros_like(mean)
        for alpha, u in zip(valid_alphas, units):
            cos_theta = torch.dot(mean.flatten(), u.flatten()).clamp(-1.0, 1.0)
            theta = torch.arccos(cos_theta)
            if theta.item() < tol:
                continue
            tangent += alpha * (theta / torch.sin(theta)) * (u - cos_theta * mean)
        tangent_norm = torch.linalg.vector_norm(tangent.to(dtype))
        if tangent_norm.item() < tol:
            break
        mean = (
            torch.cos(tangent_norm) * mean + torch.sin(tangent_norm) * (tangent / tangent_norm)
        ).to(mean.dtype)
        mean_norm = torch.linalg.vector_norm(mean.to(dtype))
        if mean_norm.item() > tol:  # back onto the sphere against round-off
            mean = (mean / mean_norm).to(mean.dtype)
    return sum(alpha * norm for alpha, norm in zip(alphas, norms)) * mean
