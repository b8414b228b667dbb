"""Speculative composition decodes exactly the composition: greedy token for token, sampling in
distribution (chi-square against enumeration), whatever the draft; caches roll back at every
position of a block, in batches whose rows accept different numbers of tokens."""

import copy
import json
import math
from collections import Counter

import pytest
import torch
from peft import LoraConfig, get_peft_model
from scipy.stats import chisquare

from mergelab.candidate import Candidate, GenerationSettings
from mergelab.compose import ComposedDecoder, Composition, SpeculativeDecoder
from mergelab.compose.decoding import warp_logprobs
from mergelab.compose.speculative import (
    _PAYING_RUN,
    _PROBE_EVERY,
    _PROBE_GAMMA,
    _REMEASURE_EVERY,
    _Schedule,
    best_gamma,
    task_arithmetic_draft,
    worth_drafting,
)
from mergelab.merge import merge_models
from mergelab.model_candidate import ModelCandidate
from mergelab.tiny import char_tokenizer, tiny_causal_lm

PROMPTS = ["hello world", "ab", "the cat sat on", "x"]  # different lengths: left padding
ATOL = 1e-4  # a block forward sums in another order than one-token steps
SIGNIFICANCE = 1e-3  # chi-square tests: reject "same distribution" below this p-value


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _perturbed(model, scale: float, seed: int):
    """An "expert": every weight moved by ``scale`` of its own standard deviation, at random."""
    expert = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in expert.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1))
    return expert.eval()


def _models(vocab: int, arch: str, scale: float = 0.15):
    base = tiny_causal_lm(vocab, architecture=arch, seed=0, initializer_range=0.3)
    return [base, _perturbed(base, scale, 1), _perturbed(base, scale, 2)]


def _lora(base, arch: str, seed: int, scale: float = 0.15):
    targets = ["c_attn", "c_fc"] if arch == "gpt2" else ["q_proj", "v_proj", "up_proj"]
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        lora_dropout=0.0,
        fan_in_fan_out=(arch == "gpt2"),
        init_lora_weights=False,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    return peft_model.eval()


def _same(got, want, atol=ATOL):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.text, a.finish_reason) == (b.text, b.finish_reason)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol)
        if a.component_logprobs is not None and b.component_logprobs is not None:
            assert torch.allclose(
                torch.tensor(a.component_logprobs), torch.tensor(b.component_logprobs), atol=atol
            )


def _rate(gens) -> float:
    drafted = sum(g.cost["drafted_tokens"] for g in gens)
    return sum(g.cost["accepted_tokens"] for g in gens) / drafted


# ---------------------------------------------------------------------------- greedy: identical


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("experts", ["full", "lora"])
def test_greedy_equals_plain_composition_over_long_generations(tok, arch, experts):
    if experts == "full":
        base, *full = _models(len(tok), arch)
        composed = ComposedDecoder(base, full, tok, weights=[1.0, 0.8], eos_token_ids=[])
    else:
        base = tiny_causal_lm(len(tok), architecture=arch, seed=0, initializer_range=0.3)
        adapters = [_lora(base, arch, seed) for seed in (1, 2)]
        composed = ComposedDecoder.from_lora(
            base, adapters, tok, weights=[1.0, 0.8], eos_token_ids=[]
        )
    settings = GenerationSettings(
        max_new_tokens=200, batch_size=4, return_component_logprobs=True
    )  # no EOS: every row decodes all 200 tokens
    plain = composed.generate(PROMPTS, settings)
    speculative = SpeculativeDecoder(composed, gamma=4)
    got = speculative.generate(PROMPTS, settings)
    _same(got, plain)
    assert all(len(g.token_ids) == 200 for g in got)
    assert 0.05 < _rate(got) < 0.95  # drafts were accepted and rejected: both paths ran
    # Cost: forward calls (every model, the draft's too) per decoded position.
    assert plain[0].cost["model_evaluations_per_token"] == (3 if experts == "full" else 1)
    assert got[0].cost["model_evaluations_per_token"] == pytest.approx(
        (got[0].cost["verify_forward_passes"] + got[0].cost["draft_forward_passes"]) * 4 / 200
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_equals_plain_composition_slow_long(tok, arch):
    """The same at 600 tokens, 8 prompts, adaptive γ up to 12, EOS on, and a bad draft."""
    base = tiny_causal_lm(
        len(tok), architecture=arch, seed=0, initializer_range=0.3, max_positions=1024
    )
    full = [_perturbed(base, 0.1, s) for s in (1, 2)]
    composed = ComposedDecoder(base, full, tok)
    prompts = PROMPTS + ["a b c d", "0123", "q", "zzz top"]
    settings = GenerationSettings(max_new_tokens=600, batch_size=8)
    plain = composed.generate(prompts, settings)
    unrelated = tiny_causal_lm(len(tok), architecture=arch, seed=7, max_positions=1024)
    for draft in (None, ModelCandidate(unrelated, tok)):
        got = SpeculativeDecoder(composed, draft, gamma=4, max_gamma=12).generate(prompts, settings)
        _same(got, plain)


def _compositions(tok):
    base, e1, e2 = _models(len(tok), "llama")
    large = tiny_causal_lm(
        len(tok), architecture="llama", seed=5, hidden_size=48, initializer_range=0.3
    )
    mask = torch.zeros(len(tok), dtype=torch.bool)
    mask[tok.convert_tokens_to_ids(list("aeiou "))] = True
    return {
        "weights": ComposedDecoder(base, [e1, e2], tok, weights=[1.5, -0.5]),
        "temperature": ComposedDecoder(
            base,
            [e1, e2],
            tok,
            composition=Composition.weighted("base", ["expert1", "expert2"], temperature=0.7),
        ),
        "cfg": ComposedDecoder(
            base,
            [e1],
            tok,
            composition=Composition.classifier_free_guidance("base", "expert1", 1.5),
        ),
        "dexperts": ComposedDecoder.from_models(
            {"base": base, "expert": e1, "anti": e2},
            Composition.dexperts("base", "expert", "anti", 0.5),
            tok,
        ),
        "product_of_experts": ComposedDecoder(
            None, [e1, e2], tok, composition=Composition.product_of_experts(["expert1", "expert2"])
        ),
        "proxy_tuning": ComposedDecoder.from_models(
            {"large": large, "small_tuned": e1, "small_base": base},
            Composition.proxy_tuning("large", "small_tuned", "small_base"),
            tok,
        ),
        "eos_base": ComposedDecoder(base, [e1, e2], tok, eos_policy="base"),
        "eos_max": ComposedDecoder(base, [e1, e2], tok, eos_policy="max"),
        "eos_min": ComposedDecoder(base, [e1, e2], tok, eos_policy="min"),
        "eos_most_confident": ComposedDecoder(base, [e1, e2], tok, eos_policy="most_confident"),
        "token_masks": ComposedDecoder(base, [e1, e2], tok, token_masks={"expert1": mask}),
        "one_model": ModelCandidate(e1, tok),  # classic speculative decoding of one model
    }


def test_every_composition_eos_policy_and_stop_strings(tok):
    settings = GenerationSettings(max_new_tokens=32, batch_size=4, return_component_logprobs=True)
    finish = Counter()
    for label, composed in _compositions(tok).items():
        if label == "proxy_tuning":  # no weight-space twin across shapes: say so, take a draft
            with pytest.raises(ValueError, match="pass draft"):
                SpeculativeDecoder(composed)
            draft = ModelCandidate(composed.runner.models["small_tuned"], tok)
        else:
            draft = None
        plain = composed.generate(PROMPTS, settings)
        got = SpeculativeDecoder(composed, draft, gamma=3).generate(PROMPTS, settings)
        _same(got, plain)
        finish.update(g.finish_reason for g in got)
        if label not in ("weights", "eos_max", "token_masks"):
            continue
        # Stop strings end rows mid-block exactly where plain decoding ends them.
        stop = next(g.text[2:4] for g in plain if len(g.text) >= 6)
        stopped = settings.__class__(**{**settings.to_dict(), "stop_strings": (stop,)})
        _same(
            SpeculativeDecoder(composed, draft, gamma=3).generate(PROMPTS, stopped),
            composed.generate(PROMPTS, stopped),
        )
    assert finish["eos"] and finish["length"]  # EOS inside a block was exercised


def test_per_call_eos_ids_reach_the_eos_policy(tok):
    """Speculative decoding with a call's own EOS ids equals plain decoding with them, for an
    EOS policy (which must then treat the call's ids as EOS in the verifier and the draft)."""
    composed = _compositions(tok)["eos_max"]
    settings = GenerationSettings(
        max_new_tokens=24, batch_size=4, eos_token_ids=[tok.convert_tokens_to_ids("e")]
    )
    _same(
        SpeculativeDecoder(composed, gamma=3).generate(PROMPTS, settings),
        composed.generate(PROMPTS, settings),
    )


def test_sliding_window_models_roll_back_one_row_at_a_time(tok):
    """Mistral-style sliding-window layers: crop keeps the window right (past recording), and
    rows are decoded alone since the window would count the holes of a batch."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=6,
        initializer_range=0.3,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=2,
    )
    base = MistralForCausalLM(config).eval()
    composed = ComposedDecoder(
        base, [_perturbed(base, 0.1, s) for s in (1, 2)], tok, eos_token_ids=[]
    )
    settings = GenerationSettings(max_new_tokens=40, batch_size=1)
    plain = composed.generate(PROMPTS[:3], settings)
    speculative = SpeculativeDecoder(composed, gamma=3)
    got = speculative.generate(PROMPTS[:3], GenerationSettings(max_new_tokens=40, batch_size=3))
    _same(got, plain)
    assert 0 < _rate(got) < 1  # past the window (6) with rollbacks


# ---------------------------------------------------------------------------- rollback


def _sabotage(lp: torch.Tensor, call: int, gamma: int, j: int | None) -> torch.Tensor:
    """Row r proposes the composition's *least* likely token at block position (j + r) % (γ+1)
    — never, for γ — and the composition's own choice everywhere else; j = None: always."""
    position = call % gamma
    rows = [r for r in range(lp.shape[0]) if j is None or (j + r) % (gamma + 1) == position]
    if not rows:
        return lp
    lp = lp.clone()
    worst = lp[rows].argmin(dim=-1)
    lp[rows] = float("-inf")
    lp[rows, worst] = 0.0
    return lp


class SabotagedComposition(ComposedDecoder):
    """A copy of the composition as a cached draft (always right), wrong where told."""

    def sabotage(self, gamma: int, j: int):
        self.gamma, self.j, self.calls = gamma, j, 0
        return self

    def compose(self, component_scores, **kwargs):
        lp = super().compose(component_scores, **kwargs)
        if lp.dim() == 2:  # a draft step (not teacher forcing)
            lp = _sabotage(lp, self.calls, self.gamma, self.j)
            self.calls += 1
        return lp


class SabotagedCandidate:
    """The same, through the Candidate protocol only (the draft path without a cache)."""

    def __init__(self, composed, gamma, j):
        self.composed, self.gamma, self.j, self.calls = composed, gamma, j, 0
        self.name, self.tokenizer = "sabotaged", composed.tokenizer

    def token_logprobs(self, input_ids, attention_mask=None):
        lp = self.composed.token_logprobs(input_ids, attention_mask)
        lp[:, -1] = _sabotage(lp[:, -1], self.calls, self.gamma, self.j)
        self.calls += 1
        return lp

    def generate(self, prompts, settings=None):
        raise NotImplementedError

    def score(self, prompts, continuations):
        raise NotImplementedError

    def describe(self):
        return {"type": "sabotaged", "j": self.j}


@pytest.mark.parametrize("setup", ["gpt2-full", "llama-full", "llama-lora"])
def test_rollback_at_every_block_position(tok, setup):
    arch, kind = setup.split("-")
    gamma = 3
    base, *experts = _models(len(tok), arch)
    if kind == "full":
        composed = ComposedDecoder(base, experts, tok, eos_token_ids=[])
    else:
        adapters = [_lora(base, arch, seed) for seed in (1, 2)]
        composed = ComposedDecoder.from_lora(base, adapters, tok, eos_token_ids=[])
        # The draft copy runs merged experts on its own modules (the fast path hooks `base`).
        experts = [copy.deepcopy(a).merge_and_unload().eval() for a in adapters]
        base = copy.deepcopy(base)
    settings = GenerationSettings(max_new_tokens=40, batch_size=4, return_component_logprobs=True)
    plain = composed.generate(PROMPTS, settings)
    by_length = sorted(range(len(PROMPTS)), key=lambda i: -len(PROMPTS[i]))  # generate's batching
    batch_rows = [by_length.index(i) for i in range(len(PROMPTS))]
    for j in range(gamma + 1):
        drafts = [SabotagedComposition(base, experts, tok, eos_token_ids=[]).sabotage(gamma, j)]
        if setup == "llama-full":  # the same through the protocol alone (no draft cache): slower
            copied = ComposedDecoder(base, experts, tok, eos_token_ids=[])
            drafts.append(SabotagedCandidate(copied, gamma, j))
        for draft in drafts:
            got = SpeculativeDecoder(composed, draft, gamma=gamma, adaptive=False).generate(
                PROMPTS, settings
            )
            _same(got, plain)
            for row, g in zip(batch_rows, got):
                # Row r rejects at position (j + r) % (γ+1) of every full block: the share of
                # drafts it accepts says where (the last, shorter blocks blur it a little).
                position = (j + row) % (gamma + 1)
                assert g.cost["acceptance_rate"] == pytest.approx(position / gamma, abs=0.12)


class WrongAtFirst(ComposedDecoder):
    """A copy of the composition as a draft that proposes the least likely token in its first
    ``wrong`` draft steps, then the composition's own choice (always accepted)."""

    def compose(self, component_scores, **kwargs):
        lp = super().compose(component_scores, **kwargs)
        if lp.dim() == 2:  # a draft step
            self.calls += 1
            if self.calls <= self.wrong:
                return _sabotage(lp, 0, 1, None)
        return lp


@pytest.mark.parametrize("wrong", [6, 8])
def test_falls_back_to_plain_steps_and_returns_when_drafts_pay(tok, wrong):
    """Drafts wrong at first: a few blocks, then plain steps; probes of one draft after 8 plain
    steps (then 16, 32: each failed probe doubles the wait); once the draft is right, drafting
    again. The
    output is plain composition's throughout, token for token."""
    base, *experts = _models(len(tok), "llama")
    composed = ComposedDecoder(base, experts, tok, eos_token_ids=[])
    settings = GenerationSettings(max_new_tokens=120, batch_size=1)
    plain = composed.generate(PROMPTS[:1], settings)
    draft = WrongAtFirst(base, experts, tok, eos_token_ids=[])
    draft.wrong, draft.calls = wrong, 0
    # cost_ratio fixed: γ depends only on the acceptances, so the schedule is known.
    got = SpeculativeDecoder(composed, draft, gamma=4, cost_ratio=3.0).generate(
        PROMPTS[:1], settings
    )
    _same(got, plain)
    cost = got[0].cost
    # γ = 4, 1, 1 rejected (6 draft steps), then plain: 8 steps, a probe (1 draft), 16, a probe,
    # 32, …
    waits = [8] if wrong == 6 else [8, 16, 32]
    # (+ 1 where the call's last token is left alone: a block of no drafts, a plain step)
    assert sum(waits) <= cost["plain_steps"] <= sum(waits) + 1
    blocks_before = 3 + sum(waits) + len(waits)  # the last probe is accepted
    assert cost["drafted_tokens"] - cost["accepted_tokens"] == wrong  # then every draft accepted
    assert cost["blocks"] < blocks_before + (120 - blocks_before) / 3  # long blocks again


def test_plain_steps_in_a_batch_keep_every_row_exact(tok):
    """Rows of a batch switch together between drafted blocks and plain steps (the draft catches
    up on the plain steps' tokens in one forward), greedy and with stop strings and EOS."""
    base, *experts = _models(len(tok), "llama")
    composed = ComposedDecoder(base, experts, tok, weights=[1.0, 0.7])
    draft = WrongAtFirst(base, experts, tok)
    for settings in (
        GenerationSettings(max_new_tokens=80, batch_size=4, return_component_logprobs=True),
        GenerationSettings(max_new_tokens=80, batch_size=4, stop_strings=("e ",)),
    ):
        draft.wrong, draft.calls = 10, 0
        got = SpeculativeDecoder(composed, draft, cost_ratio=3.0).generate(PROMPTS, settings)
        _same(got, composed.generate(PROMPTS, settings))
        assert all(g.cost["plain_steps"] > 0 for g in got if len(g.token_ids) > 20)


def _run_schedule(s, blocks: int, accept, seconds) -> list[int]:
    """Drive ``s`` as the decoder does for ``blocks`` decisions; ``accept(γ)`` → accepted
    drafts, ``seconds(γ)`` → a block's seconds. Returns each decision's γ, a run of plain steps
    (``s.plain_steps()`` of them, timed together) as that many zeros."""
    gammas = []
    for _ in range(blocks):
        g = s.gamma
        if g == 0:
            n = s.plain_steps()
            gammas += [0] * n
            s.update(0, 0, 0, n * seconds(0), steps=n)
            continue
        gammas.append(g)
        n = accept(g)
        s.update(g, n, int(n < g), seconds(g))
    return gammas


def _probe_waits(gammas: list[int]) -> list[int]:
    drafted = [i for i, g in enumerate(gammas) if g]
    return [b - a - 1 for a, b in zip(drafted, drafted[1:]) if b - a > 1]


def test_schedule_measures_costs_falls_back_and_probes():
    """With measured costs (the default), the first block is a plain step (P), the next ones draft
    (D from a block's seconds); no acceptance → plain steps, probes after waits that double up
    to _PROBE_EVERY[1] plain steps; full acceptance → drafting, with one plain step every so
    often to keep P current."""
    plain, per_token = 1.0, 0.3  # seconds: P / D ≈ 3.3

    def seconds(g):
        return plain + g * per_token

    s = _Schedule(4, True, 8, None)
    assert s.gamma == 0 and s.plain_steps() == 1  # the first block measures P
    s.update(0, 0, 0, plain)
    gammas = _run_schedule(s, 60, lambda g: 0, seconds)  # every draft rejected
    drafted = [i for i, g in enumerate(gammas) if g]
    assert gammas[0] == 4 and max(gammas[1:]) == _PROBE_GAMMA  # then plain steps and probes
    assert drafted[3] > 8  # at most 3 blocks before the first plain run
    waits = _probe_waits(gammas)
    doubling = [8 * 2**i for i in range(7)]
    assert doubling[-1] == _PROBE_EVERY[1]
    assert waits[: len(doubling)] == doubling and set(waits[len(doubling) :]) == {_PROBE_EVERY[1]}
    assert {gammas[i] for i in drafted[-3:]} == {_PROBE_GAMMA}  # probes draft one token
    # The draft turns right: the next probe brings drafting back at once (the counts of long
    # ago have aged), however long the plain run before it.
    gammas = _run_schedule(s, 3, lambda g: g, seconds)
    probe = next(i for i, x in enumerate(gammas) if x)
    assert probe <= _PROBE_EVERY[1]
    assert gammas[probe] == _PROBE_GAMMA and gammas[probe + 1] > _PROBE_GAMMA
    gammas = _run_schedule(s, 80, lambda g: g, seconds)
    tail = gammas[-2 * _REMEASURE_EVERY :]
    assert 0 in tail and sum(g == 0 for g in tail) <= 2 and max(tail) == 8
    assert s.probe_every == _PROBE_EVERY[0]  # drafting paid for a while: short waits again
    # Drafting costlier than its gain (D = P): plain steps even at acceptance 0.8.
    assert not worth_drafting(best_gamma(0.8, 1.0, 8), 0.8, 1.0)
    assert worth_drafting(best_gamma(0.8, 3.0, 8), 0.8, 3.0)


def test_schedule_backs_off_at_low_acceptance_and_returns_when_it_recovers():
    """Acceptance 0.43 (drafts that do not pay at these costs): a probe's one draft is accepted
    43 % of the time and then drafting comes back for a block or two; such a false return
    doubles the wait as a failed probe does, so drafting's share of the tokens shrinks toward
    a probe per _PROBE_EVERY[1] plain steps. Acceptance back to 0.98: drafting within one
    wait, and it stays."""
    g = torch.Generator().manual_seed(0)
    rate = 0.43

    def accept(gamma):  # drafts accepted in a row, each with probability `rate`
        n = 0
        while n < gamma and float(torch.rand(1, generator=g)) < rate:
            n += 1
        return n

    def seconds(gamma):  # verifying 2–9 tokens: 1.7–2 plain steps; a draft step 0.35
        return 1.0 if gamma == 0 else 0.35 * gamma + 1.7 + 0.04 * gamma

    s = _Schedule(4, True, 8, None)
    s.update(0, 0, 0, 1.0)
    gammas = _run_schedule(s, 150, accept, seconds)
    assert len(gammas) > 6000
    late = gammas[2000:]
    drafted = [x for x in late if x]
    assert late.count(0) / len(late) > 0.99  # plain steps, bar probes and a false return
    assert len(drafted) <= 3 * len(late) / _PROBE_EVERY[1]
    assert s.probe_every == _PROBE_EVERY[1]
    rate = 0.98
    gammas = _run_schedule(s, 60, accept, seconds)
    first = next(i for i, x in enumerate(gammas) if x > _PROBE_GAMMA)
    assert first <= _PROBE_EVERY[1] + 4
    assert gammas[first:].count(0) <= 3 and sum(gammas[first:]) > 200


def test_a_badly_timed_first_block_does_not_keep_drafting_away():
    """A decoder's first drafted block timed far too dear (a first wide forward, new shapes):
    plain steps until the first probe, whose accepted draft brings drafting back on trial; the
    trial's first block replaces the bad timing, and drafting stays."""
    s = _Schedule(4, True, 8, None)
    s.update(0, 0, 0, 1.0)
    s.update(4, 4, 0, 20.0)  # really 1 + 4 × 0.3
    assert s.gamma == 0
    gammas = _run_schedule(s, 40, lambda g: g, lambda g: 1.0 + 0.3 * g)
    probe = next(i for i, x in enumerate(gammas) if x)
    assert probe == _PROBE_EVERY[0] and gammas[probe] == _PROBE_GAMMA
    assert all(t == pytest.approx(1.0 + 0.3 * g) for g, t in s.block_seconds.items())
    assert gammas[probe + 1 :].count(0) <= 2 and max(gammas) == 8


def test_a_probe_that_brings_drafting_back_is_on_trial():
    """Drafting that a probe brought back and that stops paying within _PAYING_RUN blocks
    doubles the wait (a probe's lucky draft does not reset it); drafting that lasts resets it
    to the shortest."""
    s = _Schedule(4, True, 8, None)
    s.update(0, 0, 0, 1.0)
    while s.probe_every < 64:  # drafts rejected: plain steps, failed probes
        _run_schedule(s, 1, lambda g: 0, lambda g: 1.0 + 0.3 * g)
    wait = s.probe_every
    assert _PROBE_EVERY[0] < wait < _PROBE_EVERY[1]
    while s.gamma != _PROBE_GAMMA:  # up to the next probe
        n = s.plain_steps()
        s.update(0, 0, 0, float(n), steps=n)
    s.update(_PROBE_GAMMA, _PROBE_GAMMA, 0, 1.3)  # the probe's draft accepted
    assert s.gamma > _PROBE_GAMMA and s.trial == 0
    while s.gamma:  # the blocks after it rejected: back to plain steps
        s.update(s.gamma, 0, 1, 1.0 + 0.3 * s.gamma)
    assert s.probe_every == 2 * wait and s.trial is None
    while s.gamma != _PROBE_GAMMA:
        n = s.plain_steps()
        s.update(0, 0, 0, float(n), steps=n)
    s.update(_PROBE_GAMMA, _PROBE_GAMMA, 0, 1.3)
    for _ in range(_PAYING_RUN):  # this time the drafts keep paying
        s.update(s.gamma, s.gamma, 0, 1.0 + 0.3 * s.gamma)
    assert s.trial is None and s.probe_every == _PROBE_EVERY[0]


def test_schedule_carries_from_one_batch_to_the_next(tok):
    """With measured costs a decoder keeps its schedule across calls and batches: after a call
    whose drafts were all rejected, the next starts in plain steps and does not even feed the
    draft its prompt (only a probe would, in the probe's own forward); a fixed ``cost_ratio``
    starts every call afresh (the same call, the same schedule). Output exact throughout."""
    base, *experts = _models(len(tok), "llama")
    composed = ComposedDecoder(base, experts, tok, eos_token_ids=[])
    wrong = SabotagedComposition(base, experts, tok, eos_token_ids=[]).sabotage(1, None)
    speculative = SpeculativeDecoder(composed, wrong)
    long, short = (GenerationSettings(max_new_tokens=n, batch_size=1) for n in (60, 30))
    first = speculative.generate(PROMPTS[:1], long)
    _same(first, composed.generate(PROMPTS[:1], long))
    assert first[0].cost["drafted_tokens"] >= 4  # a fresh decoder drafts first
    assert first[0].cost["accepted_tokens"] == 0
    schedule = speculative._schedule()
    # Plain steps, a probe due or 8 + 16 plain steps waited already: the next wait is ≥ 32.
    assert schedule.gamma <= _PROBE_GAMMA and schedule.probe_every >= 4 * _PROBE_EVERY[0]
    costs = []
    for prompts in (PROMPTS[1:2], PROMPTS[2:3]):  # 60 tokens: at most one probe in both
        got = speculative.generate(prompts, short)
        _same(got, composed.generate(prompts, short))
        costs.append(got[0].cost)
    assert sum(c["drafted_tokens"] for c in costs) <= _PROBE_GAMMA
    # 30 tokens: the first from the prompt's forward, the others plain steps but a probe's 2
    assert all(c["plain_steps"] >= 30 - 3 for c in costs)
    # A call in plain steps alone never runs the draft, not even on its prompt.
    idle = [c for c in costs if c["drafted_tokens"] == 0]
    assert idle and all(c["draft_forward_passes"] == 0 for c in idle)
    assert speculative._schedule() is schedule
    # Batches of one call share the schedule too.
    got = speculative.generate(PROMPTS, GenerationSettings(max_new_tokens=20, batch_size=2))
    _same(got, composed.generate(PROMPTS, GenerationSettings(max_new_tokens=20, batch_size=2)))
    assert sum(g.cost["drafted_tokens"] for g in got) <= 2 * _PROBE_GAMMA  # ≤ 1 probe a batch
    # A fixed cost_ratio: every call starts from the same schedule.
    fixed = SpeculativeDecoder(composed, wrong, cost_ratio=3.0)
    once, again = (fixed.generate(PROMPTS[:1], short)[0].cost for _ in range(2))
    assert once == again and once["drafted_tokens"] > _PROBE_GAMMA
    assert fixed._schedule() is not fixed._schedule()


def test_carried_schedule_resumes_drafting_at_the_learnt_gamma():
    """A schedule that ended a batch drafting long blocks starts the next one so (no plain step
    to measure P again, no short first block)."""
    s = _Schedule(4, True, 8, None)
    s.update(0, 0, 0, 1.0)
    for _ in range(10):  # batch 1: every draft accepted, D = 0.3 P
        g = s.gamma
        s.update(g, g, 0, 1.0 + 0.3 * g)
    assert s.gamma > 4 and s.drafts_soon
    # Batch 2 on the same decoder: its first block is s.gamma; costs and acceptance kept.
    assert s.plain_seconds == pytest.approx(1.0) and s.rate() > 0.9
    # A block that also fed the draft its prompt does not count as a drafted token's cost.
    before = s.token_seconds
    s.update(s.gamma, s.gamma, 0, 50.0, prompt=True)
    assert s.token_seconds == before and s.gamma > 4


def test_schedule_times_each_block_length_on_its_own():
    """A forward's cost is not linear in its width (on a CPU a 3-token verification can cost
    more than a 5-token one): each γ's measured blocks decide for that γ. Blocks of 1–3 drafts
    dear, 4 and more cheap: at acceptance ~0.6 plain steps win (though P + γ·D from the cheap
    blocks says a 1-draft block would pay); at full acceptance long blocks."""
    plain, draft_step = 1.0, 0.3

    def seconds(g):  # verification of g + 1 tokens: 1.7 P for 2–4 tokens, then cheap
        return g * draft_step + (1.7 if g < 4 else 1.9 + 0.05 * (g - 4))

    s = _Schedule(4, True, 8, None)
    s.update(0, 0, 0, plain)
    gammas = []
    for i in range(60):  # acceptance 0.6: 3 of every 5 drafts accepted
        g = s.gamma
        gammas.append(g)
        n = min(g, 1 if i % 2 else 2)  # accepted drafts: alternately 1 and 2
        s.update(g, n, int(n < g), seconds(g) if g else plain)
    assert 1 in gammas  # P + γ·D from the first (4-draft) block made γ = 1 look worth a try
    assert s.block_cost(1) == pytest.approx(seconds(1))
    assert gammas[-20:].count(0) >= 18  # then plain steps (a probe or so)
    assert s.block_cost(8) < s.plain_seconds + 8 * s.token_seconds + 1e-9
    gammas = []
    for _ in range(_PROBE_EVERY[1] + 20):  # every draft accepted: the next probes bring back
        g = s.gamma  # long blocks
        gammas.append(g)
        s.update(g, g, 0, seconds(g) if g else plain)
    assert sorted(gammas[-5:])[1] >= 6  # (a plain step now and then re-measures P)


def test_always_wrong_draft_still_exact_only_slower(tok):
    base, *experts = _models(len(tok), "llama")
    composed = ComposedDecoder(base, experts, tok)
    wrong = SabotagedCandidate(composed, 1, None)  # every proposal: the least likely token
    settings = GenerationSettings(max_new_tokens=60, batch_size=4)
    got = SpeculativeDecoder(composed, wrong, gamma=2, adaptive=False).generate(PROMPTS, settings)
    _same(got, composed.generate(PROMPTS, settings))
    assert all(g.cost["acceptance_rate"] == 0 for g in got)


# ---------------------------------------------------------------------------- sampling: exact


def _exact_distributions(composed, prompt: str, settings: GenerationSettings, eos: int):
    """The composition's sampling distribution of token 1 and of tokens (1, 2), by enumeration
    (teacher forcing, then the same warping as plain sampling)."""
    ids = composed.encode_prompt(prompt)
    vocab = composed.vocab_size

    def sampling_probs(lp):
        return torch.softmax(
            warp_logprobs(lp, settings.temperature, settings.top_k, settings.top_p), dim=-1
        ).double()

    sequences = torch.tensor([ids + [t] for t in range(vocab)])
    lp = composed.token_logprobs(sequences)
    first = sampling_probs(lp[0, -2])
    second = sampling_probs(lp[:, -1])  # [first token, second token]
    pairs = {}
    for a in range(vocab):
        if a == eos:
            pairs[(a, eos)] = float(first[a])  # the row ends: one outcome
            continue
        for b in range(vocab):
            pairs[(a, b)] = float(first[a] * second[a, b])
    return {(a,): float(p) for a, p in enumerate(first.tolist())}, pairs


def _outcome(g, eos: int, length: int) -> tuple[int, ...]:
    tokens = g.token_ids + ([eos] if g.finish_reason == "eos" else [])
    return tuple(tokens[:length]) if len(tokens) >= length else tuple(tokens) + (eos,)


def _chisquare_pvalue(counts: Counter, probs: dict, n: int) -> float:
    """Chi-square goodness of fit; outcomes expected fewer than 5 times are pooled."""
    assert set(counts) <= {k for k, p in probs.items() if p > 0}, "an impossible outcome"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for key, p in probs.items():
        if p * n >= 5:
            observed.append(counts.get(key, 0))
            expected.append(p * n)
        else:
            rest_o, rest_e = rest_o + counts.get(key, 0), rest_e + p * n
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    total = sum(expected)
    expected = [e * sum(observed) / total for e in expected]  # exact sums for scipy
    return float(chisquare(observed, expected).pvalue)


def test_sampling_follows_the_composition_exactly_chi_square():
    """Speculative samples of tokens 1 and (1, 2) vs the exact warped composed distribution.

    A 8-token vocabulary, 6000 samples per case, 3 new tokens with γ = 2 (token 2 is decided by
    an accepted draft, a residual or the bonus token), seeds fixed: the test is deterministic.
    Rejected at p < 0.001. The plain sampler is the control for the enumeration itself.
    """
    tok = char_tokenizer("abcde")  # <pad> <eos> <bos> a b c d e
    eos = tok.eos_token_id
    base, e1, e2 = _models(len(tok), "gpt2", scale=0.4)
    composed = ComposedDecoder(base, [e1, e2], tok, weights=[1.0, 0.6], eos_policy="max")
    unrelated = ModelCandidate(tiny_causal_lm(len(tok), seed=9, initializer_range=0.3), tok)
    n = 6000
    prompts = ["abc"] * n
    cases = {
        "plain": (composed, dict(temperature=1.0)),
        "task_arithmetic_draft": (
            SpeculativeDecoder(composed, gamma=2, adaptive=False),
            dict(temperature=1.3, top_k=6),
        ),
        "unrelated_draft": (
            SpeculativeDecoder(composed, unrelated, gamma=2, adaptive=False),
            dict(temperature=0.8, top_p=0.9),
        ),
        "always_wrong_draft": (
            SpeculativeDecoder(
                composed, SabotagedCandidate(composed, 1, None), gamma=2, adaptive=False
            ),
            dict(temperature=1.0),
        ),
        # Measured costs: in the first batch token 1 from a plain step, token 2 from a block.
        "plain_step_then_block": (SpeculativeDecoder(composed, gamma=2), dict(temperature=1.0)),
    }
    first_tokens = {}
    for label, (candidate, warping) in cases.items():
        settings = GenerationSettings(
            max_new_tokens=3, do_sample=True, seed=11, batch_size=n // 4, **warping
        )
        gens = candidate.generate(prompts, settings)
        first_tokens[label] = [_outcome(g, eos, 1) for g in gens]
        one, two = _exact_distributions(composed, "abc", settings, eos)
        for length, probs in ((1, one), (2, two)):
            counts = Counter(_outcome(g, eos, length) for g in gens)
            p_value = _chisquare_pvalue(counts, probs, n)
            assert p_value > SIGNIFICANCE, f"{label}, {length} token(s): p = {p_value:.2e}"
        if label != "plain":
            rate = _rate(gens)
            assert 0.0 <= rate < 1.0
    # A plain step draws as plain sampling does: the same first token for the same seed — in the
    # decoder's first batch; later batches go on with the schedule carried from it (drafting).
    first_batch = slice(0, n // 4)
    assert first_tokens["plain_step_then_block"][first_batch] == first_tokens["plain"][first_batch]


def test_sampling_is_reproducible_and_independent_of_the_batch(tok):
    base, *experts = _models(len(tok), "gpt2")
    speculative = SpeculativeDecoder(ComposedDecoder(base, experts, tok), gamma=3, adaptive=False)
    settings = GenerationSettings(max_new_tokens=30, do_sample=True, seed=4, top_k=10, batch_size=4)
    first = speculative.generate(PROMPTS, settings)
    _same(speculative.generate(PROMPTS, settings), first)
    one_by_one = GenerationSettings(**{**settings.to_dict(), "batch_size": 1})
    _same(speculative.generate(PROMPTS, one_by_one), first)


# ---------------------------------------------------------------------------- the candidate


def test_score_token_logprobs_and_describe_are_the_compositions(tok):
    base, *experts = _models(len(tok), "gpt2")
    composed = ComposedDecoder(base, experts, tok)
    speculative = SpeculativeDecoder(composed)
    assert isinstance(speculative, Candidate)
    assert speculative.score(PROMPTS, ["abc", "", "d e", "xyz"]) == composed.score(
        PROMPTS, ["abc", "", "d e", "xyz"]
    )
    ids = torch.tensor([tok("hello")["input_ids"]])
    assert torch.equal(speculative.token_logprobs(ids), composed.token_logprobs(ids))
    d = speculative.describe()
    json.dumps(d)
    assert d["composed"] == composed.describe() and d["type"] == "SpeculativeDecoder"
    assert d["draft"]["type"] == "ModelCandidate" and d["gamma"] == 4


def test_default_draft_is_the_task_arithmetic_merge(tok):
    base, e1, e2 = _models(len(tok), "llama")
    draft = task_arithmetic_draft(ComposedDecoder(base, [e1, e2], tok, weights=[1.0, 0.5]))
    want = merge_models("task_arithmetic", base, [e1, e2], weights=[1.0, 0.5])
    for (name, p), q in zip(draft.model.named_parameters(), want.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name
    # LoRA experts: the adapters' ΔW summed into the base = task arithmetic of the merged experts.
    adapters = [_lora(base, "llama", seed) for seed in (1, 2)]
    lora_draft = task_arithmetic_draft(ComposedDecoder.from_lora(base, adapters, tok))
    merged = [copy.deepcopy(a).merge_and_unload() for a in adapters]
    want = merge_models("task_arithmetic", base, merged)
    for (name, p), q in zip(lora_draft.model.named_parameters(), want.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-5), name


def test_adaptive_gamma_follows_the_acceptance_rate():
    assert best_gamma(0.0, 3.0, 8) == 1
    assert best_gamma(1.0, 3.0, 8) == 8
    gammas = [best_gamma(a / 20, 3.0, 8) for a in range(21)]
    assert gammas == sorted(gammas) and gammas[16] > 1  # more acceptance, longer blocks
    assert best_gamma(0.8, 1.0, 8) <= best_gamma(0.8, 3.0, 8)  # cheaper verification, shorter
    # The expected tokens per unit of work that γ maximises (Leviathan et al. 2023).
    a, c = 0.8, 3.0
    value = [(1 - a ** (g + 1)) / (1 - a) / (g + c) for g in range(1, 9)]
    assert best_gamma(a, c, 8) == 1 + max(range(8), key=value.__getitem__)
    assert math.isclose(max(value), value[best_gamma(a, c, 8) - 1])


def test_bad_drafts_are_refused(tok):
    base, *experts = _models(len(tok), "gpt2")
    composed = ComposedDecoder(base, experts, tok)
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeDecoder(composed, gamma=0)
    with pytest.raises(ValueError, match="shares the composition's runner"):
        SpeculativeDecoder(composed, composed)
    other = char_tokenizer("zyxwvutsrqponmlkjihgfedcba0123456789 .,:;=+-*/()?!\n")
    with pytest.raises(ValueError, match="maps tokens differently"):
        SpeculativeDecoder(composed, ModelCandidate(base, other))
    lora = ComposedDecoder.from_lora(base, [_lora(base, "gpt2", 1)], tok)
    with pytest.raises(ValueError, match="LoRA composition's base"):
        SpeculativeDecoder(lora, ModelCandidate(base, tok))


def test_transformers_style_calls_work_as_for_the_composition(tok):
    """Id tensors with an attention mask and generation kwargs, as for any DecodingCandidate."""
    composed = ComposedDecoder(
        tiny_causal_lm(len(tok), seed=0), [tiny_causal_lm(len(tok), seed=i) for i in (1, 2)], tok
    )
    enc = tok(["hello", "ab"], return_tensors="pt", padding=True)
    call = dict(attention_mask=enc["attention_mask"], max_new_tokens=12)
    fast = SpeculativeDecoder(composed).generate(enc["input_ids"], **call)
    plain = composed.generate(enc["input_ids"], **call)
    assert [g.token_ids for g in fast] == [g.token_ids for g in plain]
