"""How the accelerator's threshold passes sample and chunk their inputs: constants shared with
the compiled loops (``_loops.c`` is built with the same values; :mod:`.kernels` checks them).

The sampled passes only decide how many exact passes a k-th largest |τ| takes; the value found
is exact either way (:class:`mergelab.merge.accelerator.thresholds.KthLargestAbs`).
"""

from __future__ import annotations

import torch

from .chunks import CHUNK

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


# Which run of each period a sampled histogram pass reads (run_offsets):
# period p's ((p · RUN_HASH) >> 16) mod stride, a multiplicative hash (Knuth's constant)
RUN_HASH = 2654435761

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
MAX_BAND_BUCKETS = 4
MODEL_MAX_BAND_BUCKETS = 16
# A bracket the sample says holds at most half this many values is collected instead (any
# width): its values' bit patterns are kept, and the k-th found among them. Also the most values
# a collecting pass keeps (per worker thread in the compiled loops): 1 MiB of int32 each.
COLLECT_MAX = 1 << 18


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


def run_offsets(periods: torch.Tensor, stride: int) -> torch.Tensor:
    """Which of its ``stride`` runs a sampled pass reads from each (complete) period, given the
    periods' indices (counted from the chunk's start): a multiplicative hash of the index. A
    fixed run (the first of every period) read the same columns of every row of a weight
    matrix: where columns differ in scale, that sample misplaced the band of the k-th largest
    (more than half the time on synthetic matrices with log-normal column scales), and the
    exact passes had to follow; with hashed runs none did (``docs/merge_performance.md``)."""
    return (periods * RUN_HASH >> 16) % stride
