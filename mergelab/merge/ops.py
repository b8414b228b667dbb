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
The chunks run on :func:`for_chunks`' worker threads, one per torch thread
(``torch.get_num_threads()``), each running torch single-threaded: every core is busy with
whole chunks, and no op waits at an OpenMP barrier for a thread the OS has given to another
process (on a shared 2-core machine that stall made intra-op threading slower than one thread).
Results never depend on the number of workers: chunk boundaries are fixed and every reduction is
combined in chunk order.

DARE's random masks come from NumPy's SFC64 generator, one stream per block of
:data:`CHUNK` entries (see :func:`dare_keep_mask`): blocks are drawn in parallel, and the raw
64-bit output NumPy guarantees stable across versions is turned into masks here.

Where the compiled loops were built, the chunked methods and the histogram passes over task vectors run
compiled loops instead (:mod:`mergelab.merge.kernels`): the same operations in the same order,
so the same bits; the torch code here is their reference and the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from . import kernels

TensorTriples = Iterable[tuple[str, torch.Tensor, list[torch.Tensor]]]
R = TypeVar("R")

_HIGH_BUCKETS = 1 << 15  # |x| has sign bit 0, so the top 16 bits of its float32 pattern are < 2¹⁵
_LOW_BUCKETS = 1 << 16
_INT32_MAX = (1 << 31) - 1
# Entries per chunk in the elementwise loops: 1 MiB of float32, so temporaries stay in the
# (shared) L3 cache, and big enough that the worker threads rarely wait for each other's Python
# (the GIL) between ops: 2¹⁶ was ~2× slower on two workers here.
CHUNK = 1 << 18
# Histogram passes take bigger chunks where a tensor has enough of them for every worker: each
# bincount call allocates and zeroes its output (up to 4 × 2¹⁶ bins), which at 2¹⁸ entries per
# call cost as much as the counting.
HISTOGRAM_CHUNK = 1 << 20


def histogram_chunk(numel: int) -> int:
    """Chunk size of a histogram pass over ``numel`` entries: the largest power of two from
    :data:`CHUNK` to :data:`HISTOGRAM_CHUNK` that still gives every worker about four chunks."""
    size = HISTOGRAM_CHUNK
    while size > CHUNK and numel < 8 * size:
        size //= 2
    return size


# DARE's masks are drawn in blocks of this many entries, one random stream per block.
DARE_BLOCK = CHUNK
# torch runs an op over fewer entries than this on the calling thread (at::internal::GRAIN_SIZE);
# below it, for_chunks does too.
GRAIN = 1 << 15


def chunks(numel: int, size: int | None = None) -> Iterable[slice]:
    """Consecutive slices of ``size`` (default :data:`CHUNK`) entries covering ``range(numel)``."""
    size = size or CHUNK
    return (slice(start, min(start + size, numel)) for start in range(0, numel, size))


# --- running chunks on every core ----------------------------------------------------------------

_workers_lock = threading.Lock()
_workers: tuple[int, ThreadPoolExecutor] | None = None
_on_worker = threading.local()


def _start_worker(barrier: threading.Barrier) -> None:
    # torch reads its thread count into a new thread lazily, on its first parallel op, from the
    # process-wide setting; that must happen before this thread's own setting, or the lazy read
    # (after chunk_workers set the process-wide value back) would undo it.
    torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's ops run on this thread only
    _on_worker.active = True
    barrier.wait()


def _keep_freed_memory() -> None:
    """Ask glibc's malloc to keep freed blocks of up to 32 MiB for reuse instead of returning
    them to the OS: the chunk workers allocate and free chunk-sized temporaries all the time,
    and each block given back had to be faulted in and zeroed again by the kernel (a third of
    a TIES merge's CPU time went to the kernel before). Process-wide; no-op without glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: trim a heap only above 1 GiB free
        libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD: blocks up to 32 MiB come from heaps
    except (OSError, AttributeError):
        pass


def chunk_workers() -> ThreadPoolExecutor | None:
    """The worker threads of :func:`for_chunks`, one per torch thread (``None`` for one thread).

    Each worker runs torch single-threaded. ``torch.set_num_threads(1)`` in a worker also lowers
    the default that threads started later inherit, so it is set back once all workers started.
    """
    global _workers
    n = torch.get_num_threads()
    if n <= 1:
        return None
    with _workers_lock:
        if _workers is None or _workers[0] != n:
            if _workers is not None:
                _workers[1].shutdown(wait=False)
            if _workers is None:
                _keep_freed_memory()
            barrier = threading.Barrier(n + 1)
            pool = ThreadPoolExecutor(n, thread_name_prefix="mergelab-chunks")
            for _ in range(n):  # n blocking tasks: the pool starts n threads
                pool.submit(_start_worker, barrier)
            barrier.wait()
            torch.set_num_threads(n)
            _workers = (n, pool)
        return _workers[1]


def for_chunks(numel: int, fn: Callable[[slice], R], size: int | None = None) -> list[R]:
    """``[fn(part) for part in chunks(numel, size)]``, the chunks spread over every core.

    The chunks run on :func:`chunk_workers` (in a few contiguous runs per worker, taken in
    turn), single-threaded each, so results never depend on the thread count; results come back
    in chunk order. ``fn`` must only write to its own chunk of shared outputs, and must not call
    ``for_chunks`` itself (a nested call runs serially). With one torch thread, or fewer than
    :data:`GRAIN` entries, everything runs on the calling thread.
    """
    return start_chunks(numel, fn, size)()


def start_chunks(
    numel: int, fn: Callable[[slice], R], size: int | None = None
) -> Callable[[], list[R]]:
    """:func:`for_chunks` started: the chunks run on the workers while the caller goes on;
    calling the result waits for them and returns what ``for_chunks`` would. Where
    ``for_chunks`` runs on the calling thread, they have run when this returns."""
    parts = list(chunks(numel, size))
    workers = None if numel < GRAIN or getattr(_on_worker, "active", False) else chunk_workers()
    if workers is None or len(parts) == 1:
        if workers is not None:  # one chunk, still single-threaded: the same results either way
            future = workers.submit(fn, parts[0])
            return lambda: [future.result()]
        done = [fn(part) for part in parts]
        return lambda: done
    n_runs = min(len(parts), 4 * _workers[0])
    bounds = [round(i * len(parts) / n_runs) for i in range(n_runs + 1)]
    runs = [parts[a:b] for a, b in zip(bounds, bounds[1:])]
    futures = [workers.submit(lambda run: [fn(part) for part in run], run) for run in runs]

    def results() -> list[R]:
        out: list[R] = []
        for future in futures:
            out.extend(future.result())
        return out

    return results


def parallel_copy_(
    dst: torch.Tensor, src: torch.Tensor, *, check: Literal["src", "dst"] | None = None
) -> bool:
    """``dst.copy_(src)`` (casting) chunk by chunk on every core; ``dst`` contiguous, same numel.

    With ``check`` ("src" or "dst"), returns whether every entry of that side is finite (one
    cheap sum per chunk while it is in cache, see :func:`all_finite_chunk`); otherwise True.
    """
    flat_dst, flat_src = dst.view(-1), src.reshape(-1)

    def copy(part: slice) -> bool:
        out = flat_dst[part].copy_(flat_src[part])
        if check is None:
            return True
        return all_finite_chunk(out if check == "dst" else flat_src[part])

    return all(for_chunks(flat_dst.numel(), copy))


def all_finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``, checked chunk by chunk on every core."""
    flat = x.reshape(-1)
    return all(for_chunks(flat.numel(), lambda part: all_finite_chunk(flat[part])))


def abs_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ |x| as a 0-d tensor of x's dtype: chunk sums on every core, added in chunk order, so the
    rounding does not depend on the number of threads."""
    flat = x.reshape(-1)
    partial = for_chunks(flat.numel(), lambda part: flat[part].abs().sum())
    return torch.stack(partial).sum() if partial else flat.new_zeros(())


def all_finite_chunk(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``: by a compiled loop where a merge already loaded them (exponent bits,
    one pass), else with torch: a sum is finite whenever ``x`` is (unless it overflows); only a
    non-finite sum needs the exact element-wise check."""
    compiled = kernels.all_finite_compiled(x)
    if compiled is not None:
        return compiled
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


_scratch = threading.local()


def scratch(
    key: str, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """A per-thread reusable flat buffer of ``numel`` entries (valid until the same thread asks
    for ``key`` again)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    device = torch.device("cpu") if device is None else device
    buf = buffers.get((key, dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, CHUNK), dtype=dtype, device=device)
        buffers[(key, dtype, device)] = buf
    return buf[:numel]


def as_dtype(x: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
    """``x`` (a chunk) in ``dtype``: itself, or a copy in this thread's scratch buffer ``key``."""
    if x.dtype == dtype:
        return x
    return scratch(key, x.numel(), dtype, x.device).view(x.shape).copy_(x)


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


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


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


# The sampled first pass of KthLargestAbs: every SAMPLE_STRIDE-th entry of tensors this large
# (the whole-model pass, and a tensor's own pass at least: from 2¹⁹ entries, e.g. the 512×1024
# key and value projections of grouped-query attention, the sample holds SAMPLE_VALUES) ...
SAMPLE_STRIDE = 8
SAMPLE_MIN_NUMEL = 1 << 19
# ... and a tensor's own pass reads a sparser sample where it still holds SAMPLE_VALUES values,
# up to one in SAMPLE_STRIDE_MAX: the sample's bracket of the k-th largest holds about
# 4·numel/√(sampled values) of the tensor's values (±4 standard deviations of the sampled
# quantile), for 2¹⁶ sampled values at most numel/64 (below COLLECT_MAX / 2 for the 4M-entry
# matrices of a 1B model); the rest of a bracket is the width of the top-16-bit buckets it is
# rounded to, which the sample's size does not change. The sampled pass costs about one memory
# latency per run it reads, so a sparser sample is that much cheaper. At most 1/32: a period
# (SAMPLE_RUN · stride entries) then spans at most 1024 entries, a row of most weight matrices,
# so every row is sampled; at 1/64 every other row of a 4096×1024 matrix was skipped, and where
# rows differ in scale the bracket missed (benchmarks/sampling_passes.py).
SAMPLE_VALUES = 1 << 16
SAMPLE_STRIDE_MAX = 32
# Task vectors are sampled in runs instead (_sample_runs): SAMPLE_RUN consecutive entries out of
# every SAMPLE_RUN · stride, so the pass reads 1/stride of the memory (every stride-th entry of
# bfloat16 weights touches every 64-byte cache line). Which run of a period is read varies from
# period to period (run_offsets).
SAMPLE_RUN = 32
# The whole-model first pass (global_magnitude_thresholds) samples clusters of
# MODEL_SAMPLE_CLUSTER consecutive entries (64 KiB of bfloat16, what the kernel maps at one page
# fault) instead: the MODEL_SAMPLE_CLUSTERS clusters of the whole model with the smallest hash
# (ClusterSample), of each one run of MODEL_SAMPLE_RUN entries from every MODEL_SAMPLE_PERIOD
# (every row of a 1024-wide matrix, as the per-tensor sample). It reads a few thousand clusters
# of a model of any size, where a strided sample touched every page (and mapping every page was
# most of that pass's time). Values of one cluster (32 rows of a matrix) are more alike than
# values drawn alone, so the bracket of the k-th largest is MODEL_SAMPLE_MARGIN standard errors
# of the sampled fraction counted over clusters, not over values (KthLargestAbs.from_sample).
MODEL_SAMPLE_CLUSTER = 1 << 15
MODEL_SAMPLE_CLUSTERS = 1024
MODEL_SAMPLE_PERIOD = SAMPLE_RUN * SAMPLE_STRIDE_MAX
MODEL_SAMPLE_RUN = SAMPLE_RUN
MODEL_SAMPLE_MARGIN = 4
# A sampled bracket spans at most this many top-16-bit buckets (its histogram: 2¹⁶ bins each)
# in a tensor's own passes, and in the whole-model pass, whose counts are kept once per worker
# for the whole pass (kernels.PassCounts: at most 4 MiB of int32, 8 once widened to int64, per
# worker and expert), this many: its clustered sample's bracket is wider where rows of a matrix
# differ in scale.
_MAX_BAND_BUCKETS = 4
MODEL_MAX_BAND_BUCKETS = 16
# A bracket the sample says holds at most half this many values is collected instead (any
# width): its values' bit patterns are kept, and the k-th found among them. Also the most values
# a collecting pass keeps (per worker thread in the compiled loops): 1 MiB of int32 each.
COLLECT_MAX = 1 << 18


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
      them) or histograms them (a band of at most ``_MAX_BAND_BUCKETS`` buckets). If the k-th
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
        # there were more than COLLECT_MAX)
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
        for part in chunks(flat.numel(), HISTOGRAM_CHUNK):
            self.observe_(flat[part].to(torch.float32, copy=True))

    def observe_(self, x: torch.Tensor) -> None:
        """``observe`` for a float32 scratch buffer that may be overwritten."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            return self.observe(x)
        self.add(self.histogram_(x), x.numel() * self.stride)

    def pass_bins(self) -> tuple[int | None, int, bool] | None:
        """This pass's bins as (low, width, collect), for a counting loop outside torch
        (:mod:`mergelab.merge.kernels`): ``low`` None counts the top 16 bits of |x| into
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
                if self._n_collected > COLLECT_MAX:  # too many to keep: the exact passes
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
            self._finish(_bits_to_float((self._bucket << 16) | low))
        elif self._mode == "collect":
            above = int(self._ends[1])
            found = self._collected
            if found is not None and above < self._k <= above + self._n_collected:
                self._finish(_bits_to_float(_kth_largest_bits(found, self._k - above)))
            else:  # the sample misled us, or the band held too many values: two exact passes
                self._switch("high", _HIGH_BUCKETS)
        elif self._mode == "band":
            above = int(self._counts[-1])
            inside = self._counts[1:-1]
            if above < self._k <= above + int(inside.sum()):
                offset, _ = _locate(inside, self._k - above)
                self._finish(_bits_to_float((self._bucket << 16) + offset))
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
        self, low: int, high: int, sampled_inside: int, m: int, widest: int = _MAX_BAND_BUCKETS
    ) -> None:
        """The next pass for a band of top-16-bit buckets ``low`` .. ``high`` that the sample (``m``
        values, ``sampled_inside`` of them in the band) says holds the k-th largest: collect its
        values if few, else histogram it if at most ``widest`` buckets, else the two exact
        passes."""
        self._bucket, self._width = low, (high - low + 1) << 16
        if sampled_inside * (self.count / m) <= COLLECT_MAX // 2:
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
        δ is MODEL_SAMPLE_MARGIN standard errors of the sampled fraction at or above the sample's
        q-quantile t, estimated over the clusters (a ratio estimator: Σ_c (a_c − p n_c)², a_c of
        the n_c values of cluster c at or above t, p their total share), plus
        MODEL_SAMPLE_MARGIN / m; it allows for values of a cluster being alike, which a bracket
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
        delta = MODEL_SAMPLE_MARGIN * (se + 1 / m)
        top, bottom = math.floor((q - delta) * m), math.ceil((q + delta) * m)
        if top < 1 or bottom > m:
            self._switch("high", _HIGH_BUCKETS)
            return
        high = _kth_largest_bits([values], top) >> 16
        low = _kth_largest_bits([values], bottom) >> 16
        buckets = values >> 16
        inside = int(((buckets >= low) & (buckets <= high)).sum())
        self._choose_band(low, high, inside, m, MODEL_MAX_BAND_BUCKETS)


def sample_stride(numel: int) -> int:
    """The stride of a tensor's sampled first pass for ``numel`` values (1: no sampling):
    :data:`SAMPLE_STRIDE`, doubled while the sample keeps :data:`SAMPLE_VALUES` values, up to
    :data:`SAMPLE_STRIDE_MAX`."""
    if numel < SAMPLE_MIN_NUMEL:
        return 1
    stride = SAMPLE_STRIDE
    while stride < SAMPLE_STRIDE_MAX and numel // (2 * stride) >= SAMPLE_VALUES:
        stride *= 2
    return stride


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


def magnitude_threshold(x: torch.Tensor, density: float) -> float:
    """|x| threshold keeping the top ``kept_count(density, x.numel())`` entries (0.0 keeps all)."""
    if density >= 1:
        return 0.0
    return kth_largest_abs(x, kept_count(density, x.numel()))


def _find_many(
    numel: int,
    ranks: list[list[int]],
    histograms: Callable[[list[KthLargestAbs], list[int]], Callable[[slice], list]],
) -> list[list[float]]:
    """Drive :class:`KthLargestAbs` finders over one tensor: for group g and every k in
    ``ranks[g]``; ``histograms(finders)`` returns the per-chunk counting function of group
    members ``finders`` (group index known to it by position). The groups share their first
    pass (the k only matters after it)."""
    stride = sample_stride(numel)
    groups = [[KthLargestAbs(stride) for _ in ks] for ks in ranks]
    firsts = [g[0] for g in groups if g]
    order = [i for i, g in enumerate(groups) if g]
    size = histogram_chunk(numel)

    def run(active: list[tuple[int, KthLargestAbs]]) -> None:
        count = histograms_for(active)
        finders = [f for _, f in active]
        _add_chunk_counts(for_chunks(numel, count, size), numel, size, finders)
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
    period = SAMPLE_RUN * stride
    full = x.numel() // period * period
    runs = x[:full].view(-1, stride, SAMPLE_RUN)
    periods = torch.arange(runs.shape[0])
    head = runs[periods, run_offsets(periods, stride)].reshape(-1)
    tail = x[full:][:SAMPLE_RUN]
    return torch.cat([head, tail]) if tail.numel() else head


def run_offsets(periods: torch.Tensor, stride: int) -> torch.Tensor:
    """Which of its ``stride`` runs a sampled pass reads from each (complete) period, given the
    periods' indices (counted from the chunk's start): a multiplicative hash of the index. A
    fixed run (the first of every period) read the same columns of every row of a weight
    matrix: where columns differ in scale, that sample misplaced the band of the k-th largest
    (more than half the time on synthetic matrices with log-normal column scales), and the
    exact passes had to follow; with hashed runs none did (``docs/merge_performance.md``)."""
    return (periods * kernels.RUN_HASH >> 16) % stride


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
    if (dtype or base.dtype) == torch.float32 and _in_one_call(base, experts):
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
    return on_worker or base.numel() < ONE_CALL_MAX or chunk_workers() is None


def _one_call_kth(
    base: torch.Tensor, experts: list[torch.Tensor], ranks: list[list[int]]
) -> list[list[float]]:
    """:func:`kernels.tau_kth` for ranks as :class:`KthLargestAbs` clips them (k ≤ 0:
    ``inf``; k > numel: the smallest)."""
    numel = base.numel()
    wanted = [[min(k, numel) for k in ks if k > 0] for ks in ranks]
    found = [iter(bits) for bits in kernels.tau_kth(base, experts, wanted)[0]]
    return [
        [_bits_to_float(next(bits)) if k > 0 else math.inf for k in ks]
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
        self._budget, self._size = MODEL_SAMPLE_CLUSTERS, MODEL_SAMPLE_CLUSTER
        self._period, self._run = MODEL_SAMPLE_PERIOD, MODEL_SAMPLE_RUN
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
        return -(-numel // MODEL_SAMPLE_CLUSTER)

    def _entries(self, picked: np.ndarray, numel: int) -> tuple[torch.Tensor, np.ndarray]:
        """The entries read of clusters ``picked`` of a tensor of ``numel``: their indices,
        ``[clusters, size / period · run]`` (those past the end repeat its last entry), and
        where they are past the end."""
        per = self._size // self._period
        periods = (picked[:, None] * per + np.arange(per)).astype(np.int64)
        offsets = run_offsets(torch.from_numpy(periods), self._period // self._run).numpy()
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
        size = histogram_chunk(numel)
        started = start_chunks(
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
    for part, counts in zip(chunks(numel, size), counted):
        for finder, c in zip(finders, counts):
            finder.add(c, part.stop - part.start)


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
        dare_keep_block(seed, expert, first + i, part.stop - part.start, density)
        for i, part in enumerate(chunks(numel, DARE_BLOCK))
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
        before = abs_sum(tau)
        tau.mul_(keep)
        after = abs_sum(tau)
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


def _weighted_rows_sum(
    stack: torch.Tensor, weights: list[float] | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_i w_i stack_i over the first axis (a plain sum when there are no weights or all are 1),
    into ``out`` when given."""
    if weights is None or all(w == 1 for w in weights):
        if stack.shape[0] == 1:
            return stack[0].clone() if out is None else out.copy_(stack[0])
        total = torch.add(stack[0], stack[1], out=out)  # row by row: faster than sum(0)
        for row in stack[2:]:
            total.add_(row)
        return total
    # row by row rather than tensordot: a matrix product would start BLAS threads inside the
    # chunk workers of for_chunks
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
    divisor = _weighted_rows_sum(
        agrees, weights, scratch("divisor", merged.numel(), merged.dtype, merged.device)
    ).view(merged.shape)
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
