"""The shared decoding loop: caches vs recomputation, batching, sampling, EOS, stop strings,
scores, vocabulary checks — on tiny GPT-2 and Llama models with a character tokenizer."""

import copy
import json

import pytest
import torch
from torch import nn

from mergelab.candidate import Candidate, GenerationSettings
from mergelab.compose import ComposedDecoder, Composition
from mergelab.model_candidate import ModelCandidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm

PROMPTS = ["hello world", "ab", "the cat sat"]
ATOL = 2e-5  # cached vs recomputed attention differ in summation order only


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _models(tok, arch):
    return [
        tiny_causal_lm(len(tok), architecture=arch, seed=s, initializer_range=0.3) for s in range(3)
    ]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def both_archs(request, tok):
    return _models(tok, request.param)


@pytest.fixture(scope="module")
def models(tok):
    return _models(tok, "gpt2")


def _composed(models, tok, **kw):
    return ComposedDecoder(models[0], models[1:], tok, expert_names=["math", "code"], **kw)


def _same(gens_a, gens_b, atol=ATOL):
    for a, b in zip(gens_a, gens_b):
        assert (
            a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        )
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol)
        if a.component_logprobs is not None:
            assert torch.allclose(
                torch.tensor(a.component_logprobs), torch.tensor(b.component_logprobs), atol=atol
            )


@pytest.mark.parametrize("do_sample", [False, True])
def test_cached_equals_full_prefix_recomputation(both_archs, tok, do_sample):
    models = both_archs
    settings = GenerationSettings(
        max_new_tokens=10,
        do_sample=do_sample,
        seed=7,
        top_k=20,
        top_p=0.95,
        temperature=1.3,
        return_component_logprobs=True,
    )
    cached = _composed(models, tok).generate(PROMPTS, settings)
    naive = _composed(models, tok, use_cache=False).generate(PROMPTS, settings)
    _same(cached, naive)
    assert all(len(g.token_ids) == 10 for g in cached)  # nothing stopped early: all steps compared
    single = ModelCandidate(models[1], tok).generate(PROMPTS, settings)
    _same(single, ModelCandidate(models[1], tok, use_cache=False).generate(PROMPTS, settings))


@pytest.mark.parametrize("do_sample", [False, True])
def test_batched_equals_unbatched(both_archs, tok, do_sample):
    models = both_archs
    decoder = _composed(models, tok)
    settings = GenerationSettings(max_new_tokens=10, do_sample=do_sample, seed=3, batch_size=4)
    batched = decoder.generate(PROMPTS, settings)
    # Batch size 1: every prompt decoded alone, unpadded; prompt i still draws from seed (3, i).
    one_by_one = decoder.generate(
        PROMPTS, GenerationSettings(**{**settings.to_dict(), "batch_size": 1})
    )
    _same(batched, one_by_one)


def test_model_candidate_matches_transformers_generate(models, tok):
    model = models[0]
    candidate = ModelCandidate(model, tok, name="base")
    assert isinstance(candidate, Candidate)
    ours = candidate.generate(PROMPTS[:1], GenerationSettings(max_new_tokens=10))[0]
    ids = torch.tensor([tok(PROMPTS[0])["input_ids"]])
    theirs = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    generated = theirs[0, ids.shape[1] :].tolist()
    if tok.eos_token_id in generated:
        generated = generated[: generated.index(tok.eos_token_id)]
    assert ours.token_ids == generated


def test_composed_distribution_sums_to_one_at_every_step(models, tok):
    decoder = _composed(models, tok, eos_policy="base")
    gens = decoder.generate(PROMPTS, GenerationSettings(max_new_tokens=8))
    sequences = [tok(p)["input_ids"] + g.token_ids for p, g in zip(PROMPTS, gens)]
    from mergelab.compose.decoding import left_pad

    ids, mask = left_pad(sequences, tok.pad_token_id)
    lp = decoder.token_logprobs(ids, mask)
    assert lp.dtype == torch.float32 and lp.shape == (*ids.shape, len(tok))
    assert torch.allclose(lp.exp().sum(-1), torch.ones(ids.shape), atol=1e-5)
    # Teacher forcing reproduces the log-probs reported during generation.
    for row, g in enumerate(gens):
        n = len(g.token_ids)
        got = lp[row, -n - 1 : -1].gather(-1, ids[row, -n:, None])[:, 0]
        assert torch.allclose(got, torch.tensor(g.logprobs), atol=ATOL)


def test_one_expert_weight_one_equals_the_expert_and_identical_expert_is_a_no_op(models, tok):
    settings = GenerationSettings(max_new_tokens=10, do_sample=True, seed=1)
    expert_alone = ModelCandidate(models[1], tok).generate(PROMPTS, settings)
    composed = ComposedDecoder(models[0], [models[1]], tok, weights=[1.0]).generate(
        PROMPTS, settings
    )
    _same(composed, expert_alone)
    base_alone = ModelCandidate(models[0], tok).generate(PROMPTS, settings)
    with_copy = ComposedDecoder(models[0], [copy.deepcopy(models[0])], tok).generate(
        PROMPTS, settings
    )
    _same(with_copy, base_alone)


def test_score_is_sum_of_generation_logprobs(models, tok):
    decoder = _composed(models, tok)
    gens = decoder.generate(PROMPTS, GenerationSettings(max_new_tokens=6))
    scores = decoder.score(PROMPTS, [g.text for g in gens])
    assert scores == pytest.approx([sum(g.logprobs) for g in gens], abs=1e-4)
    assert decoder.score(["ab"], [""]) == [0.0]


def test_eos_and_stop_strings(models, tok):
    decoder = _composed(models, tok)
    free = decoder.generate(PROMPTS[:2], GenerationSettings(max_new_tokens=10))
    first = free[0].token_ids[0]
    # Declaring the first generated token an EOS ends generation before any token is kept.
    stopped = _composed(models, tok, eos_token_ids=[first]).generate(
        PROMPTS[:1], GenerationSettings(max_new_tokens=10)
    )[0]
    assert stopped.token_ids == [] and stopped.finish_reason == "eos" and stopped.text == ""
    stop = free[1].text[3:5]
    cut = decoder.generate(
        PROMPTS[1:2], GenerationSettings(max_new_tokens=10, stop_strings=(stop,))
    )[0]
    assert cut.finish_reason == "stop_string"
    assert cut.text == free[1].text[: free[1].text.index(stop)]
    assert len(cut.token_ids) == len(cut.logprobs) <= 5


@pytest.mark.parametrize("policy", ["base", "max", "min", "most_confident"])
def test_per_call_eos_ids_reach_the_eos_policy(models, tok, policy):
    """A call's ``eos_token_ids`` is what the EOS policy treats as EOS, exactly as if the
    decoder had been built with those ids (log-probs included, not only the stopping)."""
    call_eos = [tok.convert_tokens_to_ids("e")]
    settings = GenerationSettings(max_new_tokens=10, eos_token_ids=call_eos)
    per_call = _composed(models, tok, eos_policy=policy).generate(PROMPTS, settings)
    built = _composed(models, tok, eos_policy=policy, eos_token_ids=call_eos)
    _same(per_call, built.generate(PROMPTS, GenerationSettings(max_new_tokens=10)))
    default = _composed(models, tok, eos_policy=policy).generate(
        PROMPTS, GenerationSettings(max_new_tokens=10)
    )
    assert any(a.logprobs != b.logprobs for a, b in zip(per_call, default))


class LogitsOnly(nn.Module):
    """A plain module that returns logits and no cache (forces prefix recomputation)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids).logits


def test_module_returning_logits_without_cache(models, tok):
    settings = GenerationSettings(max_new_tokens=8, batch_size=1)
    ours = ModelCandidate(LogitsOnly(models[0]), tok, name="plain").generate(PROMPTS, settings)
    _same(ours, ModelCandidate(models[0], tok).generate(PROMPTS, settings))


def test_vocabulary_checks(tok):
    other = char_tokenizer("zyxwvutsrqponmlkjihgfedcba0123456789 .,:;=+-*/()?!\n")
    base = tiny_causal_lm(len(tok), seed=0)
    with pytest.raises(ValueError, match="maps tokens differently"):
        ComposedDecoder(base, [base], tok, tokenizers=[tok, other])
    smaller = char_tokenizer("abc")
    with pytest.raises(ValueError, match="tokenizer of expert1 has"):
        ComposedDecoder(base, [base], tok, tokenizers=[tok, smaller])
    too_small = tiny_causal_lm(len(tok) - 1, seed=0)
    with pytest.raises(ValueError, match="emits .* logits but the tokenizer has"):
        ComposedDecoder(base, [too_small], tok)
    # A padded output layer is allowed (identical tokenizers) and truncated to the tokenizer.
    padded = tiny_causal_lm(len(tok) + 10, seed=1, initializer_range=0.3)
    decoder = ComposedDecoder(base, [padded], tok, tokenizers=[tok, tok])
    ids = torch.tensor([tok("hello")["input_ids"]])
    lp = decoder.token_logprobs(ids)
    assert lp.shape[-1] == len(tok)
    expected = torch.log_softmax(padded(ids).logits[..., : len(tok)], -1)
    single = ModelCandidate(padded, tok).token_logprobs(ids)
    assert torch.allclose(single, expected, atol=1e-5)


def test_composition_and_models_must_match(models, tok):
    with pytest.raises(ValueError, match="missing"):
        ComposedDecoder(models[0], models[1:], tok, composition=Composition.paper("base", ["math"]))
    poe = ComposedDecoder(
        None, models[1:], tok, composition=Composition.product_of_experts(["expert1", "expert2"])
    )
    out = poe.generate(["ab"], GenerationSettings(max_new_tokens=3))[0]
    # Greedy product of experts: each token is the argmax of log_softmax(Σ_i log p_i).
    ids = poe.encode_prompt("ab")
    for token in out.token_ids:
        x = torch.tensor([ids])
        scores = sum(torch.log_softmax(m(x).logits[0, -1].float(), -1) for m in models[1:])
        assert token == int(torch.log_softmax(scores, -1).argmax())
        ids.append(token)
    assert len(out.token_ids) == 3 or out.finish_reason != "length"
    with pytest.raises(ValueError, match="needs a composition with a base"):
        ComposedDecoder(
            None,
            models[1:],
            tok,
            composition=Composition.product_of_experts(["expert1", "expert2"]),
            eos_policy="base",
        )
    proxy = ComposedDecoder.from_models(
        {"large": models[0], "small_tuned": models[1], "small_base": models[2]},
        Composition.proxy_tuning("large", "small_tuned", "small_base"),
        tok,
    )
    d = proxy.describe()
    json.dumps(d)  # JSON-able: the evaluation harness keys its cache on it
    assert d["composition"]["formula"] == "large + 1.0·(small_tuned − small_base)"
    assert set(d["models"]) == {"large", "small_tuned", "small_base"}
    assert (
        d["models"]["large"]["parameter_checksum"]
        != d["models"]["small_tuned"]["parameter_checksum"]
    )
