"""Projective (token-mask) composition and the composition diagnostics."""

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from mergelab.compose import (
    ComposedDecoder,
    check_projectivity,
    compose_logprobs,
    project_onto_mask,
)
from mergelab.compose.diagnostics import composition_diagnostics, kl_divergence
from mergelab.model_candidate import ModelCandidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm


def _random_masks(g, vocab, k):
    owner = torch.randint(0, k + 1, (vocab,), generator=g)  # k = background
    return [owner == i for i in range(k)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(4, 40), k=st.integers(1, 4))
def test_experts_that_differ_only_on_their_mask_compose_projectively(seed, vocab, k):
    g = torch.Generator().manual_seed(seed)
    base_logits = 3 * torch.randn(5, vocab, generator=g, dtype=torch.float64)
    masks = _random_masks(g, vocab, k)
    experts = [
        torch.log_softmax(
            base_logits + m * 4 * torch.randn(5, vocab, generator=g, dtype=torch.float64), -1
        )
        for m in masks
    ]
    base = torch.log_softmax(base_logits, -1)
    report = check_projectivity(compose_logprobs(base, experts), base, experts, masks)
    assert max(report.factorisation_violation) < 1e-9
    assert report.holds(atol=1e-9), report
    assert max(report.projection_tv) < 1e-9 and report.background_tv < 1e-9


def test_check_can_fail_and_projection_repairs_it():
    g = torch.Generator().manual_seed(0)
    vocab = 30
    masks = _random_masks(g, vocab, 2)
    base = torch.log_softmax(2 * torch.randn(4, vocab, generator=g), -1)
    experts = [torch.log_softmax(2 * torch.randn(4, vocab, generator=g), -1) for _ in masks]
    report = check_projectivity(compose_logprobs(base, experts), base, experts, masks)
    assert not report.holds(atol=1e-3) and min(report.factorisation_violation) > 0.1
    projected = [project_onto_mask(base, e, m) for e, m in zip(experts, masks)]
    for p, e, m in zip(projected, experts, masks):
        assert torch.allclose(p.exp().sum(-1), torch.ones(4), atol=1e-5)
        assert torch.equal(p[:, m], e[:, m])  # the expert is kept on its own tokens
    report = check_projectivity(compose_logprobs(base, projected), base, projected, masks)
    assert max(report.factorisation_violation) < 1e-4 and report.holds(atol=1e-4)


class DiffersOnMask(nn.Module):
    """An 'expert' equal to the base except on ``mask``, where another model shifts its logits."""

    def __init__(self, base, other, mask):
        super().__init__()
        self.base, self.other = base, other
        self.register_buffer("mask", mask.float())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        kw = dict(attention_mask=attention_mask, position_ids=position_ids)
        return (
            self.base(input_ids, **kw).logits + self.mask * 3 * self.other(input_ids, **kw).logits
        )


def test_projectivity_on_models_built_to_differ_on_masks():
    tok = char_tokenizer()
    vocab = len(tok)
    base = tiny_causal_lm(vocab, seed=0, initializer_range=0.3)
    texts = ["hello world", "a cat", "the end."]
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        masks = _random_masks(g, vocab, 2)
        others = [
            tiny_causal_lm(vocab, seed=10 * seed + i + 1, initializer_range=0.3) for i in range(2)
        ]
        experts = [DiffersOnMask(base, o, m) for o, m in zip(others, masks)]
        decoder = ComposedDecoder(base, experts, tok)
        from mergelab.compose.decoding import left_pad

        ids, attn = left_pad([tok(t)["input_ids"] for t in texts], tok.pad_token_id)
        comps, composed = decoder.component_and_candidate_logprobs(ids, attn)
        report = check_projectivity(composed, comps[0], comps[1:], masks)
        assert report.holds(atol=1e-4), report
        # Token-mask composition of arbitrary experts is projective by construction.
        masked = ComposedDecoder(
            base, others, tok, token_masks={"expert1": masks[0], "expert2": masks[1]}
        )
        comps, composed = masked.component_and_candidate_logprobs(ids, attn)
        projected = [project_onto_mask(comps[0], c, m) for c, m in zip(comps[1:], masks)]
        assert check_projectivity(composed, comps[0], projected, masks).holds(atol=1e-4)


def test_diagnostics_measure_kl_activity_and_new_top1():
    tok = char_tokenizer()
    vocab = len(tok)
    base = tiny_causal_lm(vocab, seed=0, initializer_range=0.3)
    expert = tiny_causal_lm(vocab, seed=1, initializer_range=0.3)
    texts = ["hello world", "ab", "the cat sat"]
    same = composition_diagnostics(
        ComposedDecoder(base, [copy.deepcopy(base), expert], tok), texts, keep_positions=True
    )
    assert same.n_positions == sum(len(t) - 1 for t in texts)
    assert all(v == 0.0 for v in same.active_fraction["expert1"].values())
    assert same.mean_kl["expert1"] < 1e-5
    assert same.coactive_fraction["expert1&expert2"]["0.01"] == 0.0
    # per-position KL equals the KL computed from the single-model candidates.
    ids = torch.tensor([tok(texts[0])["input_ids"]])
    kl = kl_divergence(
        ModelCandidate(expert, tok).token_logprobs(ids),
        ModelCandidate(base, tok).token_logprobs(ids),
    )
    got = torch.tensor(same.per_position_kl[0])[:, 1]
    assert torch.allclose(got, kl[0, :-1], atol=1e-4)
    fractions = same.active_fraction["expert2"]
    assert fractions["0.01"] >= fractions["0.1"] >= fractions["1"]
    every_kl = torch.tensor([row[1] for text in same.per_position_kl for row in text])
    assert every_kl.numel() == same.n_positions
    for t in ("0.01", "0.1", "1"):
        assert fractions[t] == pytest.approx(float((every_kl > float(t)).float().mean()))
    # With a copy of the base, the composition is the other expert: no new top-1 tokens.
    assert same.composed_top1_differs_fraction == 0.0
    both = composition_diagnostics(
        ComposedDecoder(base, [expert, tiny_causal_lm(vocab, seed=2, initializer_range=0.3)], tok),
        texts,
    )
    # The same fraction from the single-model candidates, one text at a time.
    other = tiny_causal_lm(vocab, seed=2, initializer_range=0.3)
    decoder = ComposedDecoder(base, [expert, other], tok)
    new_tokens = []
    for text in texts:
        ids = torch.tensor([tok(text)["input_ids"]])
        composed_top1 = decoder.token_logprobs(ids)[0, :-1].argmax(-1)
        singles = [
            ModelCandidate(m, tok).token_logprobs(ids)[0, :-1].argmax(-1)
            for m in (base, expert, other)
        ]
        new_tokens += [
            bool((composed_top1[i] != torch.stack(singles)[:, i]).all())
            for i in range(len(composed_top1))
        ]
    assert both.composed_top1_differs_fraction == pytest.approx(sum(new_tokens) / len(new_tokens))
    assert 0 < sum(new_tokens) < len(new_tokens)  # the case is not trivial
    for t in ("0.01", "0.1", "1"):
        pair = both.coactive_fraction["expert1&expert2"][t]
        assert pair <= min(both.active_fraction["expert1"][t], both.active_fraction["expert2"][t])
        assert both.all_active_fraction[t] == pair
    json.dumps(both.to_dict())
    # Prompt + continuation: only continuation tokens are scored.
    cont = composition_diagnostics(ComposedDecoder(base, [expert], tok), ["hello"], [" world"])
    assert cont.n_positions == len(" world")
