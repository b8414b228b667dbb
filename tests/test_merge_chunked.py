"""The fast paths of the merge methods give the same bits as the plain ones.

* chunked work on several worker threads == on one (``chunks.for_chunks``);
* inputs handed over in their stored dtype (``ctx.dtype``, ``ctx.out``: the streaming engine's
  path) == inputs cast to the compute dtype first (the in-memory engine's);
* the sampled first pass of the exact k-th largest |x| == a sort, also when the sample misleads
  it, with heavy ties, and across tensors (whole-model thresholds);
* DARE's block-wise generator: reproducible, independent across experts, blocks and seeds, and
  keeping each entry with probability ``density``;
* the direct-I/O shard writer writes the same bytes as ordinary writes;
* a checkpoint whose tensors span several chunks streams to the same bits as the in-memory merge.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mergelab.merge import TensorContext, get_merge_method, merge_state_dicts
from mergelab.merge.accelerator import chunks, kernels, sampling, thresholds
from mergelab.merge.accelerator.io import (
    DIRECT_ALIGN,
    HUGE_PAGE_MIN_BYTES,
    DirectIO,
    DirectStream,
    huge_page_empty,
)
from mergelab.merge.checkpoint import (
    BufferPool,
    CheckpointFolder,
    FileStream,
    PlainIO,
    merge_checkpoints,
)
from mergelab.merge.methods import steps

CHUNKED = {
    "linear": {"weight": [0.3, 0.7]},
    "task_arithmetic": {"weight": [0.5, 1.0], "lambda_": 0.8},
    "ties": {"density": 0.3, "trim_scope": "tensor"},
    "ties-count": {"density": [0.3, 0.5], "trim_scope": "tensor", "majority_sign": "count"},
    "ties-mergekit": {
        "density": 0.2,
        "weight": [1.0, 0.5],
        "trim_scope": "tensor",
        "weighted_sign": True,
        "divide_by": "weight_sum",
    },
    "dare_linear": {"density": 0.3},
    "dare_ties": {"density": [0.3, 0.6], "weight": [1.0, 0.7]},
    "dare_ties-l1": {"density": 0.3, "rescale": "l1"},
    "breadcrumbs": {"density": 0.8, "gamma": 0.05},
}


def inputs(numel: int, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    base = (0.02 * torch.randn(numel, generator=g)).to(dtype)
    experts = [(base.float() + 0.002 * torch.randn(numel, generator=g)).to(dtype) for _ in "ab"]
    return base.view(-1, 64), [e.view(-1, 64) for e in experts]


def run(variant: str, base, experts, ctx: TensorContext):
    method = get_merge_method(variant.split("-")[0])
    return method(None if variant == "linear" else base, experts, ctx=ctx, **CHUNKED[variant])


@pytest.fixture
def threads():
    """Set torch's thread count for a test (the chunk workers follow it); restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# 3 chunks and a bit: several workers, a partial last chunk
NUMEL = 3 * chunks.CHUNK + 64 * 37


@pytest.mark.parametrize("variant", sorted(CHUNKED))
def test_workers_do_not_change_a_bit(variant, threads):
    base, experts = inputs(NUMEL)
    base, experts = base.float(), [e.float() for e in experts]
    results = []
    for n in (1, 2, 3):
        threads(n)
        results.append(run(variant, base, experts, TensorContext("w", 3)))
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("variant", sorted(CHUNKED))
def test_stored_dtype_inputs_and_output_buffer_give_the_cast_result(variant):
    base, experts = inputs(NUMEL, seed=1)
    expected = run(variant, base.float(), [e.float() for e in experts], TensorContext("w", 5))
    out = torch.empty(base.shape, dtype=torch.bfloat16)
    ctx = TensorContext("w", 5, dtype=torch.float32, out=out)
    got = run(variant, base, experts, ctx)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, expected.to(torch.bfloat16))


def test_chunk_results_come_back_in_order(threads):
    threads(2)
    parts = chunks.for_chunks(10 * chunks.CHUNK + 5, lambda part: (part.start, part.stop))
    assert parts == [(p.start, p.stop) for p in chunks.chunks(10 * chunks.CHUNK + 5)]


# --- exact k-th largest with a sampled first pass ------------------------------------------------


def kth_by_sort(x: torch.Tensor, k: int) -> float:
    return float(x.abs().float().reshape(-1).sort(descending=True).values[k - 1])


@pytest.mark.parametrize("kind", ["continuous", "ties", "bf16-differences"])
def test_sampled_selection_is_exact(kind):
    n = sampling.SAMPLE_MIN_NUMEL + 12345  # large enough to be sampled
    g = torch.Generator().manual_seed(7)
    if kind == "continuous":
        x = torch.randn(n, generator=g)
    elif kind == "ties":  # few distinct values: the k-th is tied with thousands
        x = torch.randint(-40, 40, (n,), generator=g).float() / 8
    else:  # τ of bf16 weights: discrete, like real checkpoints
        b = (0.02 * torch.randn(n, generator=g)).bfloat16()
        x = (b.float() + 0.002 * torch.randn(n, generator=g)).bfloat16().float() - b.float()
    ks = [1, 7, n // 5, n // 2, n - 3, n]
    assert thresholds.kth_largest_abs_many(x, ks) == [kth_by_sort(x, k) for k in ks]


def test_a_misleading_sample_falls_back_to_exact_passes(monkeypatch):
    n = sampling.SAMPLE_MIN_NUMEL
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    # every sampled entry (stride 8) tiny: the sample puts the band far too low
    x[:: sampling.SAMPLE_STRIDE] *= 1e-6
    k = n // 5
    assert thresholds.kth_largest_abs(x, k) == kth_by_sort(x, k)
    monkeypatch.setattr(sampling, "MAX_BAND_BUCKETS", 0)  # no band at all: the two exact passes
    assert thresholds.kth_largest_abs(x, k) == kth_by_sort(x, k)


def count_passes(monkeypatch) -> list[int]:
    """Record the passes a tensor's threshold search makes (one entry per pass over a tensor):
    ``thresholds._find_many``'s, or those one compiled call reports (``kernels.tau_kth``)."""
    passes: list[int] = []
    original, compiled = chunks.for_chunks, kernels.tau_kth

    def counting(numel, fn, size=None):
        passes.append(numel)
        return original(numel, fn, size)

    def counting_compiled(base, experts, ranks):
        found, made = compiled(base, experts, ranks)
        passes.extend([base.numel()] * made)
        return found, made

    monkeypatch.setattr(chunks, "for_chunks", counting)
    monkeypatch.setattr(kernels, "tau_kth", counting_compiled)
    return passes


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("structure", ["column scales", "row scales", "low rank"])
def test_structured_task_vectors_take_two_passes(monkeypatch, compiled, structure):
    """Task vectors of weight matrices whose rows or columns differ in scale: the sampled pass
    (hashed runs, sampling.run_offsets) brackets the k-th largest, and the band is collected, also
    where it spans more buckets than a histogram may (density 0.9): two passes, exact."""
    monkeypatch.setattr(kernels, "enabled", compiled)
    g = torch.Generator().manual_seed(12)
    rows, cols = 1024, 2048
    tau = torch.randn(rows, cols, generator=g)
    if structure == "column scales":
        tau *= torch.exp(0.7 * torch.randn(1, cols, generator=g))
    elif structure == "row scales":
        tau *= torch.exp(torch.randn(rows, 1, generator=g))
    else:
        tau = 0.1 * tau + torch.randn(rows, 8, generator=g) @ torch.randn(8, cols, generator=g)
    base = 0.02 * torch.randn(rows, cols, generator=g)
    expert = base + 0.002 * tau
    flat = (expert - base).reshape(-1)
    n = flat.numel()
    ranks = [steps.kept_count(0.2, n), steps.kept_count(0.9, n)]
    passes = count_passes(monkeypatch)
    found = thresholds.tau_kth_largest_abs(base, [expert], [ranks], torch.float32)[0]
    assert found == [kth_by_sort(flat, k) for k in ranks]
    assert len(passes) == 2


def test_a_first_run_of_every_period_misleads_the_sample_on_column_scales(monkeypatch):
    """Why the runs are hashed: reading the same run of every period (the same columns of every
    row) on a matrix like the one above misplaces the band, and the exact passes follow (on the
    torch path, whose sample ``sampling.run_offsets`` places; the compiled loops place it the same
    way)."""
    monkeypatch.setattr(kernels, "enabled", False)
    g = torch.Generator().manual_seed(12)
    tau = torch.randn(1024, 1024, generator=g) * torch.exp(0.7 * torch.randn(1, 1024, generator=g))
    flat = tau.reshape(-1)
    ranks = [steps.kept_count(0.2, flat.numel())]
    for fixed, n_passes in ((False, 2), (True, 4)):
        if fixed:
            monkeypatch.setattr(sampling, "run_offsets", lambda periods, stride: periods * 0)
        passes = count_passes(monkeypatch)
        found = thresholds.tau_kth_largest_abs(torch.zeros_like(tau), [tau], [ranks], torch.float32)
        assert found == [[kth_by_sort(flat, ranks[0])]]
        assert len(passes) == n_passes


@pytest.mark.parametrize("compiled", [True, False])
def test_a_band_holding_more_values_than_it_may_keep_falls_back_to_exact_passes(
    monkeypatch, compiled
):
    """The sample sees normal values, but every entry it skips equals the k-th: the band holds
    far more than ``COLLECT_MAX`` values, none is kept past that, and the exact passes follow."""
    monkeypatch.setattr(kernels, "enabled", compiled)
    n = 2 * sampling.SAMPLE_MIN_NUMEL
    tau = torch.randn(n, generator=torch.Generator().manual_seed(5))
    sampled = torch.zeros(n, dtype=torch.bool)
    index = torch.arange(n)
    for part in chunks.chunks(n, sampling.histogram_chunk(n)):
        sampled[thresholds._sample_runs(index, part, sampling.sample_stride(n))] = True
    k = steps.kept_count(0.3, n)
    kth = kth_by_sort(tau[sampled], math.ceil(0.3 * int(sampled.sum())))
    tau[~sampled] = kth
    passes = count_passes(monkeypatch)
    found = thresholds.tau_kth_largest_abs(torch.zeros(n), [tau], [[k]], torch.float32)
    assert found == [[kth_by_sort(tau, k)]] == [[kth]]
    assert len(passes) == 4  # sampled, collecting (too many), the two exact passes


needs_loops = pytest.mark.skipif(not kernels.available(), reason="the compiled loops are not built")
needs_accelerator = pytest.mark.skipif(
    not kernels.active(),
    reason="tests the accelerator: built and not switched off (MERGELAB_ACCELERATOR=off)",
)


def bits_of(values: list[list[float]]) -> list[list[int]]:
    """Thresholds as float32 bit patterns (NaN equal to NaN)."""
    return [np.array(t, dtype=np.float32).view(np.int32).tolist() for t in values]


def one_call_inputs(n: int, dtype: torch.dtype, seed: int, odd: bool = False):
    """A base and three experts (τ ~ N(0, 0.002²) on a N(0, 0.02²) base) of ``n`` entries;
    ``odd``: NaN, Inf and −0.0 entries in the experts, and one expert equal to the base."""
    g = torch.Generator().manual_seed(seed)
    base = (0.02 * torch.randn(n, generator=g)).to(dtype)
    experts = [(base.float() + 0.002 * torch.randn(n, generator=g)).to(dtype) for _ in range(3)]
    if odd:
        experts[0][:: max(1, n // 7)] = float("nan")
        experts[0][1 :: max(1, n // 5)] = float("inf")
        experts[1][2 :: max(1, n // 3)] = -0.0
        experts[2] = base.clone()
    return base, experts


@needs_accelerator
@needs_loops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("odd", [False, True], ids=["normal", "nan-inf-zero"])
def test_one_compiled_call_finds_what_the_chunked_passes_find(monkeypatch, dtype, odd):
    """kernels.tau_kth (every pass of a tensor in one compiled call) against thresholds._find_many's
    chunked passes and a sort, on tensors collected whole (up to 65536 entries), searched by
    two radix passes (not sampled) and sampled, with ranks 1, numel, beyond numel, 0 and none:
    the same values, and on the sampled tensors the same passes."""
    for n in (
        1,
        999,
        65536,
        65537,
        sampling.SAMPLE_MIN_NUMEL - 1,
        3 * sampling.SAMPLE_MIN_NUMEL + 17,
    ):
        base, experts = one_call_inputs(n, dtype, seed=n, odd=odd)
        k = steps.kept_count(0.2, n)
        ranks = [[k, 1, n], [], [steps.kept_count(0.9, n), n + 5, 0, -1]]
        assert thresholds._in_one_call(base, experts)
        counted = count_passes(monkeypatch)
        found = thresholds.tau_kth_largest_abs(base, experts, ranks, torch.float32)
        one_call = len(counted)
        chunked = thresholds._find_many(
            n, ranks, thresholds._tau_histograms(base, experts, torch.float32)
        )
        assert bits_of(found) == bits_of(chunked)
        whole = n <= kernels.loops().TAU_KTH_WHOLE  # collected whole: one pass
        assert one_call == (1 if whole else len(counted) - one_call)
        if not odd:
            for e, ks, values in zip(experts, ranks, found):
                tau = e.float() - base.float()
                assert values == [kth_by_sort(tau, min(k, n)) if k > 0 else math.inf for k in ks]


@needs_loops
@pytest.mark.parametrize("collect_max, widest, passes", [(2, 16, 2), (2, 0, 3)])
def test_one_compiled_call_histograms_the_band_or_takes_two_exact_passes(
    collect_max, widest, passes
):
    """A band too full to collect is histogrammed (at most ``widest`` buckets: two passes in
    all), or the two exact radix passes follow the sample (three); exact either way."""
    n = sampling.SAMPLE_MIN_NUMEL * 2
    base, experts = one_call_inputs(n, torch.bfloat16, seed=8)
    ranks = [steps.kept_count(0.2, n), steps.kept_count(0.5, n)]
    out = np.zeros(2, dtype=np.int64)
    made = kernels.loops().tau_kth(
        np.array([base.data_ptr(), experts[1].data_ptr()], dtype=np.int64),
        True,
        n,
        sampling.sample_stride(n),
        sampling.SAMPLE_RUN,
        sampling.histogram_chunk(n),
        collect_max,
        widest,
        np.zeros(2, dtype=np.int64),
        np.array(ranks, dtype=np.int64),
        out,
    )
    tau = experts[1].float() - base.float()
    assert [steps.bits_to_float(b) for b in out.tolist()] == [kth_by_sort(tau, k) for k in ranks]
    assert made == passes


@needs_accelerator
@needs_loops
def test_a_large_tensor_on_the_calling_thread_takes_the_chunked_passes(monkeypatch):
    """From ONE_CALL_MAX entries, with worker threads and off them, the passes run chunked on
    every core; on a worker thread, or smaller, in one call."""
    base, experts = one_call_inputs(4096, torch.bfloat16, seed=2)
    monkeypatch.setattr(thresholds, "ONE_CALL_MAX", 4096)
    workers = chunks.chunk_workers()
    assert thresholds._in_one_call(base, experts) == (workers is None)
    monkeypatch.setattr(thresholds, "ONE_CALL_MAX", 4097)
    assert thresholds._in_one_call(base, experts)
    if workers is not None:
        monkeypatch.setattr(thresholds, "ONE_CALL_MAX", 4096)
        assert workers.submit(thresholds._in_one_call, base, experts).result()
    assert not thresholds._in_one_call(base.half(), [e.half() for e in experts])  # cast: chunked


def whole_model(sizes, seed, row=None, row_sigma=0.0):
    """Base and two experts' tensors of ``sizes``; with ``row``, τ's rows of ``row`` entries
    scaled by log-normal factors (σ = ``row_sigma``), so entries of one row are alike."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g) for s in sizes]
    experts = []
    for _ in range(2):
        taus = [torch.randn(s, generator=g) for s in sizes]
        if row is not None:
            taus = [
                (
                    t.view(-1, row) * torch.exp(row_sigma * torch.randn(s // row, 1, generator=g))
                ).reshape(-1)
                for t, s in zip(taus, sizes)
            ]
        experts.append([b + t for b, t in zip(base, taus)])
    return base, experts


def thresholds_and_passes(base, experts, densities):
    calls = []

    def make_iter():
        calls.append(1)
        return ((f"t{i}", b, [e[i] for e in experts]) for i, b in enumerate(base))

    return thresholds.global_magnitude_thresholds(make_iter, densities), len(calls)


def assert_kth_of_the_model(base, experts, densities, found):
    n = sum(b.numel() for b in base)
    for e, d, threshold in zip(experts, densities, found):
        flat = torch.cat([x - b for x, b in zip(e, base)])
        assert threshold == kth_by_sort(flat, steps.kept_count(d, n))


def small_clusters(monkeypatch, cluster, period, run, budget):
    """Patch the whole-model sample's clusters (entries, period, run, how many)."""
    for name, value in zip(
        [
            "MODEL_SAMPLE_CLUSTER",
            "MODEL_SAMPLE_PERIOD",
            "MODEL_SAMPLE_RUN",
            "MODEL_SAMPLE_CLUSTERS",
        ],
        [cluster, period, run, budget],
    ):
        monkeypatch.setattr(sampling, name, value)


def test_whole_model_thresholds_of_a_large_model_take_two_passes():
    base, experts = whole_model([chunks.CHUNK * 5, 1000, chunks.CHUNK * 3 + 17], seed=4)
    found, passes = thresholds_and_passes(base, experts, [0.2, 0.3])
    assert passes == 2  # the sample, then one exact pass over its band
    assert_kth_of_the_model(base, experts, [0.2, 0.3], found)


@pytest.mark.parametrize("seed", [5, 6])
@pytest.mark.parametrize("sigma", [0.0, 0.5, 1.5])
def test_whole_model_sample_brackets_the_kth_where_rows_differ(monkeypatch, seed, sigma):
    """Rows of 1024 entries scaled alike (log-normal, σ = ``sigma``), 64 of 128 clusters of 16
    rows sampled: the bracket, MODEL_SAMPLE_MARGIN standard errors counted over clusters, holds
    the k-th largest; one exact pass follows where it is narrow (rows of one scale), else the
    two radix passes. Where rows differ, that error is at least twice the one counted over
    values (as if each were drawn alone), whose bracket would be too narrow."""
    small_clusters(monkeypatch, 16384, 1024, 32, 64)
    row = 1024
    base, experts = whole_model([row * 600, row * 400, row * 1048], seed, row, row_sigma=sigma)
    found, passes = thresholds_and_passes(base, experts, [0.2, 0.35])
    assert_kth_of_the_model(base, experts, [0.2, 0.35], found)
    assert passes == 2 if sigma == 0 else passes in (2, 3)
    sample = thresholds.ClusterSample(1)
    for i, b in enumerate(base):
        sample.add(b, [experts[0][i]], torch.float32)
    rows = sample.rows(0)
    assert rows.shape == (64, 512)
    finder = thresholds.KthLargestAbs()
    n = sum(b.numel() for b in base)
    finder.from_sample(n, steps.kept_count(0.2, n), rows)
    kth_bits = np.float32(found[0]).view(np.int32) >> 16
    low, high = finder._bucket, finder._bucket + (finder._width >> 16) - 1  # noqa: SLF001
    assert low <= kth_bits <= high
    above = (rows >= np.quantile(rows, 0.8)).sum(axis=1)
    p, m, c = above.sum() / rows.size, rows.size, len(rows)
    over_clusters = math.sqrt(((above - p * rows.shape[1]) ** 2).sum() * c / (c - 1)) / m
    over_values = math.sqrt(p * (1 - p) / m)
    assert over_clusters > (2 if sigma else 0.5) * over_values


def test_cluster_sample_is_the_clusters_of_smallest_hash_however_it_was_cut(monkeypatch):
    small_clusters(monkeypatch, 64, 32, 8, 16)
    base, experts = whole_model([64 * 200, 64 * 50 + 3, 64 * 400, 10], seed=8)
    clusters = sum(-(-b.numel() // 64) for b in base)
    rows = []
    for told in (None, clusters):
        sample = thresholds.ClusterSample(2, told)
        for i, b in enumerate(base):
            sample.add(b, [e[i] for e in experts], torch.float32)
        assert sample.count == sum(b.numel() for b in base)
        rows.append([sample.rows(j) for j in range(2)])
    for a, b in zip(*rows):
        assert a.shape == (16, 16) and np.array_equal(a, b)


@needs_accelerator
def test_checkpoint_whole_model_sample_reads_unpopulated_maps(wide_ckpts, tmp_path, monkeypatch):
    """The engine's sampled pass maps the inputs without populating them (it reads a few pages),
    the exact pass and the merge populate them, and the result is the in-memory merge's bits."""
    small_clusters(monkeypatch, 256, 64, 16, 4)
    (base, e0, e1), (base_sd, sd0, sd1) = wide_ckpts
    params = {"density": 0.3, "trim_scope": "model"}
    expected = merge_state_dicts("ties", base_sd, [sd0, sd1], params=params, seed=2)
    populated = []
    original = CheckpointFolder.map

    def recording(self, name, populate=True):
        populated.append(populate)
        return original(self, name, populate)

    monkeypatch.setattr(CheckpointFolder, "map", recording)
    out = merge_checkpoints(
        "ties", base, [e0, e1], output=tmp_path / "out", params=params, seed=2, progress=False
    )
    assert False in populated and True in populated
    with CheckpointFolder(out) as folder:
        for name, tensor in expected.items():
            assert torch.equal(folder.read(name), tensor), name


# --- DARE's generator -----------------------------------------------------------------------


def test_dare_masks_are_reproducible_and_differ_by_seed_expert_and_block():
    n = 2 * steps.DARE_BLOCK
    a = steps.dare_keep_mask((n,), 0.3, seed=11, expert=0)
    assert torch.equal(a, steps.dare_keep_mask((n,), 0.3, seed=11, expert=0))
    for other in (steps.dare_keep_mask((n,), 0.3, 12, 0), steps.dare_keep_mask((n,), 0.3, 11, 1)):
        assert not torch.equal(a, other)
    first, second = a[: steps.DARE_BLOCK], a[steps.DARE_BLOCK :]
    assert not torch.equal(first, second)  # blocks have streams of their own
    # a block drawn alone is the same block of the whole mask (the chunked methods draw so)
    alone = steps.dare_keep_range(11, 0, steps.DARE_BLOCK, steps.DARE_BLOCK, 0.3) > 0
    assert torch.equal(alone, second)


@pytest.mark.parametrize("density", [0.01, 0.1, 0.5, 0.9])
def test_dare_masks_keep_each_entry_independently_with_probability_density(density):
    n = 4 * steps.DARE_BLOCK
    masks = [steps.dare_keep_mask((n,), density, seed=5, expert=i).float() for i in range(2)]
    sd = math.sqrt(density * (1 - density) / n)
    for mask in masks:
        assert abs(mask.mean().item() - density) < 5 * sd
        # neighbours independent: P(keep j and keep j+1) = density²
        both = (mask[1:] * mask[:-1]).mean().item()
        assert abs(both - density**2) < 5 * math.sqrt(density**2 * (1 - density**2) / n)
        # every block on its own keeps about density too
        for block in mask.split(steps.DARE_BLOCK):
            assert abs(block.mean().item() - density) < 6 * sd * 2
    # the two experts' masks are independent
    together = (masks[0] * masks[1]).mean().item()
    assert abs(together - density**2) < 5 * math.sqrt(density**2 * (1 - density**2) / n)


def test_dare_keep_probability_resolution():
    """Keep probabilities are density rounded to a multiple of 2⁻²³: exact for dyadic ones."""
    n = steps.DARE_BLOCK
    u = steps.dare_keep_range(9, 0, 0, n, 0.5)
    assert set(u.unique().tolist()) == {0.0, 1.0}
    assert steps.dare_keep_range(9, 0, 0, n, 1e-9).sum() == 0  # rounds to 0: nothing kept
    assert steps.dare_keep_range(9, 0, 0, n, 1 - 1e-9).sum() == n  # rounds to 1: all kept


# --- writing and reading ------------------------------------------------------------------------


def test_direct_writes_give_the_same_bytes_as_ordinary_writes(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    pieces = [b"header-" * 3]
    pieces += [
        torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (5, 9000, 70001)
    ]
    pieces.append(torch.randint(0, 256, (3 * 4096,), generator=g, dtype=torch.uint8))
    expected = b"".join(p if isinstance(p, bytes) else p.numpy().tobytes() for p in pieces)

    def write(path: Path, staging: int) -> bytes:
        stream = DirectStream(path, staging=staging)
        for piece in pieces:
            stream.write(piece)
        stream.close()
        return path.read_bytes()

    assert write(tmp_path / "a.bin", staging=8192) == expected  # many staging flushes
    assert write(tmp_path / "b.bin", staging=1 << 20) == expected
    plain = FileStream(tmp_path / "plain.bin")  # the engine's own, without the accelerator
    for piece in pieces:
        plain.write(piece)
    plain.close()
    assert (tmp_path / "plain.bin").read_bytes() == expected
    monkeypatch.delattr(os, "O_DIRECT", raising=False)  # where the OS has no direct I/O
    assert write(tmp_path / "c.bin", staging=8192) == expected


def test_plain_writes_are_complete_when_a_call_writes_less(tmp_path, monkeypatch):
    """One write() call may write only part (at most ~2 GiB on Linux): both streams go on."""
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, memoryview(data)[:1000]))
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (4500,), generator=g, dtype=torch.uint8)
    plain = FileStream(tmp_path / "plain.bin")
    plain.write(b"head")
    plain.write(data)
    plain.close()
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    fallback = DirectStream(tmp_path / "fallback.bin")
    fallback.write(data)
    fallback.close()
    assert (tmp_path / "plain.bin").read_bytes() == b"head" + data.numpy().tobytes()
    assert (tmp_path / "fallback.bin").read_bytes() == data.numpy().tobytes()


def test_the_plain_pool_places_nothing():
    """Without the accelerator the pool's buffers are ordinary tensors, a phase is ignored,
    and a slot's buffer is reused."""
    pool = BufferPool(PlainIO)
    first = pool.take("out", (5000,), torch.float32, phase=8)
    again = pool.take("out", (100,), torch.float32, phase=12)
    assert first.data_ptr() == again.data_ptr() and again.shape == (100,)


def _vma_fields(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the map holding ``address`` (None: no smaps here)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    found, inside = None, False
    for line in lines:
        head = line.split()[0]
        if not head.endswith(":"):  # a map's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
            if inside:
                found = {}
        elif inside:
            key, _, value = line.partition(":")
            found[key] = value.strip()
    return found


def test_large_pool_buffers_are_advised_into_huge_pages():
    """Pool buffers of 2 MiB and more live in their own private map that the kernel may back
    with transparent huge pages (THPeligible in smaps where THP is "madvise" or "always");
    smaller ones are ordinary tensors; both hold what is written into them, and a slot's
    buffer is reused, not remade."""
    small = huge_page_empty(1000, torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32
    n = HUGE_PAGE_MIN_BYTES // 2 + 5  # bfloat16 entries: 10 bytes over the threshold
    big = huge_page_empty(n, torch.bfloat16)
    assert big.shape == (n,) and big.is_contiguous() and big.dtype == torch.bfloat16
    big.copy_(torch.arange(n, dtype=torch.float32).remainder_(256).to(torch.bfloat16))
    tail = torch.tensor([(n - 3) % 256, (n - 2) % 256, (n - 1) % 256], dtype=torch.float32)
    assert torch.equal(big[-3:].float(), tail)
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    mode = (thp / "enabled").read_text() if (thp / "enabled").exists() else ""
    size = thp / "hugepages-2048kB" / "enabled"  # per-size setting (Linux 6.8+)
    size_mode = size.read_text() if size.exists() else "[inherit]"
    if ("[madvise]" in mode or "[always]" in mode) and "[never]" not in size_mode:
        fields = _vma_fields(big.data_ptr())
        if fields is not None and "THPeligible" in fields:
            assert fields["THPeligible"] == "1"
    pool = BufferPool(DirectIO)
    first = pool.take("out", (n,), torch.bfloat16, phase=8)
    again = pool.take("out", (n // 2,), torch.bfloat16, phase=8)
    assert first.data_ptr() == again.data_ptr()
    assert first.data_ptr() % DIRECT_ALIGN == 8


def test_placed_tensors_are_written_from_their_own_memory(tmp_path, monkeypatch):
    """A buffer taken with its file position's phase goes to the disk from its own memory: only
    the partial blocks at its ends pass through the staging buffer; the bytes are the same."""
    g = torch.Generator().manual_seed(1)
    pool = BufferPool(DirectIO)
    header = b"h" * 13
    pieces: list[bytes | torch.Tensor] = [header]
    position = len(header)
    for i, (n, dtype) in enumerate(
        [
            (9000, torch.uint8),
            (3 * 4096, torch.uint8),
            (70001, torch.uint8),
            (20000, torch.bfloat16),
        ]
    ):
        placed = pool.take(f"out-{i % 2}", (n,), dtype, phase=position % DIRECT_ALIGN)
        assert placed.data_ptr() % DIRECT_ALIGN == position % DIRECT_ALIGN
        placed.view(torch.uint8).copy_(
            torch.randint(0, 256, (placed.nbytes,), generator=g, dtype=torch.uint8)
        )
        pieces.append(placed.clone() if i < 2 else placed)  # a clone: placed otherwise
        position += placed.nbytes
    expected = b"".join(
        p if isinstance(p, bytes) else p.view(torch.uint8).numpy().tobytes() for p in pieces
    )
    staged: list[int] = []
    stage = DirectStream._stage
    monkeypatch.setattr(
        DirectStream, "_stage", lambda self, d: staged.append(d.numel()) or stage(self, d)
    )
    stream = DirectStream(tmp_path / "placed.bin", staging=8192)
    for piece in pieces:
        stream.write(piece)
    stream.close()
    assert (tmp_path / "placed.bin").read_bytes() == expected
    clones = sum(p.nbytes for p in pieces[1:3])
    assert sum(staged) < len(header) + clones + 4 * 2 * DIRECT_ALIGN  # the placed: ends only


def test_a_shard_truncated_after_planning_is_an_error_not_a_crash(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    save_file({"w": torch.ones(4096)}, tmp_path / "m" / "model.safetensors")
    folder = CheckpointFolder(tmp_path / "m")
    assert torch.equal(folder.map("w"), torch.ones(4096))
    with open(tmp_path / "m" / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "m" / "model.safetensors") - 100)
    with pytest.raises(Exception, match="ended inside tensor 'w'"):
        folder.map("w")
    folder.close()


@pytest.fixture(scope="module")
def wide_ckpts(tmp_path_factory):
    """base + two experts (bf16, sharded) whose largest tensor spans several chunks."""
    import json

    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("wide")
    g = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (20000, 32), "layer.weight": (64, 64), "norm.weight": (32,)}
    assert 20000 * 32 > 2 * chunks.CHUNK
    base = {k: (0.02 * torch.randn(s, generator=g)).bfloat16() for k, s in shapes.items()}
    paths, sds = [], []
    for i, name in enumerate(["base", "expert_0", "expert_1"]):
        noise = {k: 0.002 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        sd = {k: (v.float() + noise[k] * (i > 0)).bfloat16() for k, v in base.items()}
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
        save_file({"embed.weight": sd["embed.weight"]}, folder / "model-00001-of-00002.safetensors")
        rest = {k: v for k, v in sd.items() if k != "embed.weight"}
        save_file(rest, folder / "model-00002-of-00002.safetensors")
        weight_map = {
            k: f"model-0000{1 if k == 'embed.weight' else 2}-of-00002.safetensors" for k in sd
        }
        index = {"metadata": {}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        paths.append(folder)
        sds.append(sd)
    return paths, sds


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("linear", {}),
        ("task_arithmetic", {"lambda": 0.8}),
        ("ties", {"density": 0.3, "trim_scope": "tensor"}),
        ("ties", {"density": 0.3, "trim_scope": "model", "majority_sign": "count"}),
        ("dare_linear", {"density": 0.4}),
        ("dare_ties", {"density": 0.4}),
        ("breadcrumbs", {}),
    ],
)
def test_multi_chunk_tensors_stream_to_the_in_memory_bits(wide_ckpts, tmp_path, method, params):
    (base, e0, e1), (base_sd, sd0, sd1) = wide_ckpts
    expected = merge_state_dicts(method, base_sd, [sd0, sd1], params=params, seed=2)
    out = merge_checkpoints(
        method, base, [e0, e1], output=tmp_path / "out", params=params, seed=2, progress=False
    )
    with CheckpointFolder(out) as folder:
        for name, tensor in expected.items():
            assert torch.equal(folder.read(name), tensor), name


def test_sample_stride_grows_with_the_tensor_up_to_one_row_per_period():
    """1/8 from SAMPLE_MIN_NUMEL entries, sparser while the sample keeps SAMPLE_VALUES values,
    at most 1/32 (a period of 1024 entries: every row of a 1024-wide matrix sampled)."""
    assert sampling.sample_stride(sampling.SAMPLE_MIN_NUMEL - 1) == 1
    assert sampling.sample_stride(1 << 19) == 8  # 512×1024: 2¹⁶ sampled values
    assert sampling.sample_stride(1 << 20) == 16  # 1024×1024: 2¹⁶ sampled values
    assert sampling.sample_stride(1 << 22) == sampling.sample_stride(32000 * 1024) == 32
    assert sampling.SAMPLE_RUN * sampling.SAMPLE_STRIDE_MAX == 1024
    for numel in (1 << 19, 1 << 20, 3 << 20, 1 << 22, 1 << 25):
        stride = sampling.sample_stride(numel)
        assert (
            numel // stride >= sampling.SAMPLE_VALUES
            and sampling.histogram_chunk(numel) % (sampling.SAMPLE_RUN * stride) == 0
        )  # every chunk starts a period


def test_dropped_slots_let_go_of_their_buffers():
    pool = BufferPool(DirectIO)
    pool.take("compute-base-pass", (10,), torch.float32)
    pool.take("compute-0-pass", (10,), torch.float32, phase=4)
    kept = pool.take("compute-0-0", (10,), torch.float32)
    pool.drop("-pass")
    assert [k[0] for k in pool._flat] == ["compute-0-0"]
    assert pool.take("compute-0-0", (10,), torch.float32).data_ptr() == kept.data_ptr()


def test_the_whole_model_passes_buffers_are_let_go_before_the_merge(tmp_path, monkeypatch):
    """Without the accelerator, TIES' whole-model trim reads every tensor cast to float32 into a
    buffer set of its own: dropped once the thresholds are known, so the merge does not hold a
    second set."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    folders = []
    for name in ("base", "math", "code"):
        (tmp_path / name).mkdir()
        tensors = {f"w{i}": torch.randn(64, 32, generator=g).bfloat16() for i in range(3)}
        save_file(tensors, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text("{}")
        folders.append(tmp_path / name)
    monkeypatch.setattr(kernels, "enabled", False)
    drop, dropped = BufferPool.drop, []

    def spy(self, suffix):
        dropped.append(sorted(k[0] for k in self._flat if k[0].endswith(suffix)))
        drop(self, suffix)
        assert not [k for k in self._flat if k[0].endswith(suffix)]

    monkeypatch.setattr(BufferPool, "drop", spy)
    merge_checkpoints(
        "ties",
        folders[0],
        folders[1:],
        output=tmp_path / "out",
        params={"density": 0.3, "trim_scope": "model"},
        progress=False,
    )
    assert dropped == [["compute-0-pass", "compute-1-pass", "compute-base-pass"]]
