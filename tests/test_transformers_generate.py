"""transformers' `model.generate(input_ids=...)` call on every candidate: token ids as
transformers returns them (EOS kept, padding after it, stop strings kept as transformers keeps
them), `return_dict_in_generate` / `output_scores`, `num_return_sequences` — checked against
transformers' own `generate` for one model, and by their properties for a composition."""

import pytest
import torch
from transformers import GenerationConfig

from mergelab.candidate import GenerationSettings
from mergelab.compose import ComposedDecoder
from mergelab.model_candidate import ModelCandidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm

PROMPTS = ["hello world", "ab", "the cat sat on"]


@pytest.fixture(scope="module")
def tok():
    tok = char_tokenizer()
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def models(tok):
    return [tiny_causal_lm(len(tok), seed=s, initializer_range=0.3) for s in range(3)]


def _hf(model, tok, enc, **kwargs):
    return model.generate(**enc, do_sample=False, pad_token_id=tok.pad_token_id, **kwargs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_ids_equal_transformers_with_eos_and_padding(models, tok, seed):
    """Model 1 ends its second row with EOS and model 2 its third (seen in their greedy
    output): transformers keeps the EOS and pads after it; so does the candidate."""
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ours = ModelCandidate(models[seed], tok).generate(**enc, max_new_tokens=30)
    expected = _hf(models[seed], tok, enc, max_new_tokens=30)
    assert ours.dtype == torch.long and torch.equal(ours, expected)
    if seed:
        assert (ours == tok.eos_token_id).any()


@pytest.mark.parametrize("stops", [["mm"], ["**", "c*"], ["m?m"]])
def test_stop_strings_keep_the_tokens_transformers_keeps(models, tok, stops):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=30, stop_strings=stops, do_sample=False, pad_token_id=tok.pad_token_id
    )
    candidate = ModelCandidate(models[0], tok)
    ours = candidate.generate(**enc, generation_config=config)
    expected = models[0].generate(**enc, generation_config=config, tokenizer=tok)
    assert torch.equal(ours, expected)
    # The text call: the same ids, and the text is their decoding cut before the stop string.
    for row, g in enumerate(candidate.generate(PROMPTS, config)):
        new = ours[row, enc["input_ids"].shape[1] :].tolist()
        n = len(g.token_ids)
        assert g.token_ids == new[:n] and set(new[n:]) <= {tok.pad_token_id}
        full = tok.decode(g.token_ids, skip_special_tokens=True)
        assert full.startswith(g.text)
        if g.finish_reason == "stop_string":
            assert any(full[len(g.text) :].startswith(s) for s in stops)
            assert not any(s in g.text for s in stops)
    assert any(g.finish_reason == "stop_string" for g in candidate.generate(PROMPTS, config))


def test_return_dict_scores_equal_transformers(models, tok):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ours = ModelCandidate(models[1], tok).generate(
        **enc,
        max_new_tokens=6,
        repetition_penalty=1.3,
        return_dict_in_generate=True,
        output_scores=True,
    )
    expected = _hf(
        models[1],
        tok,
        enc,
        max_new_tokens=6,
        repetition_penalty=1.3,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert torch.equal(ours.sequences, expected.sequences)
    assert len(ours.scores) == len(expected.scores) == 6
    for a, b in zip(ours.scores, expected.scores):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_composition_returns_ids_and_scores_of_its_distribution(models, tok):
    """A composition: the ids are those of the text call; greedy scores are its composed
    log-probs, whose argmax is each next token; num_return_sequences repeats each prompt."""
    composed = ComposedDecoder(models[0], models[1:], tok)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    width = enc["input_ids"].shape[1]
    out = composed.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        max_new_tokens=8,
        return_dict_in_generate=True,
        output_scores=True,
    )
    gens = composed.generate(PROMPTS, GenerationSettings(max_new_tokens=8))
    assert torch.equal(out.sequences[:, :width], enc["input_ids"])
    for row, g in enumerate(gens):
        new = out.sequences[row, width:].tolist()
        assert new[: len(g.token_ids)] == g.token_ids
    for step, scores in enumerate(out.scores):
        assert scores.shape == (3, len(tok))
        torch.testing.assert_close(scores.exp().sum(-1), torch.ones(3))
        chosen = out.sequences[:, width + step]
        live = chosen != tok.pad_token_id
        assert torch.equal(scores.argmax(-1)[live], chosen[live])
    sampled = composed.generate(
        **enc, max_new_tokens=5, do_sample=True, seed=3, num_return_sequences=2
    )
    assert sampled.shape[0] == 6
    assert torch.equal(sampled[:, :width], enc["input_ids"].repeat_interleave(2, dim=0))
    assert not torch.equal(sampled[0], sampled[1])  # two samples of one prompt differ
    again = composed.generate(
        **enc, max_new_tokens=5, do_sample=True, seed=3, num_return_sequences=2
    )
    assert torch.equal(sampled, again)


def test_conventions_are_refused_by_name_where_they_cannot_apply(models, tok):
    candidate = ModelCandidate(models[0], tok)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="num_return_sequences"):
        candidate.generate(**enc, num_return_sequences=2)
    with pytest.raises(ValueError, match="return_dict_in_generate"):
        candidate.generate(PROMPTS, max_new_tokens=2, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="output_logits"):
        candidate.generate(**enc, output_logits=True)
    # the text call takes num_return_sequences too: n Generations per prompt, prompt by prompt
    gens = candidate.generate(PROMPTS, max_new_tokens=3, do_sample=True, num_return_sequences=2)
    assert [g.prompt for g in gens] == [p for p in PROMPTS for _ in range(2)]
    assert candidate.generation_config.to_dict() == models[0].generation_config.to_dict()


def test_a_stop_string_begun_in_the_prompt_stops_as_each_convention_does(models, tok):
    """The stop string is the prompt's last character followed by the first generated one.
    transformers' StopStringCriteria reads the prompt and the new tokens together, so
    model.generate stops after one token: the ids call does the same. lm-eval's `until` looks
    at the generated continuation only (its hf model's criterion and its cut): the text call,
    and the bridge's generate_until, go on and equal lm-eval's hf model."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from mergelab.eval.lm_eval_bridge import MergelabLM

    candidate = ModelCandidate(models[0], tok)
    prompt = PROMPTS[2]
    first = candidate.generate([prompt], GenerationSettings(max_new_tokens=1))[0].text
    stop = prompt[-1] + first
    enc = tok([prompt], return_tensors="pt")
    config = GenerationConfig(
        max_new_tokens=12, stop_strings=[stop], do_sample=False, pad_token_id=tok.pad_token_id
    )
    expected = models[0].generate(**enc, generation_config=config, tokenizer=tok)
    assert expected.shape[1] == enc["input_ids"].shape[1] + 1  # transformers stopped at once
    assert torch.equal(candidate.generate(**enc, generation_config=config), expected)

    [g] = candidate.generate([prompt], config)
    assert len(g.token_ids) > 1 and g.text.startswith(first)  # not stopped by the prompt
    request = [Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 12}), 0)]
    theirs = HFLM(pretrained=models[0], tokenizer=tok, batch_size=1).generate_until(request)
    assert MergelabLM(candidate).generate_until(request) == theirs == [g.text]
    assert len(theirs[0]) > 1
