"""transformers' generation conventions on mergelab candidates: a GenerationConfig (and keyword
arguments), every model's generation_config EOS ids, LogitsProcessorList / StoppingCriteriaList on
the composed distribution, min_new_tokens, repetition_penalty, token-id prompts — checked
against transformers' own ``generate`` for one model."""

import copy

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from mergelab.candidate import GenerationSettings, generation_settings
from mergelab.compose import ComposedDecoder
from mergelab.compose.decoding import warp_logprobs
from mergelab.model_candidate import ModelCandidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm

PROMPTS = ["hello world", "ab", "the cat sat on"]


@pytest.fixture(scope="module")
def tok():
    tok = char_tokenizer()
    tok.padding_side = "left"  # what transformers' generate expects of a decoder-only batch
    return tok


@pytest.fixture(scope="module")
def models(tok):
    return [tiny_causal_lm(len(tok), seed=s, initializer_range=0.3) for s in range(3)]


def _batch(tok, prompts=PROMPTS):
    enc = tok(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _hf_new_tokens(model, ids, mask, config, **kwargs):
    """transformers' generated ids per row, EOS and the padding after it removed."""
    out = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config, pad_token_id=0, **kwargs
    )
    eos = config.eos_token_id if config.eos_token_id is not None else model.config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        kept = []
        for t in row:
            if t in eos:
                break
            kept.append(t)
        rows.append(kept)
    return rows


# ---------------------------------------------------------------- GenerationConfig ↔ transformers


@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.8])
def test_greedy_generation_config_matches_transformers(models, tok, penalty):
    config = GenerationConfig(max_new_tokens=12, do_sample=False, repetition_penalty=penalty)
    ids, mask = _batch(tok)
    expected = _hf_new_tokens(models[0], ids, mask, config)
    ours = ModelCandidate(models[0], tok).generate(ids, config, attention_mask=mask)
    assert [g.token_ids for g in ours] == expected
    # Strings give the same as the ids they encode to.
    assert [
        g.token_ids for g in ModelCandidate(models[0], tok).generate(PROMPTS, config)
    ] == expected


class Recorder(LogitsProcessor):
    """Records the scores it is given (after the built-in processors, before the warpers)."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append((input_ids.clone(), scores.clone()))
        return scores


class Follow(LogitsProcessor):
    """Forces transformers onto a given continuation (applied after the Recorder)."""

    def __init__(self, prompt_len, tokens):
        self.prompt_len, self.tokens = prompt_len, tokens

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1] - self.prompt_len
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.tokens[t]] = 0.0
        return forced


def test_sampling_generation_config_has_transformers_distribution_at_every_step(models, tok):
    """Sampled tokens differ from transformers' (different random draws, by design); the
    distribution each token is drawn from is the same: along mergelab's sampled path, the scores
    after repetition penalty equal transformers', and so do the top-k/top-p nuclei."""
    config = GenerationConfig(max_new_tokens=10, do_sample=True, top_p=0.8, repetition_penalty=1.2)
    ids, mask = _batch(tok, PROMPTS[:1])
    ours_seen = Recorder()
    [gen] = ModelCandidate(models[0], tok).generate(
        ids, config, logits_processor=LogitsProcessorList([ours_seen]), seed=3
    )
    assert gen.finish_reason == "length" and len(gen.token_ids) == 10
    theirs_seen = Recorder()
    follow = Follow(ids.shape[1], gen.token_ids)
    models[0].generate(
        input_ids=ids,
        attention_mask=mask,
        generation_config=config,
        logits_processor=LogitsProcessorList([theirs_seen, follow]),
        pad_token_id=0,
    )
    assert len(ours_seen.seen) == len(theirs_seen.seen) == 10
    top_k, top_p = TopKLogitsWarper(50), TopPLogitsWarper(0.8)
    for (our_ids, ours), (their_ids, theirs) in zip(ours_seen.seen, theirs_seen.seen):
        assert torch.equal(our_ids, their_ids)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        nucleus = torch.isfinite(warp_logprobs(ours, 1.0, 50, 0.8))
        assert torch.equal(nucleus, torch.isfinite(top_p(their_ids, top_k(their_ids, theirs))))
    # Seeded: the same call gives the same tokens.
    again = ModelCandidate(models[0], tok).generate(ids, config, seed=3)
    assert again[0].token_ids == gen.token_ids


def test_the_mapping_from_generation_config(models):
    s = generation_settings(
        GenerationConfig(
            max_new_tokens=5, do_sample=True, top_p=0.9, repetition_penalty=1.2, eos_token_id=[2, 5]
        )
    )
    assert (s.max_new_tokens, s.do_sample, s.top_p, s.repetition_penalty) == (5, True, 0.9, 1.2)
    assert s.top_k == 50 and s.eos_token_ids == (2, 5)  # transformers' default top-k
    greedy = generation_settings(GenerationConfig(temperature=0.3), max_new_tokens=4, seed=1)
    assert (greedy.do_sample, greedy.temperature, greedy.max_new_tokens) == (False, 1.0, 4)
    # A model's own generation_config is a valid argument (max_length beside max_new_tokens).
    generation_settings(models[0].generation_config, max_new_tokens=3, max_length=99)
    for field, value in [
        ("num_beams", 4),
        ("typical_p", 0.5),
        ("no_repeat_ngram_size", 2),
        ("max_length", 30),
    ]:
        with pytest.raises(ValueError, match=field):
            generation_settings(GenerationConfig(**{field: value}))
    with pytest.raises(ValueError, match="unknown generation arguments"):
        generation_settings(None, beams=3)
    assert generation_settings(GenerationSettings(), max_new_tokens=3).max_new_tokens == 3


# ---------------------------------------------------------------- EOS ids


def _first_greedy_token(candidate, prompt):
    return candidate.generate([prompt], GenerationSettings(max_new_tokens=1))[0].token_ids[0]


def test_every_eos_id_of_a_models_generation_config_stops_a_single_model(models, tok):
    model = copy.deepcopy(models[0])
    first = _first_greedy_token(ModelCandidate(model, tok), PROMPTS[0])
    assert first != tok.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, first]  # e.g. an end-of-turn id
    candidate = ModelCandidate(model, tok)
    assert candidate.eos_token_ids == [tok.eos_token_id, first]
    [gen] = candidate.generate([PROMPTS[0]], GenerationSettings(max_new_tokens=8))
    assert gen.finish_reason == "eos" and gen.token_ids == []
    # transformers stops there too.
    ids, mask = _batch(tok, PROMPTS[:1])
    config = GenerationConfig(max_new_tokens=8, eos_token_id=[tok.eos_token_id, first])
    assert _hf_new_tokens(model, ids, mask, config) == [[]]


def test_a_composition_stops_on_the_union_of_its_models_eos_ids(models, tok):
    experts = [copy.deepcopy(m) for m in models[1:]]
    composed = ComposedDecoder(models[0], experts, tok)
    first = _first_greedy_token(composed, PROMPTS[1])
    # Only the second expert declares it (say, its end-of-turn token): the composition stops.
    experts[1].generation_config.eos_token_id = [tok.eos_token_id, first]
    composed = ComposedDecoder(models[0], experts, tok)
    assert composed.eos_token_ids == [tok.eos_token_id, first]
    [gen] = composed.generate([PROMPTS[1]], GenerationSettings(max_new_tokens=8))
    assert gen.finish_reason == "eos" and gen.token_ids == []
    # Per call, eos_token_id replaces the candidate's ids (as in transformers).
    [gen] = composed.generate([PROMPTS[1]], max_new_tokens=8, eos_token_id=tok.eos_token_id)
    assert gen.token_ids[0] == first
    # An explicit eos_token_ids argument still overrides the models'.
    fixed = ComposedDecoder(models[0], experts, tok, eos_token_ids=[tok.eos_token_id])
    assert fixed.eos_token_ids == [tok.eos_token_id]


def test_min_new_tokens_holds_eos_back(models, tok):
    model = copy.deepcopy(models[0])
    first = _first_greedy_token(ModelCandidate(model, tok), PROMPTS[2])
    model.generation_config.eos_token_id = [first]
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=4, eos_token_id=[first])
    ids, mask = _batch(tok)
    ours = ModelCandidate(model, tok).generate(ids, config, attention_mask=mask)
    assert [g.token_ids for g in ours] == _hf_new_tokens(model, ids, mask, config)
    assert all(len(g.token_ids) >= 4 for g in ours)


# ---------------------------------------------------------------- processors and criteria


class Ban(LogitsProcessor):
    def __init__(self, token):
        self.token = token
        self.lengths = []

    def __call__(self, input_ids, scores):
        self.lengths.append(input_ids.shape[1])
        scores = scores.clone()
        scores[:, self.token] = float("-inf")
        return scores


class AfterNewTokens(StoppingCriteria):
    def __init__(self, prompt_len, n):
        self.prompt_len, self.n = prompt_len, n

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[1] - self.prompt_len >= self.n
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool)


def test_logits_processors_and_stopping_criteria_act_on_the_composition(models, tok):
    composed = ComposedDecoder(models[0], models[1:], tok)
    plain = composed.generate(PROMPTS, GenerationSettings(max_new_tokens=6))
    banned = plain[0].token_ids[0]
    ban = Ban(banned)
    ids, mask = _batch(tok)
    gens = composed.generate(
        ids,
        GenerationSettings(max_new_tokens=6),
        attention_mask=mask,
        logits_processor=LogitsProcessorList([ban]),
    )
    assert all(banned not in g.token_ids for g in gens)
    assert ban.lengths[:3] == [ids.shape[1], ids.shape[1] + 1, ids.shape[1] + 2]  # prompt + new
    # Log-probs stay the composition's own (processors only choose tokens).
    full = torch.tensor([tok(PROMPTS[1])["input_ids"] + gens[1].token_ids])
    n = len(gens[1].token_ids)
    own = composed.token_logprobs(full)[0, -n - 1 : -1].gather(-1, full[0, -n:, None])[:, 0]
    assert gens[1].logprobs == pytest.approx(own.tolist(), abs=1e-4)
    stop = StoppingCriteriaList([AfterNewTokens(ids.shape[1], 3)])
    gens = composed.generate(
        ids, GenerationSettings(max_new_tokens=6), attention_mask=mask, stopping_criteria=stop
    )
    assert [len(g.token_ids) for g in gens] == [3, 3, 3]
    assert {g.finish_reason for g in gens} == {"stopping_criteria"}


def test_token_id_prompts_equal_string_prompts(models, tok):
    composed = ComposedDecoder(models[0], models[1:], tok)
    settings = GenerationSettings(max_new_tokens=5, do_sample=True, seed=1)
    by_text = composed.generate(PROMPTS, settings)
    ids, mask = _batch(tok)
    by_tensor = composed.generate(ids, settings, attention_mask=mask)
    by_lists = composed.generate([tok(p)["input_ids"] for p in PROMPTS], settings)
    for a, b, c in zip(by_text, by_tensor, by_lists):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.prompt == b.prompt == c.prompt
    with pytest.raises(ValueError, match="attention_mask"):
        composed.generate(ids, settings, attention_mask=mask[:1])


def test_speculative_decoding_takes_a_generation_config_and_refuses_processors(models, tok):
    from mergelab.compose import SpeculativeDecoder

    composed = ComposedDecoder(models[0], models[1:], tok)
    fast = SpeculativeDecoder(composed)
    config = GenerationConfig(max_new_tokens=6)
    assert [g.token_ids for g in fast.generate(PROMPTS, config)] == [
        g.token_ids for g in composed.generate(PROMPTS, config)
    ]
    with pytest.raises(NotImplementedError, match="repetition_penalty"):
        fast.generate(PROMPTS, GenerationConfig(max_new_tokens=6, repetition_penalty=1.2))
