"""The composition formula: normalisation, special cases, −inf handling, JSON, EOS policies."""

import math

import pytest
import torch

from mergelab.compose import Composition, compose_logprobs
from mergelab.compose.eos import EOS_POLICIES, apply_eos_policy
from mergelab.compose.formula import Term

V = 50


def _lp(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(3 * torch.randn(*shape, V, generator=g), -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_composition_sums_to_one(dtype):
    base, e1, e2 = (_lp(4, 7, seed=s, dtype=dtype) for s in range(3))
    out = compose_logprobs(base, [e1, e2])
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.allclose(out.exp().sum(-1), torch.ones(4, 7, dtype=out.dtype), atol=1e-5)


def test_paper_rule_matches_closed_form():
    base, e1, e2 = (_lp(3, seed=s, dtype=torch.float64) for s in range(3))
    expected = torch.log_softmax(e1 + e2 - base, -1)  # Σ log p_i − (k−1) log p_b
    assert torch.allclose(compose_logprobs(base, [e1, e2]), expected, atol=1e-12)
    weighted = compose_logprobs(base, [e1, e2], [0.5, 2.0], temperature=1.5)
    expected = torch.log_softmax((base + 0.5 * (e1 - base) + 2.0 * (e2 - base)) / 1.5, -1)
    assert torch.allclose(weighted, expected, atol=1e-12)


def test_one_expert_weight_one_is_that_expert_even_with_neg_inf():
    base, expert = _lp(5, seed=0), _lp(5, seed=1)
    base[:, :3] = -math.inf  # tokens the base rules out but the expert allows
    expert[:, 10:12] = -math.inf
    expert = torch.log_softmax(expert, -1)
    out = compose_logprobs(base, [expert], [1.0])
    assert torch.isneginf(out[:, 10:12]).all()
    assert torch.allclose(out, expert, atol=1e-6, equal_nan=False)
    assert not torch.isnan(out).any()


def test_expert_identical_to_base_leaves_base_unchanged():
    base, expert = _lp(5, seed=0), _lp(5, seed=1)
    out = compose_logprobs(base, [base.clone()])
    assert torch.allclose(out, base, atol=1e-6)
    # Adding a copy of the base to a composition changes nothing either.
    assert torch.allclose(
        compose_logprobs(base, [expert, base.clone()]), compose_logprobs(base, [expert]), atol=1e-6
    )


def test_neg_inf_never_gives_nan():
    base, e1, e2 = _lp(6, seed=0), _lp(6, seed=1), _lp(6, seed=2)
    base[0, :5] = -math.inf
    e1[0, 3:8] = -math.inf
    e2[1, :2] = -math.inf
    out = compose_logprobs(base, [e1, e2])
    assert not torch.isnan(out).any()
    # Ruled out by any component with a non-zero net coefficient (here all of them).
    assert torch.isneginf(out[0, :8]).all() and torch.isneginf(out[1, :2]).all()
    assert torch.allclose(out.exp().sum(-1), torch.ones(6), atol=1e-5)
    with pytest.raises(ValueError, match="rules out every token"):
        compose_logprobs(torch.full((V,), -math.inf), [_lp(seed=1), _lp(seed=2)])


def test_special_cases_coefficients_and_text():
    cases = {
        Composition.paper("base", ["math", "code"]): (
            "base + 1.0·(math − base) + 1.0·(code − base)",
            {"base": -1.0, "math": 1.0, "code": 1.0},
        ),
        Composition.classifier_free_guidance("base", "cond", 1.5): (
            "base + 1.5·(cond − base)",
            {"base": -0.5, "cond": 1.5},
        ),
        Composition.dexperts("base", "expert", "anti", 2.0): (
            "base + 2.0·(expert − anti)",
            {"base": 1.0, "expert": 2.0, "anti": -2.0},
        ),
        Composition.proxy_tuning("large", "small_tuned", "small_base"): (
            "large + 1.0·(small_tuned − small_base)",
            {"large": 1.0, "small_tuned": 1.0, "small_base": -1.0},
        ),
        Composition.product_of_experts(["math", "code"]): (
            "1.0·math + 1.0·code",
            {"math": 1.0, "code": 1.0},
        ),
        Composition.weighted("b", ["x"], [-0.5], temperature=2.0): (
            "[b − 0.5·(x − b)] / 2.0",
            {"b": 1.5, "x": -0.5},
        ),
    }
    for composition, (text, coefficients) in cases.items():
        assert str(composition) == text
        assert composition.coefficients() == coefficients
        again = Composition.from_json(composition.to_json())
        assert again == composition and str(again) == text
        # Evaluating equals log_softmax(Σ c_j log p_j / T).
        lps = {n: _lp(2, seed=i, dtype=torch.float64) for i, n in enumerate(composition.components)}
        expected = torch.log_softmax(
            sum(c * lps[n] for n, c in coefficients.items()) / composition.temperature, -1
        )
        assert torch.allclose(composition.log_probs(lps), expected, atol=1e-10)


def test_bad_compositions_are_refused():
    with pytest.raises(ValueError, match="weights for"):
        Composition.weighted("b", ["x", "y"], [1.0])
    with pytest.raises(ValueError, match="temperature"):
        Composition.weighted("b", ["x"], temperature=0)
    with pytest.raises(ValueError, match="unknown composition keys"):
        Composition.from_dict({"anchor": "b", "weights": [1]})
    with pytest.raises(ValueError, match="no log-probs given"):
        Composition.paper("b", ["x"]).log_probs({"b": _lp()})
    with pytest.raises(ValueError, match="shape"):
        compose_logprobs(_lp(2), [_lp(3)])


@pytest.mark.parametrize("policy", EOS_POLICIES)
def test_eos_policies_normalise_and_set_eos(policy):
    base, e1, e2 = (_lp(4, seed=s) for s in range(3))
    composed = compose_logprobs(base, [e1, e2])
    eos = torch.tensor([2])
    out = apply_eos_policy(composed, [base, e1, e2], eos, policy, anchor_index=0)
    assert torch.allclose(out.exp().sum(-1), torch.ones(4), atol=1e-5)
    stacked = torch.stack([base, e1, e2])[..., 2]
    expected = {
        "plain": composed[:, 2],
        "base": base[:, 2],
        "max": stacked.max(0).values,
        "min": stacked.min(0).values,
        "most_confident": stacked.gather(
            0, torch.stack([base, e1, e2]).max(-1).values.argmax(0)[None]
        )[0],
    }[policy]
    assert torch.allclose(out[:, 2], expected, atol=1e-6)
    # Non-EOS tokens keep their relative composed probabilities.
    keep = torch.arange(V) != 2
    ratio = (out[:, keep] - composed[:, keep]).exp()
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), atol=1e-5)


NON_FINITE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("bad", NON_FINITE)
def test_non_finite_weights_are_refused_by_every_constructor(bad):
    """A NaN/Inf weight would make every composed log-prob NaN: refused wherever it comes in."""
    builders = [
        lambda: Composition.weighted("b", ["x", "y"], [1.0, bad]),
        lambda: Composition.classifier_free_guidance("b", "x", bad),
        lambda: Composition.dexperts("b", "x", "anti", bad),
        lambda: Composition.proxy_tuning("large", "tuned", "small", bad),
        lambda: Composition.product_of_experts(["x", "y"], [bad, 1.0]),
        lambda: Composition(anchor="b", terms=(Term(bad, "x", "b"),)),
        lambda: Composition.from_dict({"anchor": "b", "terms": [{"weight": bad, "model": "x"}]}),
        lambda: Composition.from_json('{"anchor": "b", "terms": [{"weight": NaN, "model": "x"}]}'),
        lambda: compose_logprobs(_lp(2), [_lp(2)], [bad]),
    ]
    for build in builders:
        with pytest.raises(ValueError, match="weight of term .* must be a finite number"):
            build()
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        Composition.weighted("b", ["x"], temperature=bad)


def test_weights_must_be_one_number_per_expert():
    # A string is not a list of weights (it would be read one character per expert).
    with pytest.raises(ValueError, match="one number per expert, got '12'"):
        Composition.weighted("b", ["x", "y"], "12")
    with pytest.raises(ValueError, match="one number per expert, got 0.5"):
        Composition.product_of_experts(["x"], 0.5)
    with pytest.raises(ValueError, match="weight of term 'x' must be a number, got True"):
        Composition.weighted("b", ["x"], [True])
    with pytest.raises(ValueError, match="term 0 needs a 'weight' and a 'model'"):
        Composition.from_dict({"anchor": "b", "terms": [{"model": "x"}]})
    # Numbers of any kind are read as floats.
    c = Composition.weighted("b", ["x", "y"], torch.tensor([1.0, 0.5]))
    assert [t.weight for t in c.terms] == [1.0, 0.5] and str(c) == "b + 1.0·(x − b) + 0.5·(y − b)"
