"""Every merge method pinned numerically to PEFT 0.21 ``merge_utils`` and mergekit 0.1.5.

Tolerance: float32 round-off, ``rtol = atol = 1e-6`` on values of order 1 (the implementations
sum the same terms in different orders; nothing else may differ).

Trimming: our magnitude thresholds are exact k-th largest values and keep every entry tied with
the k-th, while a sort/topk keeps exactly k and breaks ties arbitrarily. Only such exact ties at
the threshold may therefore differ; the data below are continuous random values, and each trim
test asserts there is no tie at its threshold, so the results must agree everywhere.

DARE: no two libraries share a random stream, so the tests pin the maths after the draw by giving
every implementation the same keep masks: ours come from the tensor's seed (reproduced here
with the same seed and tensor name through ``steps.dare_keep_mask``), and PEFT's and mergekit's
``torch.bernoulli`` draw is replaced for the duration of the call by a stand-in that returns
those masks in expert order (and checks it was asked for the right shape and keep rate).
"""

from __future__ import annotations

import pytest
import torch
from _reference import require

from mergelab.merge import (
    TensorContext,
    merge_models,
    merge_state_dicts,
)
from mergelab.merge.methods import steps

peft_merge = require("peft.utils.merge_utils")
mk_registry = require("mergekit.merge_methods.registry")
from _mergekit import WEIGHTS, mergekit, run, tiny_llama_family  # noqa: E402
from mergekit.merge_methods.generalized_task_arithmetic import (  # noqa: E402
    ConsensusMethod,
    GeneralizedTaskArithmeticMerge,
)
from mergekit.sparsify import SparsificationMethod  # noqa: E402

TOL = {"rtol": 1e-6, "atol": 1e-6}


# --- reference call helpers ----------------------------------------------------------------------


def mergekit_ties_count(normalize: bool):
    """mergekit's TIES with consensus by count of signs (not registered under a name there)."""
    return GeneralizedTaskArithmeticMerge(
        consensus_method=ConsensusMethod.count,
        sparsification_method=SparsificationMethod.magnitude,
        default_normalize=normalize,
        default_rescale=False,
        method_name="ties_count",
        method_pretty_name=None,
        method_reference_url=None,
    )


def our_dare_masks(name, seed, shape, densities):
    """The keep masks our DARE draws for tensor ``name`` (same seed, expert by expert)."""
    seed = TensorContext(name=name, seed=seed).tensor_seed
    return [steps.dare_keep_mask(shape, d, seed, i) for i, d in enumerate(densities) if d < 1]


class InjectedBernoulli:
    """Stand-in for ``torch.bernoulli`` that hands out given masks in order."""

    def __init__(self, masks, densities):
        self.masks = list(masks)
        self.densities = [d for d in densities if d < 1]
        self.calls = 0

    def __call__(self, probabilities, *args, **kwargs):
        mask = self.masks[self.calls]
        assert probabilities.shape == mask.shape
        assert torch.all(probabilities == self.densities[self.calls])  # asked for keep rate d
        self.calls += 1
        return mask.to(probabilities.dtype)


def with_masks(monkeypatch, masks, densities, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its ``torch.bernoulli`` draws replaced by ``masks``."""
    stand_in = InjectedBernoulli(masks, densities)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "bernoulli", stand_in)
        out = fn(*args, **kwargs)
    assert stand_in.calls == len(stand_in.masks), "reference did not draw one mask per expert"
    return out


def assert_no_tie_at_threshold(taus, densities):
    """The premise under which trims must agree exactly (see module docstring)."""
    for tau, d in zip(taus, densities):
        threshold = steps.magnitude_threshold(tau, d)
        assert int((tau.abs() == threshold).sum()) == 1


# --- seeded random tensors -----------------------------------------------------------------------


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(1234)
    base = torch.randn(48, 40, generator=g)
    scales = [0.1, 0.05, 0.2]
    experts = [base + s * torch.randn(48, 40, generator=g) for s in scales]
    return base, experts


class TestAgainstPeft:
    def test_task_arithmetic(self, tensors):
        base, experts = tensors
        taus = [e - base for e in experts]
        ref = base + 0.7 * peft_merge.task_arithmetic(taus, torch.tensor(WEIGHTS))
        ours = run("task_arithmetic", base, experts, weight=WEIGHTS, lambda_=0.7)
        torch.testing.assert_close(ours, ref, **TOL)

    @pytest.mark.parametrize(("peft_method", "ours"), [("total", "sum"), ("frequency", "count")])
    def test_ties_per_tensor(self, tensors, peft_method, ours):
        base, experts = tensors
        taus = [e - base for e in experts]
        assert_no_tie_at_threshold(taus, [0.3] * 3)
        ref = base + 1.5 * peft_merge.ties(
            taus, torch.tensor(WEIGHTS), 0.3, majority_sign_method=peft_method
        )
        merged = run(
            "ties",
            base,
            experts,
            weight=WEIGHTS,
            density=0.3,
            lambda_=1.5,
            trim_scope="tensor",
            majority_sign=ours,
            weighted_sign=False,
            divide_by="count",
        )
        torch.testing.assert_close(merged, ref, **TOL)

    def test_prune_and_magnitude_prune(self, tensors):
        base, experts = tensors
        taus = [e - base for e in experts]
        for tau in taus:
            ref = peft_merge.prune(tau, 0.25, "magnitude")
            ours = steps.magnitude_trim_(tau.clone(), 0.25)
            assert torch.equal(ours != 0, ref != 0)  # the same entries survive
            torch.testing.assert_close(ours, ref, rtol=0, atol=0)
        ref = peft_merge.magnitude_prune(taus, torch.tensor(WEIGHTS), 0.25)
        kept = [steps.magnitude_trim_(t.clone(), 0.25) for t in taus]
        torch.testing.assert_close(sum(w * t for w, t in zip(WEIGHTS, kept)), ref, **TOL)

    def test_dare_linear(self, tensors, monkeypatch):
        base, experts = tensors
        taus = [e - base for e in experts]
        masks = our_dare_masks("w", 7, base.shape, [0.3] * 3)
        ref = base + with_masks(
            monkeypatch,
            masks,
            [0.3] * 3,
            lambda: peft_merge.dare_linear(taus, torch.tensor(WEIGHTS), 0.3),
        )
        ours = run("dare_linear", base, experts, seed=7, weight=WEIGHTS, density=0.3)
        torch.testing.assert_close(ours, ref, **TOL)

    @pytest.mark.parametrize(("peft_method", "ours"), [("total", "sum"), ("frequency", "count")])
    def test_dare_ties(self, tensors, monkeypatch, peft_method, ours):
        base, experts = tensors
        taus = [e - base for e in experts]
        masks = our_dare_masks("w", 3, base.shape, [0.4] * 3)
        ref = base + with_masks(
            monkeypatch,
            masks,
            [0.4] * 3,
            lambda: peft_merge.dare_ties(
                taus, torch.tensor(WEIGHTS), 0.4, majority_sign_method=peft_method
            ),
        )
        merged = run(
            "dare_ties", base, experts, seed=3, weight=WEIGHTS, density=0.4, majority_sign=ours
        )
        torch.testing.assert_close(merged, ref, **TOL)


class TestAgainstMergekit:
    @pytest.mark.parametrize("normalize", [True, False])
    def test_linear(self, tensors, normalize):
        _, experts = tensors
        ref = mergekit("linear", None, experts, weight=WEIGHTS, normalize=normalize)
        ours = run("linear", None, experts, weight=WEIGHTS, normalize=normalize)
        torch.testing.assert_close(ours, ref, **TOL)

    @pytest.mark.parametrize("t", [0.0, 0.3, 0.8, 1.0])
    def test_slerp(self, tensors, t):
        base, experts = tensors
        ref = mergekit("slerp", base, experts[:1], t=t)
        torch.testing.assert_close(run("slerp", base, experts[:1], t=t), ref, **TOL)

    def test_slerp_nearly_colinear_falls_back_to_linear(self, tensors):
        base, _ = tensors
        other = 1.5 * base + 1e-4 * torch.randn_like(base)
        ref = mergekit("slerp", base, [other], t=0.3)
        ours = run("slerp", base, [other], t=0.3)
        torch.testing.assert_close(ours, ref, **TOL)
        torch.testing.assert_close(ours, 0.7 * base + 0.3 * other, **TOL)

    @pytest.mark.parametrize("normalize", [True, False])
    def test_task_arithmetic(self, tensors, normalize):
        base, experts = tensors
        kw = {"weight": WEIGHTS, "normalize": normalize}
        ref = mergekit("task_arithmetic", base, experts, **kw, **{"lambda": 0.6})
        ours = run("task_arithmetic", base, experts, lambda_=0.6, **kw)
        torch.testing.assert_close(ours, ref, **TOL)

    @pytest.mark.parametrize("weights", [WEIGHTS, [1.0, -0.5, 0.8]])
    @pytest.mark.parametrize(("normalize", "divide_by"), [(True, "weight_sum"), (False, "none")])
    @pytest.mark.parametrize("consensus", ["sum", "count"])
    def test_ties(self, tensors, weights, normalize, divide_by, consensus):
        base, experts = tensors
        density = [0.3, 0.5, 0.2]
        assert_no_tie_at_threshold([e - base for e in experts], density)
        method = "ties" if consensus == "sum" else mergekit_ties_count(normalize)
        ref = mergekit(
            method,
            base,
            experts,
            weight=weights,
            density=density,
            normalize=normalize,
            **{"lambda": 1.2},
        )
        ours = run(
            "ties",
            base,
            experts,
            weight=weights,
            density=density,
            lambda_=1.2,
            trim_scope="tensor",
            majority_sign=consensus,
            weighted_sign=True,
            divide_by=divide_by,
        )
        torch.testing.assert_close(ours, ref, **TOL)

    def test_ties_semantics_are_distinguishable(self, tensors):
        """The parameters select different maths: the paper default is not mergekit's TIES."""
        base, experts = tensors
        weights, density = [1.0, -0.5, 0.8], [0.3, 0.5, 0.2]
        ref = mergekit("ties", base, experts, weight=weights, density=density)
        paper = run("ties", base, experts, weight=weights, density=density, trim_scope="tensor")
        assert (paper - ref).abs().max() > 1e-2

    @pytest.mark.parametrize(("normalize", "divide_by"), [(False, "none"), (True, "weight_sum")])
    def test_dare_ties(self, tensors, monkeypatch, normalize, divide_by):
        base, experts = tensors
        density = [0.3, 0.6, 0.5]
        masks = our_dare_masks("w", 11, base.shape, density)
        ref = with_masks(
            monkeypatch,
            masks,
            density,
            lambda: mergekit(
                "dare_ties", base, experts, weight=WEIGHTS, density=density, normalize=normalize
            ),
        )
        ours = run(
            "dare_ties",
            base,
            experts,
            seed=11,
            weight=WEIGHTS,
            density=density,
            rescale="l1",
            weighted_sign=True,
            divide_by=divide_by,
        )
        torch.testing.assert_close(ours, ref, **TOL)

    def test_dare_linear(self, tensors, monkeypatch):
        base, experts = tensors
        density = [0.3, 1.0, 0.5]  # density 1 draws no mask in either implementation
        masks = our_dare_masks("w", 5, base.shape, density)
        ref = with_masks(
            monkeypatch,
            masks,
            density,
            lambda: mergekit(
                "dare_linear", base, experts, weight=WEIGHTS, density=density, **{"lambda": 0.9}
            ),
        )
        ours = run(
            "dare_linear",
            base,
            experts,
            seed=5,
            weight=WEIGHTS,
            density=density,
            lambda_=0.9,
            rescale="l1",
        )
        torch.testing.assert_close(ours, ref, **TOL)

    def test_breadcrumbs(self, tensors):
        base, experts = tensors
        density, gamma = [0.7, 0.8, 0.5], [0.05, 0.01, 0.1]
        ref = mergekit(
            "breadcrumbs",
            base,
            experts,
            weight=WEIGHTS,
            density=density,
            gamma=gamma,
            **{"lambda": 1.1},
        )
        ours = run(
            "breadcrumbs",
            base,
            experts,
            weight=WEIGHTS,
            density=density,
            gamma=gamma,
            lambda_=1.1,
        )
        torch.testing.assert_close(ours, ref, **TOL)

    @pytest.mark.parametrize("filter_wise", [False, True])
    @pytest.mark.parametrize("shape", [(48, 40), (40,)])
    def test_model_stock(self, tensors, filter_wise, shape):
        base, experts = tensors
        if len(shape) == 1:
            base, experts = base[0], [e[0] for e in experts]
        ref = mergekit("model_stock", base, experts, filter_wise=filter_wise)
        ours = run("model_stock", base, experts, filter_wise=filter_wise)
        torch.testing.assert_close(ours, ref, **TOL)


# --- a tiny transformers model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llamas():
    return tiny_llama_family()


def per_tensor_reference(base_sd, expert_sds, fn):
    return {name: fn(name, base_sd[name], [sd[name] for sd in expert_sds]) for name in base_sd}


def assert_state_dicts_close(ours, ref):
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


TINY_CASES = {
    "linear": (
        {"normalize": True},
        lambda n, b, es: mergekit("linear", None, es, name=n, weight=WEIGHTS),
    ),
    "slerp": (
        {"t": 0.35},
        lambda n, b, es: mergekit("slerp", b, es[:1], name=n, t=0.35),
    ),
    "task_arithmetic": (
        {"lambda": 0.8},
        lambda n, b, es: mergekit(
            "task_arithmetic", b, es, name=n, weight=WEIGHTS, **{"lambda": 0.8}
        ),
    ),
    "ties": (
        {"density": 0.3, "trim_scope": "tensor", "weighted_sign": True, "divide_by": "weight_sum"},
        lambda n, b, es: mergekit("ties", b, es, name=n, weight=WEIGHTS, density=0.3),
    ),
    "breadcrumbs": (
        {"density": 0.8, "gamma": 0.05},
        lambda n, b, es: mergekit(
            "breadcrumbs", b, es, name=n, weight=WEIGHTS, density=0.8, gamma=0.05
        ),
    ),
    "model_stock": (
        {},
        lambda n, b, es: mergekit("model_stock", b, es, name=n),
    ),
}


@pytest.mark.parametrize("method", sorted(TINY_CASES))
def test_tiny_llama_against_mergekit(llamas, method):
    base, experts = llamas
    params, reference = TINY_CASES[method]
    used = experts[:1] if method == "slerp" else experts
    weights = None if method in ("slerp", "model_stock") else WEIGHTS
    merged = merge_models(method, base, used, params=params, weights=weights)
    ref = per_tensor_reference(base.state_dict(), [e.state_dict() for e in used], reference)
    assert_state_dicts_close(merged.state_dict(), ref)
    assert not merged.training


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_tiny_llama_dare_against_mergekit_and_peft(llamas, monkeypatch, method):
    base, experts = llamas
    density, seed = [0.4, 0.6, 0.5], 21
    base_sd, expert_sds = base.state_dict(), [e.state_dict() for e in experts]

    def reference(kind):
        out = {}
        for name, b in base_sd.items():
            es = [sd[name] for sd in expert_sds]
            masks = our_dare_masks(
                name, seed, b.shape, density if kind == "mergekit" else [0.5] * 3
            )
            if kind == "mergekit":
                out[name] = with_masks(
                    monkeypatch,
                    masks,
                    density,
                    mergekit,
                    method,
                    b,
                    es,
                    name=name,
                    weight=WEIGHTS,
                    density=density,
                )
            else:
                taus = [e - b for e in es]
                peft_fn = getattr(peft_merge, method)
                out[name] = b + with_masks(
                    monkeypatch, masks, [0.5] * 3, peft_fn, taus, torch.tensor(WEIGHTS), 0.5
                )
        return out

    mergekit_style = {"rescale": "l1"}
    if method == "dare_ties":
        mergekit_style |= {"weighted_sign": True, "divide_by": "none"}
    ours = merge_state_dicts(
        method,
        base_sd,
        expert_sds,
        weights=WEIGHTS,
        params={"density": density, **mergekit_style},
        seed=seed,
    )
    assert_state_dicts_close(ours, reference("mergekit"))
    ours = merge_state_dicts(
        method, base_sd, expert_sds, weights=WEIGHTS, params={"density": 0.5}, seed=seed
    )
    assert_state_dicts_close(ours, reference("peft"))


@pytest.mark.parametrize("majority", [("total", "sum"), ("frequency", "count")])
def test_tiny_llama_ties_per_tensor_against_peft(llamas, majority):
    base, experts = llamas
    base_sd, expert_sds = base.state_dict(), [e.state_dict() for e in experts]
    ref = per_tensor_reference(
        base_sd,
        expert_sds,
        lambda n, b, es: (
            b + peft_merge.ties([e - b for e in es], torch.tensor(WEIGHTS), 0.3, majority[0])
        ),
    )
    params = {"density": 0.3, "trim_scope": "tensor", "majority_sign": majority[1]}
    ours = merge_state_dicts("ties", base_sd, expert_sds, weights=WEIGHTS, params=params)
    assert_state_dicts_close(ours, ref)


def test_tiny_llama_global_ties_equals_peft_on_the_flattened_model(llamas):
    """trim_scope="model" (TIES paper): PEFT's ties applied to the whole model as ONE vector."""
    base, experts = llamas
    base_sd, expert_sds = base.state_dict(), [e.state_dict() for e in experts]
    names = list(base_sd)
    flat_base = torch.cat([base_sd[n].reshape(-1) for n in names])
    flat_taus = [torch.cat([sd[n].reshape(-1) for n in names]) - flat_base for sd in expert_sds]
    assert_no_tie_at_threshold(flat_taus, [0.2] * 3)
    flat = flat_base + 1.3 * peft_merge.ties(flat_taus, torch.tensor(WEIGHTS), 0.2, "total")
    ref, offset = {}, 0
    for n in names:
        size = base_sd[n].numel()
        ref[n] = flat[offset : offset + size].view_as(base_sd[n])
        offset += size
    ours = merge_state_dicts(
        "ties", base_sd, expert_sds, weights=WEIGHTS, params={"density": 0.2, "lambda": 1.3}
    )  # the defaults: trim_scope="model", unweighted sum election, divide by count
    assert_state_dicts_close(ours, ref)
    # ... and the global trim is not the per-tensor one on this model.
    per_tensor = merge_state_dicts(
        "ties",
        base_sd,
        expert_sds,
        weights=WEIGHTS,
        params={"density": 0.2, "lambda": 1.3, "trim_scope": "tensor"},
    )
    assert any(not torch.allclose(ours[n], per_tensor[n]) for n in names)
