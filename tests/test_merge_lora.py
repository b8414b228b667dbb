"""LoRA adapter merging in ΔW space, pinned to PEFT's own add_weighted_adapter / merge_and_unload."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig

from mergelab.lora import LoraAdapter, LoraAdapterError
from mergelab.merge import MergeInputError, merge_state_dicts
from mergelab.merge.lora import merge_lora_adapters
from mergelab.tiny import tiny_causal_lm

# Two adapters with different ranks, alphas and (partly) different target modules.
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=2, lora_alpha=3, target_modules=["q_proj", "up_proj"]),
}


def tiny_base():
    return tiny_causal_lm(
        64,
        architecture="llama",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        seed=0,
        intermediate_size=64,
        num_key_value_heads=2,
        pad_token_id=None,
    )


@pytest.fixture(scope="module")
def lora_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    tiny_base().save_pretrained(root / "base")
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + seed)
        # init_lora_weights=False: random A and B, so every ΔW is non-zero
        config = LoraConfig(**kwargs, init_lora_weights=False, task_type="CAUSAL_LM")
        get_peft_model(tiny_base(), config).save_pretrained(root / name)
    return root


def peft_cat_merge(root, weights):
    """PEFT's own path: add_weighted_adapter(combination_type='cat') then merge_and_unload."""
    model = PeftModel.from_pretrained(tiny_base(), root / "a", adapter_name="a")
    model.load_adapter(root / "b", adapter_name="b")
    model.add_weighted_adapter(["a", "b"], weights, "merged", combination_type="cat")
    model.set_adapter("merged")
    return model.merge_and_unload().state_dict()


def adapter_deltas(path) -> dict[str, torch.Tensor]:
    adapter = LoraAdapter.from_pretrained(path)
    return {f"{m}.weight": lora.delta(torch.float64) for m, lora in adapter.modules.items()}


def test_full_output_equals_peft_cat_merge_and_unload(lora_set, tmp_path):
    weights = [0.7, 1.3]
    result = merge_lora_adapters(
        "task_arithmetic",
        [lora_set / "a", lora_set / "b"],
        base=lora_set / "base",
        output=tmp_path / "full",
        weights=weights,
        progress=False,
    )
    ours = AutoModelForCausalLM.from_pretrained(result.output).eval().state_dict()
    theirs = peft_cat_merge(lora_set, weights)
    assert set(ours) == set(theirs)
    # float32 round-off of (W + Σ w_i s_i B_i A_i) computed in different orders
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    base = AutoModelForCausalLM.from_pretrained(lora_set / "base").state_dict()
    changed = {n for n in base if not torch.equal(base[n], ours[n])}
    assert {n.split(".")[-2] for n in changed} == {"q_proj", "v_proj", "up_proj"}


def test_cat_adapter_is_exact_and_loads_in_peft(lora_set, tmp_path):
    weights = [0.7, 1.3]
    result = merge_lora_adapters(
        "task_arithmetic",
        [lora_set / "a", lora_set / "b"],
        output=tmp_path / "adapter",
        output_kind="adapter",
        weights=weights,
        progress=False,
    )
    assert result.exact and result.rank == 4 + 2 and result.truncation_error == {}
    merged = adapter_deltas(result.output)
    da, db = adapter_deltas(lora_set / "a"), adapter_deltas(lora_set / "b")
    for name, delta in merged.items():
        expected = weights[0] * da.get(name, 0) + weights[1] * db.get(name, 0)
        # exact algebra; the only error is storing A and B in float32
        torch.testing.assert_close(delta, expected, rtol=1e-6, atol=1e-7)
    peft_model = PeftModel.from_pretrained(tiny_base(), result.output)
    via_peft = peft_model.merge_and_unload().state_dict()
    theirs = peft_cat_merge(lora_set, weights)
    for name in theirs:
        torch.testing.assert_close(via_peft[name], theirs[name], rtol=1e-5, atol=1e-6)


def test_ties_adapter_is_svd_of_the_merged_delta_with_reported_error(lora_set, tmp_path):
    """A non-linear method: merged ΔW = ties on the ΔW's (base 0); the adapter is its rank-k SVD,
    and the reported relative Frobenius error is the actual one."""
    params = {"density": 0.5}
    da, db = adapter_deltas(lora_set / "a"), adapter_deltas(lora_set / "b")
    names = sorted(set(da) | set(db))
    zeros = {n: torch.zeros_like((da | db)[n]).float() for n in names}
    expected = merge_state_dicts(
        "ties",
        zeros,
        [
            {n: da.get(n, zeros[n]).float() for n in names},
            {n: db.get(n, zeros[n]).float() for n in names},
        ],
        params=params,
    )
    full = merge_lora_adapters(
        "ties",
        [lora_set / "a", lora_set / "b"],
        base=lora_set / "base",
        output=tmp_path / "full",
        params=params,
        progress=False,
    )
    base = AutoModelForCausalLM.from_pretrained(lora_set / "base").state_dict()
    ours = AutoModelForCausalLM.from_pretrained(full.output).state_dict()
    for n in names:
        torch.testing.assert_close(ours[n] - base[n], expected[n], rtol=1e-5, atol=1e-6)

    result = merge_lora_adapters(
        "ties",
        [lora_set / "a", lora_set / "b"],
        output=tmp_path / "adapter",
        output_kind="adapter",
        rank=3,
        params=params,
        progress=False,
    )
    assert not result.exact and result.rank == 3
    got = adapter_deltas(result.output)
    for n in names:
        module = n.removesuffix(".weight")
        actual = float((got[n] - expected[n].double()).norm() / expected[n].double().norm())
        assert abs(actual - result.truncation_error[module]) < 1e-5
        assert 0 < result.truncation_error[module] < 1
    record = json.loads((result.output / "mergelab_merge.json").read_text())
    assert record["rank"] == 3 and not record["exact"]

    # at full rank (min(out, in) = 32) the SVD reproduces the merged ΔW
    exact = merge_lora_adapters(
        "ties",
        [lora_set / "a", lora_set / "b"],
        output=tmp_path / "adapter32",
        output_kind="adapter",
        rank=32,
        params=params,
        progress=False,
    )
    assert exact.max_truncation_error < 1e-6
    got = adapter_deltas(exact.output)
    for n in names:
        torch.testing.assert_close(got[n].float(), expected[n], rtol=1e-4, atol=1e-6)


def test_bad_lora_inputs(lora_set, tmp_path):
    with pytest.raises(MergeInputError, match="needs the base"):
        merge_lora_adapters("linear", [lora_set / "a"], output=tmp_path / "o")
    with pytest.raises(LoraAdapterError, match="not a PEFT adapter"):
        merge_lora_adapters(
            "linear", [lora_set / "base"], output=tmp_path / "o", output_kind="adapter"
        )
    # an adapter for a model with a wider MLP does not fit this base
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    other = get_peft_model(
        AutoModelForCausalLM.from_config(config),
        LoraConfig(r=2, target_modules=["up_proj"], init_lora_weights=False),
    )
    other.save_pretrained(tmp_path / "wide")
    with pytest.raises(MergeInputError, match=r"up_proj.*\(96, 32\).*\(64, 32\)"):
        merge_lora_adapters(
            "linear", [tmp_path / "wide"], base=lora_set / "base", output=tmp_path / "o"
        )
    assert not (tmp_path / "o").exists()
