"""Per-tensor thresholds found in the merge's own read of the inputs.

A per-tensor magnitude trim (TIES with ``trim_scope="tensor"``, breadcrumbs) needs each
expert's k-th largest |τ| before it can merge. Found alone (:func:`ops.tau_kth_largest_abs`),
that is a sampled pass over a few of the entries, which picks a narrow band of |τ| that holds the
k-th largest with overwhelming probability, then one full pass over the inputs that counts the
entries above the band and keeps the bit patterns inside it; then the merge reads the inputs
again. Here that full pass is the merge itself:

1. the sampled pass, as before, gives each wanted rank its band (``KthLargestAbs.band``);
2. a second pass over the sampled entries guesses each threshold inside its band; the merge runs
   with those guesses (any value in the band would do; the nearer, the less to merge again) and,
   tile by tile while the tile is in cache, counts the entries above each band and
   writes the position and |τ| bit pattern of every entry inside it (``_loops.merge_chunk_banded``);
3. the exact k-th largest comes from those counts and patterns, the same value the separate
   pass finds (``KthLargestAbs.finish_band``);
4. every position whose pattern lies between the guess and the exact threshold, the only ones a threshold between the two can treat differently, is merged again with the
   exact thresholds (``_loops.merge_at``): the same loop on the same values, so the output is
   bit for bit the one of a merge with exact thresholds from the start.

Where the sample misled (the k-th largest outside its band) or a band held more entries than
room was made for (twice what the sample expected), the remaining exact passes run and the
whole tensor is merged again: slower, never different. Only for bfloat16 inputs on the compiled
loops (the band passes read them in place), tensors large enough to be sampled, and an output
in bfloat16 or float32; anything else takes the separate passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import kernels, ops

# Room for each band's entries: this many times what the sample expects, plus SLACK.
ROOM = 2
SLACK = 1 << 12

# (params, values) -> None: sets the plan's per-expert thresholds from values[i][j], the j-th
# wanted rank's k-th largest |τ_i|.
Fill = Callable[[np.ndarray, list[list[float]]], None]


def applies(base: torch.Tensor, experts: Sequence[torch.Tensor], out: torch.Tensor) -> bool:
    """Whether :func:`merge` takes one read for this tensor (else the separate passes)."""
    inputs = [base, *experts]
    return (
        kernels.active()
        and kernels.usable(*inputs, out)
        and all(x.dtype == torch.bfloat16 for x in inputs)
        and out.dtype in (torch.bfloat16, torch.float32)
        and ops.sample_stride(base.numel()) > 1
        and base.numel() < 2**31
    )


def merge(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    ranks: list[list[int]],
    out: torch.Tensor,
    plan: tuple[np.ndarray, np.ndarray, np.ndarray],
    fill: Fill,
    upper: list[list[bool]] | None = None,
) -> tuple[list[list[float]], int]:
    """Merge ``base`` and ``experts`` into ``out`` with ``plan`` (merge_chunk's params, scalars,
    flags; no DARE) whose thresholds ``fill`` sets from the k-th largest |τ_i| for every k in
    ``ranks[i]``, found in the merge's read (see the module). ``upper[i][j]``: whether the value
    of ``ranks[i][j]`` is the largest |τ_i| kept (breadcrumbs' top edge), else the smallest
    (default). Returns those values and the loops' NaN/Inf flags (``kernels.FOUND_IN_*``).
    Only where :func:`applies`."""
    numel = base.numel()
    histograms = ops._tau_histograms(base, list(experts), torch.float32)  # noqa: SLF001
    groups = ops.first_passes(numel, ranks, histograms)
    bands = [
        (i, finder, finder.band())
        for i, group in enumerate(groups)
        for finder in group
        if finder.wants_pass()
    ]
    tops = [upper is not None and upper[i][groups[i].index(finder)] for i, finder, _ in bands]
    params, scalars, flags = plan
    if any(band is None for _, _, band in bands):  # a pass the merge cannot count: no band
        return _separately(base, experts, groups, histograms, out, plan, fill)
    if not bands:  # every value known from the first pass (k = 0)
        return _merge_whole(base, experts, groups, out, plan, fill)
    guesses = _guesses(base, experts, bands)
    first = [[f.value() if not f.wants_pass() else 0.0 for f in group] for group in groups]
    for (i, finder, _), guess in zip(bands, guesses):
        first[i][groups[i].index(finder)] = ops._bits_to_float(guess)  # noqa: SLF001
    tentative = params.copy()
    fill(tentative, first)
    counts = _Counts(bands, guesses, tops)
    merger = _BandedMerger(base, experts, out, tentative, scalars, flags, counts)
    found = 0
    for f in ops.for_chunks(numel, merger):
        found |= f
    if not counts.finish():
        return _separately(base, experts, groups, histograms, out, plan, fill)
    values = [[f.value() for f in group] for group in groups]
    exact = params.copy()
    fill(exact, values)
    again = counts.between()
    if len(again):
        found |= int(
            kernels.loops().merge_at(
                np.array(merger.inputs.addresses(slice(0, numel)), dtype=np.int64),
                numel,
                merger.out.data_ptr(),
                merger.out.dtype == torch.bfloat16,
                exact,
                scalars,
                flags,
                again,
            )
        )
    if found & kernels.FOUND_IN_RESULT:  # it may have been a tentative result, since merged again
        found &= ~kernels.FOUND_IN_RESULT
        found |= 0 if ops.all_finite(out) else kernels.FOUND_IN_RESULT
    return values, found


def _guesses(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    bands: list[tuple[int, ops.KthLargestAbs, tuple[int, int]]],
) -> list[int]:
    """Per band, the sample's guess at the bit pattern of the k-th largest: a second pass over
    the first pass's sampled entries keeps their patterns inside the band, and the guess is the
    one at the k-th largest's rank scaled to the sample. The merge uses it as the threshold
    before the exact one is known: the nearer, the fewer entries to merge again."""
    numel = base.numel()
    stride = ops.sample_stride(numel)
    counter = kernels.TauHistograms(base, experts).pass_counts(
        [(i, stride, (low, highest - low, True)) for i, _, (low, highest) in bands]
    )
    ops.for_chunks(numel, counter, ops.histogram_chunk(numel))
    guesses = []
    for (_, finder, (low, _)), (ends, values) in zip(bands, counter.totals()):
        if values is None or not len(values):  # nothing sampled inside: the band's first pattern
            guesses.append(low + 1)
            continue
        sampled = int(ends.sum()) + len(values)
        rank = round(finder.wanted * sampled / finder.count) - int(ends[1])
        rank = min(max(rank, 1), len(values))
        guesses.append(ops._kth_largest_bits([values], rank))  # noqa: SLF001
    return guesses


_held = threading.local()  # each thread's arrays for _Counts, kept from tensor to tensor


def _rows(name: str, n: int, room: int, dtype: type) -> np.ndarray:
    """An uninitialised [n, room] array of this thread's, reused by the next tensor it merges
    (fresh ones of megabytes came as new zeroed pages from the kernel every tensor)."""
    held = getattr(_held, name, None)
    if held is None or held.size < n * room:
        held = np.empty(n * room, dtype=dtype)
        setattr(_held, name, held)
    return held[: n * room].reshape(n, room)


class _Counts:
    """What the banded merge counts for each band, in arrays every chunk adds to."""

    def __init__(
        self,
        bands: list[tuple[int, ops.KthLargestAbs, tuple[int, int]]],
        guesses: list[int],
        tops: list[bool],
    ) -> None:
        self.finders = [finder for _, finder, _ in bands]
        self.guesses, self.tops = guesses, tops
        self.experts = np.array([i for i, _, _ in bands], dtype=np.int64)
        self.lows = np.array([band[0] for _, _, band in bands], dtype=np.int64)
        self.highs = np.array([band[1] for _, _, band in bands], dtype=np.int64)
        room = max(int(ROOM * f.expected_inside) + SLACK for f in self.finders)
        self.above = np.zeros(len(bands), dtype=np.int64)
        self.filled = np.zeros(len(bands), dtype=np.int64)
        self.positions = _rows("positions", len(bands), room, np.int64)
        self.bits = _rows("bits", len(bands), room, np.int32)

    def finish(self) -> bool:
        """End every band's pass from the counts: whether every k-th largest was found."""
        if (self.filled > self.positions.shape[1]).any():
            return False
        found = True
        for p, finder in enumerate(self.finders):
            found &= finder.finish_band(int(self.above[p]), self.bits[p, : self.filled[p]])
        return found

    def between(self) -> np.ndarray:
        """The positions of the entries the guessed threshold treated otherwise than the exact
        one: with the smaller pattern s and the larger l of the two, s <= pattern < l where the
        smallest kept is guessed (kept: pattern >= threshold), s < pattern <= l where the largest
        (kept: pattern <= threshold). A position may come twice: merged twice, the same bits."""
        parts = []
        for p, finder in enumerate(self.finders):
            bits = self.bits[p, : self.filled[p]]
            exact = int(np.float32(finder.value()).view(np.int32))
            low, high = sorted((exact, self.guesses[p]))
            if self.tops[p]:
                moved = (bits > low) & (bits <= high)
            else:
                moved = (bits >= low) & (bits < high)
            parts.append(self.positions[p, : self.filled[p]][moved])
        return np.concatenate(parts)


class _BandedMerger(kernels.ChunkMerger):
    """``kernels.ChunkMerger`` for ``_loops.merge_chunk_banded``: each chunk also counts the
    bands of :class:`_Counts` (shared by the chunks of the tensor: the loop adds atomically)."""

    def __init__(
        self,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        out: torch.Tensor,
        params: np.ndarray,
        scalars: np.ndarray,
        flags: np.ndarray,
        counts: _Counts,
    ) -> None:
        super().__init__(base, experts, out, params, scalars, flags)
        self.counts = counts

    def __call__(self, part: slice) -> int:
        c = self.counts
        result = self.out[part]
        return int(
            kernels.loops().merge_chunk_banded(
                np.array(self.inputs.addresses(part), dtype=np.int64),
                part.stop - part.start,
                result.data_ptr(),
                result.dtype == torch.bfloat16,
                self.params,
                self.scalars,
                self.flags,
                part.start,
                c.experts,
                c.lows,
                c.highs,
                c.above,
                c.filled,
                c.positions,
                c.bits,
            )
        )


def _separately(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    groups: list[list[ops.KthLargestAbs]],
    histograms: Any,
    out: torch.Tensor,
    plan: tuple[np.ndarray, np.ndarray, np.ndarray],
    fill: Fill,
) -> tuple[list[list[float]], int]:
    """The finders' remaining passes on their own, then the merge with what they found."""
    ops.later_passes(base.numel(), groups, histograms)
    return _merge_whole(base, experts, groups, out, plan, fill)


def _merge_whole(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    groups: list[list[ops.KthLargestAbs]],
    out: torch.Tensor,
    plan: tuple[np.ndarray, np.ndarray, np.ndarray],
    fill: Fill,
) -> tuple[list[list[float]], int]:
    values = [[f.value() for f in group] for group in groups]
    params, scalars, flags = plan
    exact = params.copy()
    fill(exact, values)
    merger = kernels.ChunkMerger(base, experts, out, exact, scalars, flags)
    found = 0
    for f in ops.for_chunks(base.numel(), merger):
        found |= f
    return values, found
