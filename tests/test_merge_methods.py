"""The steps of the merge methods (mergelab.merge.methods.steps, and the accelerator's exact
threshold finders) and the engine's input checks."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mergelab.merge import MergeInputError, merge_models, merge_state_dicts
from mergelab.merge.accelerator import sampling, thresholds
from mergelab.merge.methods import steps
from mergelab.merge.validation import check_same_architecture, common_vocab_rows


def kth_largest_by_sort(x: torch.Tensor, k: int) -> float:
    values = x.abs().float().reshape(-1).sort(descending=True).values
    return float(values[min(k, values.numel()) - 1])


# --- exact thresholds ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        torch.randn(5000),
        torch.randn(5000) * 10.0 ** torch.randint(-30, 30, (5000,)),  # many exponents, tiny ones
        torch.randint(-4, 5, (5000,)).float(),  # massive exact ties, zeros
        torch.cat([torch.zeros(4990), torch.full((10,), 1e-40)]),  # denormals and zeros
        (torch.randn(5000) * 0.01).to(torch.bfloat16),
        torch.randn(5000, dtype=torch.float64),
    ],
    ids=["normal", "wide-range", "ties", "denormal", "bf16", "float64"],
)
@pytest.mark.parametrize("find", [steps.kth_largest_abs, thresholds.kth_largest_abs])
def test_kth_largest_abs_equals_sorting(values, find):
    n = values.numel()
    for k in [1, 2, 3, 100, n // 5, n // 2, n - 1, n, n + 10]:
        assert find(values, k) == kth_largest_by_sort(values, k), k


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    density=st.floats(0.001, 0.999),
    seed=st.integers(0, 2**16),
    clusters=st.sampled_from([None, (8, 4, 2, 2), (16, 8, 4, 3)]),
)
def test_global_thresholds_are_the_kth_of_the_concatenated_model(sizes, density, seed, clusters):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(s, generator=g) for s in sizes]
    experts = [[b + torch.randn(b.shape, generator=g) for b in base] for _ in range(2)]
    calls = []

    def make_iter():
        calls.append(1)
        return ((f"t{i}", b, [e[i] for e in experts]) for i, b in enumerate(base))

    names = ["MODEL_SAMPLE_CLUSTER", "MODEL_SAMPLE_PERIOD", "MODEL_SAMPLE_RUN"]
    names.append("MODEL_SAMPLE_CLUSTERS")
    with contextlib.ExitStack() as stack:  # the default clusters, or clusters of a few entries
        for name, value in zip(names, clusters or ()):
            stack.enter_context(mock.patch.object(sampling, name, value))
        found = thresholds.global_magnitude_thresholds(make_iter, [density, 0.5])
    # the sample, then one exact pass over its band; or (a sample of a few clusters rarely pins
    # the band down) the two exact radix passes, straight away (3) or after a band that missed (4)
    assert len(calls) in (2, 3, 4)
    n = sum(sizes)
    for e, d, threshold in zip(experts, [density, 0.5], found):
        flat = torch.cat([x - b for x, b in zip(e, base)])
        assert threshold == kth_largest_by_sort(flat, steps.kept_count(d, n))
    assert steps.model_magnitude_thresholds(make_iter, [density, 0.5]) == found  # the spec


def test_global_thresholds_take_no_pass_when_nothing_is_trimmed():
    calls = []

    def make_iter():
        calls.append(1)
        return [("w", torch.zeros(3), [torch.ones(3)])]

    assert thresholds.global_magnitude_thresholds(make_iter, [1.0]) == [0.0]
    assert steps.model_magnitude_thresholds(make_iter, [1.0]) == [0.0]
    assert not calls


def test_kept_count_follows_mergekit():
    assert steps.kept_count(0.2, 100) == 20
    assert steps.kept_count(0.001, 100) == 1  # a positive density keeps at least one entry
    assert steps.kept_count(0.0, 100) == 0
    assert steps.kept_count(1.0, 100) == 100
    assert steps.kept_count(0.29, 100) == 28  # int(0.29 * 100) = int(28.999...) as in both tools


def test_magnitude_trim_keeps_top_k_and_all_ties_at_the_threshold():
    tau = torch.tensor([0.5, -3.0, 2.0, -2.0, 0.1, 2.0])
    threshold = steps.magnitude_threshold(tau, 0.5)  # k = 3: |−3|, then 2 (three entries tie at 2)
    assert threshold == 2.0
    expected = [0.0, -3.0, 2.0, -2.0, 0.0, 2.0]
    assert steps.magnitude_trim_(tau.clone(), 0.5).tolist() == expected
    assert steps.threshold_trim_(tau.clone(), threshold).tolist() == expected
    assert steps.threshold_trim_(tau.clone(), math.inf).abs().sum() == 0
    assert steps.magnitude_trim_(tau.clone(), 0.0).abs().sum() == 0
    assert steps.magnitude_trim_(tau.clone(), 1.0).tolist() == tau.tolist()


def test_magnitude_outlier_trim_keeps_the_middle_band():
    tau = torch.arange(1, 101, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(50)
    kept = steps.magnitude_outlier_trim_(tau.clone(), density=0.3, gamma=0.1)
    magnitudes = kept.abs()[kept != 0]
    assert magnitudes.min() == 61 and magnitudes.max() == 90  # drop top 10, keep next 30


def test_random_drop_rescale_rules():
    tau = torch.tensor([1.0, -2.0, 3.0, -4.0])
    keep = torch.tensor([True, False, True, False])
    assert steps.random_drop_(tau.clone(), keep, 0.5, "keep_rate").tolist() == [2.0, 0.0, 6.0, 0.0]
    l1 = steps.random_drop_(tau.clone(), keep, 0.5, "l1")
    torch.testing.assert_close(l1, torch.tensor([2.5, 0.0, 7.5, 0.0]))  # |·|₁ 4 → 10
    assert steps.random_drop_(tau.clone(), keep, 0.5, "none").tolist() == [1.0, 0.0, 3.0, 0.0]
    assert steps.random_drop_(tau.clone(), keep, 1.0, "keep_rate").tolist() == tau.tolist()
    assert steps.random_drop_(tau.clone(), keep, 0.0, "keep_rate").abs().sum() == 0


def test_elect_sign_by_sum_and_by_count():
    stack = torch.tensor([[3.0, 1.0, 0.0, 1.0], [-1.0, -1.0, 0.0, -1.0], [-1.0, -5.0, 0.0, 0.5]])
    assert steps.elect_sign(stack, "sum").tolist() == [1.0, -1.0, 1.0, 1.0]  # sums 1, −5, 0, 0.5
    assert steps.elect_sign(stack, "count").tolist() == [-1.0, -1.0, 1.0, 1.0]  # 1:2, 1:2, 0:0, 2:1
    weighted = steps.elect_sign(stack, "sum", sign_weights=[1.0, 1.0, -1.0])  # third expert flipped
    assert weighted.tolist() == [1.0, 1.0, 1.0, -1.0]


def test_disjoint_merge_divisors():
    stack = torch.tensor([[2.0, 1.0, 0.0], [4.0, -1.0, 0.0]])
    elected = torch.tensor([1.0, 1.0, 1.0])

    def merge(weights, **kw):
        return steps.disjoint_merge_(stack.clone(), elected, weights, **kw).tolist()

    assert merge(None, divide_by="count") == [3.0, 1.0, 0.0]
    assert merge(None, divide_by="none") == [6.0, 1.0, 0.0]
    assert merge([0.5, 1.5], divide_by="weight_sum") == [3.5, 1.0, 0.0]  # (1+6)/2, 0.5/0.5
    assert merge([0.5, 1.5], divide_by="count") == [3.5, 0.5, 0.0]
    # weighted_sign: a negative weight flips which sign agrees (w·τ = −4 disagrees with +)
    assert merge([1.0, -1.0], divide_by="none", weighted_sign=True) == [2.0, 2.0, 0.0]


# --- bad input -------------------------------------------------------------------------------------


def sd(**shapes):
    return {name.replace("__", "."): torch.zeros(shape) for name, shape in shapes.items()}


def test_missing_and_extra_tensors_are_named():
    base = sd(a=(2,), b=(3,))
    with pytest.raises(
        MergeInputError, match=r"expert 0 .*missing tensors \['b'\].*extra tensors \['c'\]"
    ):
        merge_state_dicts("task_arithmetic", base, [sd(a=(2,), c=(3,))])


def test_shape_mismatch_is_named():
    with pytest.raises(
        MergeInputError, match=r"tensor 'b': shapes differ \(base \(3,\), expert 0 \(4,\)\)"
    ):
        merge_state_dicts("task_arithmetic", sd(a=(2,), b=(3,)), [sd(a=(2,), b=(4,))])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_inf_are_refused(bad):
    expert = sd(a=(2,), b=(3,))
    expert["b"][1] = bad
    with pytest.raises(MergeInputError, match="tensor 'b' in expert 1 contains NaN or Inf"):
        merge_state_dicts("linear", None, [sd(a=(2,), b=(3,)), expert])


def test_different_architectures_are_refused():
    with pytest.raises(MergeInputError, match="expert 0 is a Sequential but the base is a Linear"):
        merge_models("linear", torch.nn.Linear(2, 2), [torch.nn.Sequential(torch.nn.Linear(2, 2))])
    llama = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 96}
    with pytest.raises(
        MergeInputError, match="num_hidden_layers is 2 in the base but 3 in expert 0"
    ):
        check_same_architecture([llama, {**llama, "num_hidden_layers": 3}], ["base", "expert 0"])
    with pytest.raises(MergeInputError, match="model_type is 'llama' in the base but 'qwen2'"):
        check_same_architecture([llama, {**llama, "model_type": "qwen2"}], ["base", "expert 0"])
    padded = {**llama, "vocab_size": 128}
    with pytest.raises(MergeInputError, match="vocab_size .*vocab_padding='truncate'"):
        check_same_architecture([llama, padded], ["base", "expert 0"])
    check_same_architecture([llama, padded], ["base", "expert 0"], vocab_padding="truncate")


def test_tiny_llamas_of_different_depth_are_refused():
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2)
    a = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=1, **kw))
    b = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **kw))
    with pytest.raises(
        MergeInputError, match="num_hidden_layers is 1 in the base but 2 in expert 0"
    ):
        merge_models("task_arithmetic", a, [b])


# --- vocabulary padding rule -------------------------------------------------------------------------


def vocab_models(rows_base: int, rows_expert: int):
    g = torch.Generator().manual_seed(0)
    base = {
        "model.embed_tokens.weight": torch.randn(rows_base, 4, generator=g),
        "lm_head.weight": torch.randn(rows_base, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
    }
    expert = {k: torch.randn(v.shape, generator=g) for k, v in base.items()}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        expert[name] = torch.randn(rows_expert, 4, generator=g)
    return base, expert


def test_vocab_padding_is_an_error_by_default_with_a_hint():
    base, expert = vocab_models(10, 12)
    with pytest.raises(MergeInputError, match="vocabulary sizes differ.*vocab_padding='truncate'"):
        merge_state_dicts("task_arithmetic", base, [expert])


@pytest.mark.parametrize(("rows_base", "rows_expert"), [(10, 12), (12, 10)])
def test_vocab_padding_truncate_merges_shared_rows_and_keeps_the_bases_rest(rows_base, rows_expert):
    base, expert = vocab_models(rows_base, rows_expert)
    merged = merge_state_dicts(
        "task_arithmetic", base, [expert], params={"lambda": 0.5}, vocab_padding="truncate"
    )
    shared = min(rows_base, rows_expert)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert merged[name].shape == base[name].shape
        expected = base[name][:shared] + 0.5 * (expert[name][:shared] - base[name][:shared])
        torch.testing.assert_close(merged[name][:shared], expected)
        assert torch.equal(merged[name][shared:], base[name][shared:])
    assert common_vocab_rows("lm_head.weight", [(10, 4), (12, 4)], ["base", "e"], "truncate") == 10


def test_vocab_padding_never_applies_to_other_tensors_or_other_axes():
    labels = ["base", "expert 0"]
    with pytest.raises(MergeInputError, match="shapes differ"):
        common_vocab_rows("model.layers.0.mlp.up_proj.weight", [(8, 4), (9, 4)], labels, "truncate")
    with pytest.raises(MergeInputError, match="shapes differ"):
        common_vocab_rows("lm_head.weight", [(8, 4), (8, 5)], labels, "truncate")
    with pytest.raises(ValueError, match="vocab_padding='pad'"):
        common_vocab_rows("lm_head.weight", [(8, 4), (9, 4)], labels, "pad")


# --- tied weights ----------------------------------------------------------------------------------


def test_tied_embeddings_are_merged_once():
    """With tied input/output embeddings DARE must not give the two names different values."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    expert = transformers.LlamaForCausalLM(config)
    merged = merge_models("dare_linear", base, [expert], params={"density": 0.5})
    sd_ = merged.state_dict()
    assert torch.equal(sd_["lm_head.weight"], sd_["model.embed_tokens.weight"])
    out = merge_state_dicts("dare_linear", base.state_dict(), [expert.state_dict()])
    assert torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [0.3, 0.7, 0.5], [1.0, -0.45, 0.25]])
def test_half_precision_weighted_sum_is_mergekits(dtype, weights):
    """steps.half_weighted_sum is mergekit's ``(deltas * weights).sum(dim=0)`` with the weights a
    tensor of the dtype, and its normaliser ``weights.sum(dim=0)`` (torch's half-precision sum
    accumulates in float32: not the same bits as adding the rows one by one in the dtype)."""
    g = torch.Generator().manual_seed(3)
    stack = torch.stack([(s * torch.randn(50_001, generator=g)).to(dtype) for s in (1, 1e-2, 3)])
    w = torch.tensor(weights, dtype=dtype).view(-1, 1)
    mergekit = (stack * w).sum(dim=0)
    ours = steps.weighted_sum(list(stack), weights, normalize=False)
    assert torch.equal(ours.view(torch.int16), mergekit.view(torch.int16))
    divisor = w.sum(dim=0)
    ours = steps.weighted_sum(iter(stack), weights, normalize=True)
    assert torch.equal(ours.view(torch.int16), (mergekit / divisor).view(torch.int16))
    assert not torch.equal(stack.sum(0), stack[0] + stack[1] + stack[2])  # why it matters
