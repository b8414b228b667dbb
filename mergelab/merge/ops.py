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
