"""LoRA fast path (one batched forward for base + adapters) equals composing merged adapters."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mergelab.candidate import GenerationSettings
from mergelab.compose import ComposedDecoder
from mergelab.lora import LoraAdapter, LoraAdapterError
from mergelab.model_candidate import ModelCandidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm

PROMPTS = ["hello world", "ab", "the cat sat"]
TARGETS = {
    "gpt2": (["c_attn", "c_proj", "c_fc"], ["c_attn"]),
    "llama": (["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "up_proj"]),
}


def _lora(base, arch, targets, r, seed, **kw):
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=targets,
        lora_dropout=0.0,
        fan_in_fan_out=(arch == "gpt2"),
        init_lora_weights=False,
        **kw,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # make the adapters matter
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    return peft_model.eval()


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def setup(request, tok):
    arch = request.param
    base = tiny_causal_lm(len(tok), architecture=arch, seed=0, initializer_range=0.3)
    first = _lora(base, arch, TARGETS[arch][0], r=4, seed=1)
    second = _lora(base, arch, TARGETS[arch][1], r=2, seed=2, use_rslora=True)
    merged = [copy.deepcopy(p).merge_and_unload().eval() for p in (first, second)]
    return base, [first, second], merged


@pytest.mark.parametrize("do_sample", [False, True])
def test_lora_fast_path_equals_merged_adapters(setup, tok, do_sample):
    base, adapters, merged = setup
    names = ["math", "code"]
    fast = ComposedDecoder.from_lora(base, adapters, tok, weights=[1.0, 0.7], expert_names=names)
    reference = ComposedDecoder(base, merged, tok, weights=[1.0, 0.7], expert_names=names)
    settings = GenerationSettings(
        max_new_tokens=8, do_sample=do_sample, seed=5, return_component_logprobs=True
    )
    got, want = fast.generate(PROMPTS, settings), reference.generate(PROMPTS, settings)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert torch.allclose(
            torch.tensor(a.component_logprobs), torch.tensor(b.component_logprobs), atol=1e-4
        )
    assert got[0].forward_passes * len(PROMPTS) == pytest.approx(8)  # one forward per step
    ids = torch.tensor([tok("hello there")["input_ids"]])
    assert torch.allclose(fast.token_logprobs(ids), reference.token_logprobs(ids), atol=1e-4)


def test_hooks_are_removed_and_base_is_untouched(setup, tok):
    base, adapters, _ = setup
    ids = torch.tensor([tok("hello")["input_ids"]])
    before = ModelCandidate(base, tok).token_logprobs(ids)
    ComposedDecoder.from_lora(base, adapters, tok).generate(
        ["ab"], GenerationSettings(max_new_tokens=3)
    )
    assert torch.equal(ModelCandidate(base, tok).token_logprobs(ids), before)
    assert all(not m._forward_hooks for m in base.modules())


def test_adapter_folder_loads_like_the_peft_model(setup, tmp_path):
    _, adapters, _ = setup
    for i, peft_model in enumerate(adapters):
        folder = tmp_path / f"adapter{i}"
        peft_model.save_pretrained(folder)
        from_folder = LoraAdapter.from_pretrained(folder)
        live = LoraAdapter.from_peft_model(peft_model)
        assert set(from_folder.modules) == set(live.modules)
        for key, lora in live.modules.items():
            saved = from_folder.modules[key]
            assert torch.equal(lora.A, saved.A) and torch.equal(lora.B, saved.B)
            assert (
                saved.scaling
                == lora.scaling
                == peft_model.base_model.model.get_submodule(key).scaling["default"]
            )  # PEFT's own scaling


def test_unsupported_adapters_are_refused(tok):
    base = tiny_causal_lm(len(tok), architecture="llama", seed=0)
    dora = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    )
    with pytest.raises(LoraAdapterError, match="DoRA"):
        LoraAdapter.from_peft_model(dora)
    plain = _lora(base, "llama", ["q_proj"], r=2, seed=0)
    with pytest.raises(ValueError, match="already a PEFT layer"):
        ComposedDecoder.from_lora(plain.get_base_model(), [plain], tok)
