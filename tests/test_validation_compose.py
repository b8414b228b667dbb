"""Composed decoders refuse NaN/Inf weights at construction, through every entry point."""

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from mergelab.compose import ComposedDecoder, Composition
from mergelab.tiny import char_tokenizer, tiny_causal_lm


@pytest.fixture(scope="module")
def models():
    tok = char_tokenizer()
    base = tiny_causal_lm(len(tok), seed=0, hidden_size=16, num_layers=1)
    experts = [tiny_causal_lm(len(tok), seed=s, hidden_size=16, num_layers=1) for s in (1, 2)]
    torch.manual_seed(3)
    config = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)
    adapter = get_peft_model(copy.deepcopy(base), config)
    return tok, base, experts, adapter


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_decoders_refuse_non_finite_weights(models, bad):
    tok, base, experts, adapter = models
    message = "weight of term 'expert2' must be a finite number"
    with pytest.raises(ValueError, match=message):
        ComposedDecoder(base, experts, tok, [1.0, bad])
    with pytest.raises(ValueError, match="must be a finite number"):
        ComposedDecoder.from_models(
            {"base": base, "expert": experts[0], "anti": experts[1]},
            Composition.dexperts("base", "expert", "anti", bad),
            tok,
        )
    with pytest.raises(ValueError, match="weight of term 'default' must be a finite number"):
        ComposedDecoder.from_lora(base, [adapter], tok, [bad])
    # The decoders themselves are fine with finite weights.
    decoder = ComposedDecoder(base, experts, tok, [1.0, -0.5])
    assert [t.weight for t in decoder.composition.terms] == [1.0, -0.5]


def test_a_string_is_not_a_list_of_weights(models):
    tok, base, experts, _ = models
    with pytest.raises(ValueError, match="one number per expert, got '12'"):
        ComposedDecoder(base, experts, tok, "12")
