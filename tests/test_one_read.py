"""Per-tensor thresholds found in the merge's own read (mergelab.merge.one_read) give the bits of
the separate passes.

TIES (``trim_scope="tensor"``) and breadcrumbs, on bfloat16 tensors large enough to be sampled,
merge with their thresholds guessed and the exact ones counted on the way, then merge again the
entries the guess treated otherwise. Each case runs that way and with the separate threshold
passes (and with torch), and the outputs must be equal bit for bit: with the AVX2 loops and
without, with the guess forced to the band's edge (many entries merged again), and through every
fallback (a band that overflows its room, a sample that put the band in the wrong place).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_merge_kernels import assert_same_bits, inputs, switched

from mergelab.merge import MergeInputError, TensorContext, get_merge_method, kernels, one_read, ops

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="the compiled loops were not built (no C compiler)"
)

# three chunks and a partial one, whose last tile ends in a partial step of 16 positions
NUMEL = 67 * 12001

CASES = [
    ("ties", {"density": 0.2, "trim_scope": "tensor"}),
    ("ties", {"density": [0.2, 0.5], "trim_scope": "tensor", "majority_sign": "count"}),
    (
        "ties",
        {
            "density": 0.2,
            "weight": [1.0, 1.0],
            "trim_scope": "tensor",
            "weighted_sign": True,
            "divide_by": "weight_sum",
        },
    ),
    ("ties", {"density": 0.3, "trim_scope": "tensor", "divide_by": "none", "lambda_": 0.7}),
    (
        "ties",
        {
            "density": [0.3, 0.9],
            "weight": [-0.7, 1.3],
            "trim_scope": "tensor",
            "weighted_sign": True,
            "divide_by": "weight_sum",
        },
    ),
    ("ties", {"density": [0.2, 1.0], "trim_scope": "tensor"}),
    ("breadcrumbs", {"density": 0.9, "gamma": 0.01}),
    ("breadcrumbs", {"density": [0.8, 0.9], "gamma": [0.05, 0.01], "normalize": True}),
    ("breadcrumbs", {"density": [0.5, 1.0], "gamma": [0.1, 0.0], "weight": [0.7, 1.2]}),
]


def merged(method: str, base, experts, params: dict, *, one: bool, compiled: bool = True):
    """The streamed way (stored bfloat16 in, a bfloat16 buffer out), with ``one_read`` or
    with the separate threshold passes."""
    applies = one_read.applies
    saved = kernels.enabled
    kernels.enabled = compiled
    one_read.applies = applies if one else (lambda *_: False)
    try:
        ctx = TensorContext("model.layers.0.mlp.up_proj.weight", seed=7)
        ctx.dtype = torch.float32
        ctx.out = torch.empty(experts[0].shape, dtype=torch.bfloat16)
        return get_merge_method(method)(base, experts, ctx=ctx, **params).clone(), ctx
    finally:
        one_read.applies = applies
        kernels.enabled = saved


@pytest.fixture
def calls(monkeypatch):
    """How often each of one_read's ways ran."""
    seen = {"merge": 0, "separately": 0, "again": []}
    merge, separately, between = one_read.merge, one_read._separately, one_read._Counts.between

    def counted_merge(*args, **kwargs):
        seen["merge"] += 1
        return merge(*args, **kwargs)

    def counted_separately(*args, **kwargs):
        seen["separately"] += 1
        return separately(*args, **kwargs)

    def counted_between(self):
        positions = between(self)
        seen["again"].append(len(positions))
        return positions

    monkeypatch.setattr(one_read, "merge", counted_merge)
    monkeypatch.setattr(one_read, "_separately", counted_separately)
    monkeypatch.setattr(one_read._Counts, "between", counted_between)
    return seen


def bf16_inputs(seed: int = 0):
    return inputs(2, torch.bfloat16, seed=seed, numel=NUMEL)


@pytest.mark.parametrize("vectors", [True, False], ids=["vectors", "scalar"])
@pytest.mark.parametrize("method,params", CASES, ids=range(len(CASES)))
def test_one_read_gives_the_bits_of_the_separate_passes(calls, method, params, vectors):
    base, experts = bf16_inputs(seed=3)
    with switched("vector_loops", vectors):
        got, ctx = merged(method, base, experts, params, one=True)
        separate, _ = merged(method, base, experts, params, one=False)
    assert calls["merge"] == 1 and calls["separately"] == 0  # it ran, without a fallback
    assert ctx.checks is not None and ctx.checks.inputs_finite and ctx.checks.result_finite
    assert_same_bits(got, separate)
    reference, _ = merged(method, base, experts, params, one=False, compiled=False)
    assert_same_bits(got, reference)


@pytest.mark.parametrize("method,params", [CASES[0], CASES[6]], ids=["ties", "breadcrumbs"])
def test_entries_the_guess_treated_otherwise_are_merged_again(monkeypatch, calls, method, params):
    """With every guess at its band's first pattern, a good part of each band is merged twice;
    without that second merge the output would differ (the test can tell)."""

    def edges(base, experts, bands):
        return [low + 1 for _, _, (low, _) in bands]

    monkeypatch.setattr(one_read, "_guesses", edges)
    base, experts = bf16_inputs(seed=5)
    got, _ = merged(method, base, experts, params, one=True)
    separate, _ = merged(method, base, experts, params, one=False)
    assert calls["again"] and calls["again"][0] > 1000
    assert_same_bits(got, separate)
    monkeypatch.setattr(one_read._Counts, "between", lambda self: np.zeros(0, dtype=np.int64))
    skipped, _ = merged(method, base, experts, params, one=True)
    assert not torch.equal(skipped.view(torch.int16), separate.view(torch.int16))


def test_a_band_without_room_for_its_entries_falls_back(monkeypatch, calls):
    monkeypatch.setattr(one_read, "ROOM", 0)
    monkeypatch.setattr(one_read, "SLACK", 16)
    base, experts = bf16_inputs(seed=6)
    method, params = CASES[1]
    got, _ = merged(method, base, experts, params, one=True)
    separate, _ = merged(method, base, experts, params, one=False)
    assert calls["separately"] == 1
    assert_same_bits(got, separate)


def test_a_band_that_misses_the_kth_largest_falls_back(monkeypatch, calls):
    """The sample's band moved well above the k-th largest: the counts say it is not inside, the
    exact passes run and the tensor is merged again."""
    band = ops.KthLargestAbs.band

    def moved(self):
        found = band(self)
        return None if found is None else (found[0] + (1 << 20), found[1] + (1 << 20))

    monkeypatch.setattr(ops.KthLargestAbs, "band", moved)
    base, experts = bf16_inputs(seed=8)
    for method, params in (CASES[0], CASES[6]):
        got, _ = merged(method, base, experts, params, one=True)
        monkeypatch.setattr(ops.KthLargestAbs, "band", band)
        separate, _ = merged(method, base, experts, params, one=False)
        monkeypatch.setattr(ops.KthLargestAbs, "band", moved)
        assert_same_bits(got, separate)
    assert calls["separately"] == 2


def test_nonfinite_inputs_are_reported(calls):
    base, experts = bf16_inputs(seed=9)
    experts[1].view(-1)[12345] = float("nan")
    with pytest.raises(MergeInputError):
        merged(CASES[0][0], base, experts, CASES[0][1], one=True)
    assert calls["merge"] == 1


def test_only_bfloat16_inputs_large_enough_to_sample_take_one_read():
    base, experts = bf16_inputs()
    out = torch.empty(NUMEL, dtype=torch.bfloat16)
    assert one_read.applies(base, experts, out) == kernels.active()
    assert not one_read.applies(base.float(), [e.float() for e in experts], out)
    small = [x.reshape(-1)[: ops.SAMPLE_MIN_NUMEL - 1] for x in (base, *experts)]
    assert not one_read.applies(small[0], small[1:], out[: ops.SAMPLE_MIN_NUMEL - 1])
    assert not one_read.applies(base, experts, out.half())


def test_kth_largest_bits_is_the_sorts():
    """The compiled selection of the k-th largest bit pattern (three radix steps) against a sort:
    patterns over the whole range, in one narrow bucket, and a few heavily repeated ones."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 5000))
        if trial % 3 == 0:
            values = rng.integers(0, 2**31 - 1, n).astype(np.int32)
        elif trial % 3 == 1:
            values = rng.integers(0x3B000000, 0x3B000000 + 3000, n).astype(np.int32)
        else:
            repeated = np.array([0, 5, 0x3B20FFFF, 0x3B210000, 0x7F7FFFFF], dtype=np.int32)
            values = rng.choice(repeated, n)
        k = int(rng.integers(1, n + 1))
        assert kernels.loops().kth_largest_bits(values, k) == np.sort(values)[::-1][k - 1]
