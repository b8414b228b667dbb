"""Exact k-th largest |τ| in fewer passes: the accelerator's threshold finders.

The specification of a magnitude threshold is :func:`mergelab.merge.methods.steps.kth_largest_abs`
(one tensor) and :func:`~mergelab.merge.methods.steps.model_magnitude_thresholds` (a whole
model, two radix-histogram passes). The finders here give the same values in fewer passes and
on every core: a sampled first pass places the k-th largest in a narrow band of buckets, one full
pass then counts (or collects) only that band, and the exact two passes follow only where the
sample missed (:class:`KthLargestAbs`); the whole-model pass samples clusters of entries
(:class:`ClusterSample`). Where the compiled loops run, the passes count with them
(:mod:`.kernels`), else with torch on :func:`.chunks.for_chunks`' workers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..methods.steps import HALF_DTYPES, TensorTriples, bits_to_float, in_dtype, kept_count
from . import chunks, kernels, sampling
from .chunks import _on_worker, as_dtype, scratch

_HIGH_BUCKETS = 1 << 15  # |x| has sign bit 0, so the top 16 bits of its float32 pattern are < 2¹⁵
_LOW_BUCKETS = 1 << 16
_INT32_MAX = (1 << 31) - 1


# --- exact k-th largest |x| by radix histograms ------------------------------------------------


def _locate(counts: np.ndarray, k: int) -> tuple[int, int]:
    """Bucket holding the k-th largest (1-based, at most the total) item of a histogram, and its
    rank inside it. A compiled loop from the top where the loops run (it stops at the bucket),
    else NumPy's cumulative sum of a reversed view, the slower of the two
    (``benchmarks/threshold_overhead.py`` times both per tensor)."""
    compiled = kernels.active_loops()
    if compiled is not None and counts.dtype == np.int64:
        bucket, rank = compiled.locate_from_top(counts, k)
        return int(bucket), int(rank)
    return _locate_numpy(counts, k)


def _locate_numpy(counts: np.ndarray, k: int) -> tuple[int, int]:
    """:func:`_locate` in NumPy (without the compiled loops)."""
    from_top = np.cumsum(counts[::-1])
    i = int(np.searchsorted(from_top, k))  # the first bucket from the top reaching k
    bucket = counts.size - 1 - i
    above = int(from_top[i]) - int(counts[bucket])
    return bucket, k - above


def _kth_largest_bits(parts: list[np.ndarray], k: int) -> int:
    """The k-th largest (1-based) of non-negative int32 bit patterns given in parts, by the same
    two radix steps as the passes (top 16 bits, then the low 16 inside that bucket): quick
    whether the values are all distinct or, as τ of bfloat16 weights, a few dozen repeated
    (where ``np.partition`` took ~16× as long as on distinct values). Counted by a compiled
    loop where the loops run."""
    values = np.concatenate(parts)
    compiled = kernels.active_loops()
    if compiled is not None:
        return int(compiled.kth_largest_bits(values, k))
    top = values >> 16
    first = int(top.min())
    bucket, rank = _locate(np.bincount(top - first), k)
    inside = values[top == first + bucket] & 0xFFFF
    low, _ = _locate(np.bincount(inside, minlength=_LOW_BUCKETS), rank)
    return ((first + bucket) << 16) | low


class KthLargestAbs:
    """Exact k-th largest |x| over values streamed in passes (e.g. tensors read from disk).

    Radix histograms of the float32 bit patterns of |x| (which order like the values):

    * pass 1 counts the top 16 bits (2¹⁵ buckets) and ``end_pass(k)`` finds the bucket of the
      k-th largest; pass 2 counts the low 16 bits inside that bucket: exact;
    * with ``sample_stride`` > 1, pass 1 sees only a 1/``sample_stride`` sample of the values
      (every ``sample_stride``-th, or runs of them: :func:`_sample_runs`; the caller gives
      ``add`` the full count): from that sample, a band of buckets that holds the k-th largest
      with overwhelming probability (±4 standard deviations of the sample quantile), and one
      full pass counts the values below and above the band and, for the values inside it,
      either keeps their bit patterns ("collect": when the sample says they are few, at most
      ``COLLECT_MAX / 2``, however many buckets the band spans; the k-th is then found among
      them) or histograms them (a band of at most ``MAX_BAND_BUCKETS`` buckets). If the k-th
      largest is not in the band after all (or a collecting pass met more than ``COLLECT_MAX``
      values), the two full passes follow. The result is exact either way; the sample only
      decides how many passes it takes.

    Usage: ``while finder.wants_pass():`` feed every value (every ``finder.stride``-th one, in any
    order and chunking) to ``observe``, then ``finder.end_pass(k)`` (``k`` is read at the end of
    the first pass, when ``count`` is known); then ``value()``. For parallel passes, split
    ``observe`` in two: ``histogram_(x)`` counts one chunk (it only reads the finder's state, so
    chunks can be counted on several threads at once, and it overwrites ``x``, a float32 scratch
    buffer), ``add(counts, numel)`` adds the counts up (``numel``: the values the chunk stands
    for, sampled or not).
    """

    def __init__(self, sample_stride: int = 1) -> None:
        self.count = 0
        self._first = True
        self._k = 0
        self._mode = "sample" if sample_stride > 1 else "high"
        self._sample_stride = sample_stride
        # Counts live in NumPy: single-threaded adds of up to 2¹⁸ bins, where torch woke its
        # OpenMP team for each and, on a busy machine, waited ~10 ms for it per add.
        self._counts = np.zeros(_HIGH_BUCKETS, dtype=np.int64)
        self._bucket = 0  # "low": the top-16-bit bucket; "band": the band's lowest bucket
        self._rank = 0
        self._width = 0  # "band": bins in the band; "collect": bit patterns in it
        self._value: float | None = None
        # "collect": the counts below and above the band, and the values inside it (None once
        # there were more than sampling.COLLECT_MAX)
        self._ends = np.zeros(2, dtype=np.int64)
        self._collected: list[np.ndarray] | None = []
        self._n_collected = 0

    @property
    def stride(self) -> int:
        """Which values this pass needs: every ``stride``-th."""
        return self._sample_stride if self._mode == "sample" else 1

    def wants_pass(self) -> bool:
        return self._mode != "done"

    def observe(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1)
        for part in chunks.chunks(flat.numel(), sampling.HISTOGRAM_CHUNK):
            self.observe_(flat[part].to(torch.float32, copy=True))

    def observe_(self, x: torch.Tensor) -> None:
        """``observe`` for a float32 scratch buffer that may be overwritten."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            return self.observe(x)
        self.add(self.histogram_(x), x.numel() * self.stride)

    def pass_bins(self) -> tuple[int | None, int, bool] | None:
        """This pass's bins as (low, width, collect), for a counting loop outside torch
        (:mod:`mergelab.merge.accelerator.kernels`): ``low`` None counts the top 16 bits of |x| into
        ``width`` = 2¹⁵ bins; otherwise ``bits − low`` clamped to [0, width + 1], as
        :meth:`histogram_` does (``low`` is −1 for the lowest bucket), except that with
        ``collect`` only the two ends are counted and the bit patterns inside kept.
        ``None`` once done."""
        if self._mode in ("sample", "high"):
            return None, _HIGH_BUCKETS, False
        if self._mode in ("low", "band", "collect"):
            width = _LOW_BUCKETS if self._mode == "low" else self._width
            return (self._bucket << 16) - 1, width, self._mode == "collect"
        return None

    def histogram_(self, x: torch.Tensor) -> Any:
        """This pass's counts for the float32 contiguous chunk ``x`` (overwritten); for a
        collecting pass the pair (counts below and above the band, the bit patterns inside)."""
        bits = x.abs_().view(-1).view(torch.int32)
        if self._mode == "collect":
            low = (self._bucket << 16) - 1
            highest = min(low + self._width, _INT32_MAX)
            above = bits > highest
            inside = (bits > low) & ~above
            n_above, n_inside = int(above.sum()), int(inside.sum())
            ends = np.array([bits.numel() - n_above - n_inside, n_above], dtype=np.int64)
            return ends, bits[inside].numpy()
        if self._mode in ("sample", "high"):  # the top 16 bits
            # without minlength the output only spans the buckets present: less to allocate/add
            return torch.bincount(bits.bitwise_right_shift_(16))
        if self._mode in ("low", "band"):  # bins of the bucket(s); the rest go to the two ends
            width = self._width if self._mode == "band" else _LOW_BUCKETS
            bits.sub_((self._bucket << 16) - 1).clamp_(0, width + 1)
            return torch.bincount(bits, minlength=width + 2)
        return None

    def add(self, counts: Any, numel: int) -> None:
        """Add the counts :meth:`histogram_` returned for a chunk standing for ``numel`` values
        (a collecting pass: the pair it returned; ``None`` for the values: more than
        ``COLLECT_MAX`` of them)."""
        if self._first:
            self.count += numel
        if counts is None:
            return
        if self._mode == "collect":
            ends, values = counts
            self._ends += ends
            if values is None or self._collected is None:
                self._collected = None
            elif len(values):
                self._n_collected += len(values)
                self._collected.append(values)
                if self._n_collected > sampling.COLLECT_MAX:  # too many to keep: the exact passes
                    self._collected = None
            return
        self._counts[: counts.numel()] += counts.cpu().numpy()

    def end_pass(self, k: int | None = None) -> None:
        """End a pass; after the first, ``k`` (1-based, clipped to ``count``) is required."""
        if self._first:
            self._first = False
            if k is None:
                raise ValueError("KthLargestAbs.end_pass(k): k is needed after the first pass")
            self._k = max(0, min(k, self.count))
            if self._k == 0:
                self._finish(math.inf)
                return
            if self._mode == "sample":
                self._enter_band()
                return
        if self._mode == "high":
            self._bucket, self._rank = _locate(self._counts, self._k)
            self._switch("low", _LOW_BUCKETS + 2)
        elif self._mode == "low":
            low, _ = _locate(self._counts[1:-1], self._rank)
            self._finish(bits_to_float((self._bucket << 16) | low))
        elif self._mode == "collect":
            above = int(self._ends[1])
            found = self._collected
            if found is not None and above < self._k <= above + self._n_collected:
                self._finish(bits_to_float(_kth_largest_bits(found, self._k - above)))
            else:  # the sample misled us, or the band held too many values: two exact passes
                self._switch("high", _HIGH_BUCKETS)
        elif self._mode == "band":
            above = int(self._counts[-1])
            inside = self._counts[1:-1]
            if above < self._k <= above + int(inside.sum()):
                offset, _ = _locate(inside, self._k - above)
                self._finish(bits_to_float((self._bucket << 16) + offset))
            else:  # the sample misled us (or the values changed): two exact passes
                self._switch("high", _HIGH_BUCKETS)

    def select(self, k: int) -> None:
        """End the first pass (kept for callers of the two-pass protocol)."""
        self.end_pass(k)

    def value(self) -> float:
        """The k-th largest |x| (``inf`` for k = 0: nothing reaches it)."""
        if self._value is None:
            raise RuntimeError("KthLargestAbs.value() before its last pass")
        return self._value

    def _switch(self, mode: str, bins: int) -> None:
        self._mode = mode
        self._counts = np.zeros(bins, dtype=np.int64)
        self._ends = np.zeros(2, dtype=np.int64)
        self._collected, self._n_collected = [], 0

    def _finish(self, value: float) -> None:
        self._mode, self._value = "done", value

    def _enter_band(self) -> None:
        """From the sampled histogram: the band of buckets that holds the k-th largest of all
        values with overwhelming probability, or two exact passes if it is too wide."""
        m = int(self._counts.sum())
        q = self._k / self.count
        expected = q * m  # the k-th largest's rank among the sampled values
        margin = 4 * math.sqrt(m * q * (1 - q)) + 4
        top, bottom = math.floor(expected - margin), math.ceil(expected + margin)
        if top >= 1 and bottom <= m:
            high, _ = _locate(self._counts, top)
            low, _ = _locate(self._counts, bottom)
            self._choose_band(low, high, int(self._counts[low : high + 1].sum()), m)
            return
        self._switch("high", _HIGH_BUCKETS)

    def _choose_band(
        self,
        low: int,
        high: int,
        sampled_inside: int,
        m: int,
        widest: int = sampling.MAX_BAND_BUCKETS,
    ) -> None:
        """The next pass for a band of top-16-bit buckets ``low`` .. ``high`` that the sample (``m``
        values, ``sampled_inside`` of them in the band) says holds the k-th largest: collect its
        values if few, else histogram it if at most ``widest`` buckets, else the two exact
        passes."""
        self._bucket, self._width = low, (high - low + 1) << 16
        if sampled_inside * (self.count / m) <= sampling.COLLECT_MAX // 2:
            self._switch("collect", 0)
        elif high - low + 1 <= widest:
            self._switch("band", self._width + 2)
        else:
            self._switch("high", _HIGH_BUCKETS)

    def from_sample(self, count: int, k: int, rows: np.ndarray) -> None:
        """End the first pass with a sample of clusters (:class:`ClusterSample`) instead of a
        histogram: ``count`` values in all, of which the k-th largest (1-based) is wanted; ``rows``
        the sampled clusters' |x| bit patterns, one row each (−1 pads a short cluster).

        The band is the sample's (q ∓ δ)-quantiles, q = k / count (Woodruff's interval):
        δ is sampling.MODEL_SAMPLE_MARGIN standard errors of the sampled fraction at or above the sample's
        q-quantile t, estimated over the clusters (a ratio estimator: Σ_c (a_c − p n_c)², a_c of
        the n_c values of cluster c at or above t, p their total share), plus
        sampling.MODEL_SAMPLE_MARGIN / m; it allows for values of a cluster being alike, which a bracket
        counted over values does not."""
        self._first = False
        self.count = count
        self._k = max(0, min(k, count))
        if self._k == 0:
            self._finish(math.inf)
            return
        valid = rows >= 0
        values = rows[valid]
        m = values.size
        clusters = rows.shape[0]
        if clusters < 2:
            self._switch("high", _HIGH_BUCKETS)
            return
        q = self._k / count
        t = _kth_largest_bits([values], min(m, max(1, math.ceil(q * m))))
        at_or_above = (rows >= t).sum(axis=1)
        sizes = valid.sum(axis=1)
        share = at_or_above.sum() / m
        spread = float(((at_or_above - share * sizes) ** 2).sum())
        se = math.sqrt(clusters / (clusters - 1) * spread) / m
        delta = sampling.MODEL_SAMPLE_MARGIN * (se + 1 / m)
        top, bottom = math.floor((q - delta) * m), math.ceil((q + delta) * m)
        if top < 1 or bottom > m:
            self._switch("high", _HIGH_BUCKETS)
            return
        high = _kth_largest_bits([values], top) >> 16
        low = _kth_largest_bits([values], bottom) >> 16
        buckets = values >> 16
        inside = int(((buckets >= low) & (buckets <= high)).sum())
        self._choose_band(low, high, inside, m, sampling.MODEL_MAX_BAND_BUCKETS)


def kth_largest_abs_many(x: torch.Tensor, ks: Sequence[int]) -> list[float]:
    """Exact k-th largest |x| of one tensor for every k in ``ks`` (1-based; ``k`` ≥ numel gives
    the smallest |x|, ``k`` ≤ 0 gives ``inf``), with one shared (sampled) first pass, on every
    core (:func:`for_chunks`)."""
    flat = x.detach().reshape(-1)

    def histograms(finders: list[KthLargestAbs], _: list[int]) -> Callable[[slice], list]:
        def count(part: slice) -> list[torch.Tensor | None]:
            out = []
            for finder in finders:
                values = flat[part.start : part.stop : finder.stride]
                out.append(finder.histogram_(scratch("kth", values.numel()).copy_(values)))
            return out

        return count

    return _find_many(flat.numel(), [list(ks)], histograms)[0]


def kth_largest_abs(x: torch.Tensor, k: int) -> float:
    """Exact k-th largest |x| of one tensor (1-based; ``k`` ≥ numel gives the smallest |x|)."""
    if k <= 0:
        return math.inf
    return kth_largest_abs_many(x, [k])[0]


def _find_many(
    numel: int,
    ranks: list[list[int]],
    histograms: Callable[[list[KthLargestAbs], list[int]], Callable[[slice], list]],
) -> list[list[float]]:
    """Drive :class:`KthLargestAbs` finders over one tensor: for group g and every k in
    ``ranks[g]``; ``histograms(finders)`` returns the per-chunk counting function of group
    members ``finders`` (group index known to it by position). The groups share their first
    pass (the k only matters after it)."""
    stride = sampling.sample_stride(numel)
    groups = [[KthLargestAbs(stride) for _ in ks] for ks in ranks]
    firsts = [g[0] for g in groups if g]
    order = [i for i, g in enumerate(groups) if g]
    size = sampling.histogram_chunk(numel)

    def run(active: list[tuple[int, KthLargestAbs]]) -> None:
        count = histograms_for(active)
        finders = [f for _, f in active]
        _add_chunk_counts(chunks.for_chunks(numel, count, size), numel, size, finders)
        _add_totals(count, finders)

    def histograms_for(active: list[tuple[int, KthLargestAbs]]) -> Callable[[slice], list]:
        return histograms([f for _, f in active], [g for g, _ in active])

    run([(g, f) for g, f in zip(order, firsts)])
    for group, ks in zip(groups, ranks):
        if not group:
            continue
        count, counts = group[0].count, group[0]._counts.copy()  # noqa: SLF001
        for finder, k in zip(group, ks):
            if finder is not group[0]:  # the same values: the same first pass
                finder.count, finder._counts = count, counts.copy()  # noqa: SLF001
            finder.end_pass(k)
    while True:
        active = [(g, f) for g, group in enumerate(groups) for f in group if f.wants_pass()]
        if not active:
            break
        run(active)
        for _, finder in active:
            finder.end_pass()
    return [[f.value() for f in group] for group in groups]


def _tau_histograms(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    dtype: torch.dtype | None = None,
    shared: kernels.PassCounts | None = None,
) -> Callable[[list[KthLargestAbs], list[int]], Callable[[slice], list]]:
    """For finders of τ_i = θ_i − θ_b: a per-chunk counting function (``finders[j]`` counts
    τ of expert ``indices[j]``), τ formed in ``dtype`` (default: the base's) in scratch
    buffers, inputs cast chunk by chunk, only the entries each finder's pass needs (its
    ``stride``: a sampled pass reads :func:`_sample_runs`), then widened to float32. Where the
    compiled loops count, they count into ``shared`` if given (one pass over many tensors,
    whose totals the caller adds), else into a counter of this tensor's own."""
    dtype = dtype or base.dtype
    if dtype == torch.float32 and base.numel() < 2**31 and kernels.usable(base, *experts):
        if shared is not None:
            counting = shared.counting(base, experts)
            return lambda _finders, _indices: counting
        return _compiled_tau_histograms(base, experts)
    flat_base = base.reshape(-1)
    flat_experts = [e.reshape(-1) for e in experts]

    def histograms(finders: list[KthLargestAbs], indices: list[int]) -> Callable[[slice], list]:
        def count(part: slice) -> list[torch.Tensor | None]:
            cast: dict[int, torch.Tensor] = {}
            out = []
            for finder, i in zip(finders, indices):
                step = finder.stride
                if step not in cast:
                    cast[step] = as_dtype(_sample_runs(flat_base, part, step), dtype, f"b{step}")
                b = cast[step]
                e = as_dtype(_sample_runs(flat_experts[i], part, step), dtype, "in-expert")
                if dtype == torch.float32:
                    tau = torch.sub(e, b, out=scratch("tau", b.numel()))
                else:  # τ is formed in the compute dtype, then widened
                    tau = (e - b).float()
                out.append(finder.histogram_(tau))
            return out

        return count

    return histograms


def _add_totals(count: Callable[[slice], list], finders: list[KthLargestAbs]) -> None:
    """Counts a counting function kept per worker thread instead of returning them per chunk
    (``count.totals()``, the compiled loops'), added once per pass."""
    totals = getattr(count, "totals", None)
    if totals is not None:
        for finder, c in zip(finders, totals()):
            finder.add(c, 0)


def _sample_runs(flat: torch.Tensor, part: slice, stride: int) -> torch.Tensor:
    """The entries of ``flat[part]`` a pass with ``stride`` reads: all for stride 1, else one run
    of :data:`SAMPLE_RUN` from every ``SAMPLE_RUN · stride`` (counted from ``part.start``, a
    multiple of that period for every chunk of a tensor), the one :func:`run_offsets` picks, and
    the first of an incomplete last period."""
    x = flat[part]
    if stride == 1:
        return x
    period = sampling.SAMPLE_RUN * stride
    full = x.numel() // period * period
    runs = x[:full].view(-1, stride, sampling.SAMPLE_RUN)
    periods = torch.arange(runs.shape[0])
    head = runs[periods, sampling.run_offsets(periods, stride)].reshape(-1)
    tail = x[full:][: sampling.SAMPLE_RUN]
    return torch.cat([head, tail]) if tail.numel() else head


def _compiled_tau_histograms(
    base: torch.Tensor, experts: list[torch.Tensor]
) -> Callable[[list[KthLargestAbs], list[int]], Callable[[slice], list]]:
    """:func:`_tau_histograms` for float32 τ, counted by a compiled loop straight from the stored
    inputs (:class:`kernels.TauHistograms`): the same counts, one pass per chunk and finder."""
    counter = kernels.TauHistograms(base, experts)

    def histograms(finders: list[KthLargestAbs], indices: list[int]) -> Callable[[slice], list]:
        return counter.pass_counts([(i, f.stride, f.pass_bins()) for f, i in zip(finders, indices)])

    return histograms


def tau_kth_largest_abs(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    ranks: list[list[int]],
    dtype: torch.dtype | None = None,
) -> list[list[float]]:
    """For every expert i and every k in ``ranks[i]``: the exact k-th largest |τ_i| of this
    tensor, τ_i = θ_i − θ_b formed chunk by chunk in ``dtype`` (default: the base's), with no
    full-size task vector. The ranks of one expert share a (sampled) first pass
    (:class:`KthLargestAbs`). Where :func:`_in_one_call`, the same passes run in one compiled
    call on the calling thread (:func:`kernels.tau_kth`), else chunked on every core."""
    dtype = dtype or base.dtype
    if dtype in HALF_DTYPES and all(x.dtype == dtype for x in [base, *experts]):
        # torch forms a half-precision τ in float32 and rounds it: τ = r(τ32), r monotonic and
        # odd, so the k-th largest |τ| is r(the k-th largest |τ32|): the float32 passes', rounded
        wide = tau_kth_largest_abs(base, experts, ranks, torch.float32)
        return [[float(in_dtype(v, dtype)) for v in values] for values in wide]
    if dtype == torch.float32 and _in_one_call(base, experts):
        return _one_call_kth(base, experts, ranks)
    return _find_many(base.numel(), ranks, _tau_histograms(base, experts, dtype))


# From this many entries, a tensor's threshold passes called outside the chunk workers run
# chunked on every core (:func:`_find_many`); smaller tensors, and any on a chunk worker (where
# :func:`for_chunks` runs on the calling thread anyway), take one compiled call.
ONE_CALL_MAX = 1 << 23


def _in_one_call(base: torch.Tensor, experts: list[torch.Tensor]) -> bool:
    """Whether :func:`tau_kth_largest_abs` runs :func:`kernels.tau_kth` for these inputs."""
    if not kernels.one_call_kth(base, experts):
        return False
    on_worker = getattr(_on_worker, "active", False)
    return on_worker or base.numel() < ONE_CALL_MAX or chunks.chunk_workers() is None


def _one_call_kth(
    base: torch.Tensor, experts: list[torch.Tensor], ranks: list[list[int]]
) -> list[list[float]]:
    """:func:`kernels.tau_kth` for ranks as :class:`KthLargestAbs` clips them (k ≤ 0:
    ``inf``; k > numel: the smallest)."""
    numel = base.numel()
    wanted = [[min(k, numel) for k in ks if k > 0] for ks in ranks]
    found = [iter(bits) for bits in kernels.tau_kth(base, experts, wanted)[0]]
    return [
        [bits_to_float(next(bits)) if k > 0 else math.inf for k in ks]
        for ks, bits in zip(ranks, found)
    ]


def global_magnitude_thresholds(
    make_iter: Callable[[], TensorTriples],
    densities: list[float],
    dtype: torch.dtype | None = None,
    *,
    fetch_ahead: bool = False,
    sample_iter: Callable[[], TensorTriples] | None = None,
) -> list[float]:
    """Per-expert |τ_i| thresholds over every tensor ``make_iter()`` yields (global top-k).

    ``make_iter()`` returns a fresh iterable of ``(name, base, experts)``; it is called once per
    pass and nothing but the current tensor is held. The first pass samples clusters of
    entries (:class:`ClusterSample`, over ``sample_iter()`` if given: the same tensors, e.g. memory
    maps not populated ahead, since it reads few of their pages; it is walked once before, without
    reading anything, to count the clusters); then one exact pass over the
    band the sample gives (two more at worst, see :class:`KthLargestAbs`); no pass at all where
    every density is 1. With ``fetch_ahead`` (only for tensors that stay
    valid after the next is yielded, such as fresh memory maps) each tensor is counted on every
    core while the next one is fetched, two held at once. τ_i is formed chunk by chunk in reused
    buffers, on every core, in ``dtype`` (default: each base's own). Expert i keeps the entries
    with |τ_i| ≥ its threshold, i.e. its ``kept_count(density_i, N)`` largest over all N
    parameters (plus any exact ties with the k-th). Over the whole model this is the TIES paper's
    trim; over one tensor, mergekit's.
    """
    finders = [KthLargestAbs() for _ in densities]
    trimming = [(i, f) for i, f in enumerate(finders) if densities[i] < 1]
    if not trimming:  # a density of 1 keeps everything: no threshold to find
        return [0.0] * len(densities)
    clusters = None
    if sample_iter is not None:  # cheap to walk: count the clusters (the sample reads ~its budget)
        clusters = sum(ClusterSample.clusters_in(base.numel()) for _, base, _ in sample_iter())
    sample = ClusterSample(len(trimming), clusters)
    for _, base, experts in (sample_iter or make_iter)():
        sample.add(base, [experts[i] for i, _ in trimming], dtype)
        del base, experts
    for j, (i, finder) in enumerate(trimming):
        k = kept_count(densities[i], sample.count)
        finder.from_sample(sample.count, k, sample.rows(j))
    while True:
        active = [(i, f) for i, f in trimming if f.wants_pass()]
        if not active:
            break
        _model_pass(make_iter, active, dtype, fetch_ahead)
        for _, finder in active:
            finder.end_pass()
    return [0.0 if d >= 1 else f.value() for f, d in zip(finders, densities)]


class ClusterSample:
    """A uniform sample of clusters of :data:`MODEL_SAMPLE_CLUSTER` consecutive entries over one
    pass of tensors, and the bit patterns of every expert's |τ| at the entries read of them: one
    run of :data:`MODEL_SAMPLE_RUN` from every :data:`MODEL_SAMPLE_PERIOD` entries of a
    cluster, at a hashed offset (:func:`run_offsets`, as the per-tensor sample reads them).

    Bottom-k sampling: each cluster gets a hash of (tensor, cluster) (SplitMix64's finaliser);
    the sample is the :data:`MODEL_SAMPLE_CLUSTERS` clusters with the smallest hashes of all,
    each cluster equally likely whatever the tensors' sizes. As the pass goes, the clusters
    with hashes up to a cut are kept; where a tensor's would make more than twice the budget,
    the cut first drops to the budget-th smallest hash of those held and this tensor's, and the
    clusters above it go. A cluster above the cut is never read, so the pass reads about
    budget · (1 + ln(clusters / budget)) clusters, or, told how many ``clusters`` there are,
    about 5/4 of the budget (the cut starts there); it holds at most twice the budget
    (8 MiB of bit patterns per expert at the defaults).
    """

    def __init__(self, n_experts: int, clusters: int | None = None) -> None:
        self.count = 0  # entries seen
        self._budget, self._size = sampling.MODEL_SAMPLE_CLUSTERS, sampling.MODEL_SAMPLE_CLUSTER
        self._period, self._run = sampling.MODEL_SAMPLE_PERIOD, sampling.MODEL_SAMPLE_RUN
        self._cut = np.uint64(2**64 - 1)
        if clusters is not None and clusters > 2 * self._budget:
            self._cut = np.uint64(int(2**64 * (5 * self._budget / 4) / clusters))
        self._tensors = 0
        self._hashes: list[np.ndarray] = []
        self._rows: list[list[np.ndarray]] = [[] for _ in range(n_experts)]
        self._held = 0

    def add(
        self, base: torch.Tensor, experts: list[torch.Tensor], dtype: torch.dtype | None
    ) -> None:
        """Sample one tensor's clusters (τ_i formed in ``dtype``, default the base's, as the
        exact passes form it)."""
        numel = base.numel()
        self.count += numel
        n_clusters = self.clusters_in(numel)
        ids = np.arange(n_clusters, dtype=np.uint64) | np.uint64(self._tensors << 32)
        self._tensors += 1
        hashes = _mix64(ids)
        picked = np.flatnonzero(hashes <= self._cut)
        if self._held + picked.size > 2 * self._budget:
            self._keep(self._budget, hashes[picked])
            picked = picked[hashes[picked] <= self._cut]
        if not picked.size:
            return
        index, outside = self._entries(picked, numel)
        dtype = dtype or base.dtype
        b = base.reshape(-1)[index].to(dtype)
        for rows, expert in zip(self._rows, experts):
            e = expert.reshape(-1)[index].to(dtype)
            bits = (e - b).float().abs_().view(torch.int32).numpy()
            bits[outside] = -1
            rows.append(bits)
        self._hashes.append(hashes[picked])
        self._held += picked.size

    @staticmethod
    def clusters_in(numel: int) -> int:
        """How many clusters a tensor of ``numel`` entries is cut into (the last one short)."""
        return -(-numel // sampling.MODEL_SAMPLE_CLUSTER)

    def _entries(self, picked: np.ndarray, numel: int) -> tuple[torch.Tensor, np.ndarray]:
        """The entries read of clusters ``picked`` of a tensor of ``numel``: their indices,
        ``[clusters, size / period · run]`` (those past the end repeat its last entry), and
        where they are past the end."""
        per = self._size // self._period
        periods = (picked[:, None] * per + np.arange(per)).astype(np.int64)
        offsets = sampling.run_offsets(torch.from_numpy(periods), self._period // self._run).numpy()
        starts = periods * self._period + offsets * self._run
        index = (starts[:, :, None] + np.arange(self._run)).reshape(len(picked), -1)
        outside = index >= numel
        return torch.from_numpy(np.minimum(index, numel - 1)), outside

    def rows(self, expert: int) -> np.ndarray:
        """The sampled clusters' |τ| bit patterns of trimming expert ``expert`` (in the order of
        ``add``'s experts), one row per cluster, −1 for entries past a tensor's end."""
        if self._held > self._budget:
            self._keep(self._budget)
        rows = self._rows[expert]
        if not rows:
            return np.empty((0, self._size // self._period * self._run), dtype=np.int32)
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def _keep(self, n: int, coming: np.ndarray | None = None) -> None:
        """Lower the cut to the ``n``-th smallest hash of the clusters held and those ``coming``
        (not read yet), and drop the clusters held above it: later clusters are read only if
        their hash is at most the cut."""
        held = np.concatenate(self._hashes) if self._hashes else np.empty(0, np.uint64)
        candidates = held if coming is None else np.concatenate([held, coming])
        self._cut = np.partition(candidates, n - 1)[n - 1]
        kept = np.flatnonzero(held <= self._cut)
        self._hashes = [held[kept]]
        self._rows = [[np.concatenate(rows)[kept]] if rows else [] for rows in self._rows]
        self._held = kept.size


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of uint64 ``x`` (a bijection that scatters nearby inputs)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _model_pass(
    make_iter: Callable[[], TensorTriples],
    active: list[tuple[int, KthLargestAbs]],
    dtype: torch.dtype | None,
    fetch_ahead: bool,
) -> None:
    """One pass of whole-model finders (expert index, finder) over every tensor, on every core;
    with ``fetch_ahead`` a tensor's chunks are counted while the next tensor is fetched (mapping
    it is most of a pass's own cost). The compiled loops count into one set of arrays per
    worker for the whole pass, added to the finders once at its end."""
    finders, indices = [f for _, f in active], [i for i, _ in active]
    shared = kernels.PassCounts(None, [(i, f.stride, f.pass_bins()) for i, f in active])
    counting: Callable[[], None] | None = None
    for _, base, experts in make_iter():
        numel = base.numel()
        size = sampling.histogram_chunk(numel)
        started = chunks.start_chunks(
            numel, _tau_histograms(base, experts, dtype, shared)(finders, indices), size
        )
        if counting is not None:
            counting()
        counting = functools.partial(_wait_and_add, started, numel, size, finders)
        if not fetch_ahead:
            counting()
            counting = None
        del base, experts  # held by the counting function until it is done
    if counting is not None:
        counting()
    for finder, c in zip(finders, shared.totals()):
        if c is not None:
            finder.add(c, 0)


def _wait_and_add(
    started: Callable[[], list], numel: int, size: int, finders: list[KthLargestAbs]
) -> None:
    """Wait for a tensor's counting chunks (:func:`start_chunks`), then :func:`_add_chunk_counts`."""
    _add_chunk_counts(started(), numel, size, finders)


def _add_chunk_counts(counted: list, numel: int, size: int, finders: list[KthLargestAbs]) -> None:
    """Add what each of a tensor's counting chunks returned to its finder (the compiled loops
    return ``None``: their counts come with the pass's totals)."""
    for part, counts in zip(chunks.chunks(numel, size), counted):
        for finder, c in zip(finders, counts):
            finder.add(c, part.stop - part.start)
