"""Properties every merge method must have, whatever the reference implementations do."""

from __future__ import annotations

import pytest
import torch

from mergelab.merge import TensorContext, get_merge_method, list_merge_methods, merge_state_dicts

BUILT_IN = [
    "breadcrumbs",
    "dare_linear",
    "dare_ties",
    "linear",
    "model_stock",
    "slerp",
    "task_arithmetic",
    "ties",
]


def state_dicts(n_experts: int, seed: int = 0):
    """A base and experts as small state dicts (two matrices, a vector, an integer buffer)."""
    g = torch.Generator().manual_seed(seed)
    base = {
        "layer.weight": torch.randn(24, 16, generator=g),
        "layer.bias": torch.randn(24, generator=g),
        "head.weight": torch.randn(8, 24, generator=g),
        "step": torch.tensor(3),
    }
    experts = []
    for _ in range(n_experts):
        e = {
            k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in base.items()
        }
        experts.append(e)
    return base, experts


def test_all_built_in_methods_are_registered():
    assert set(BUILT_IN) <= set(list_merge_methods())


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("task_arithmetic", {}),
        ("ties", {"density": 0.3}),
        ("ties", {"density": 0.3, "trim_scope": "tensor"}),
        ("dare_linear", {"density": 0.3}),
        ("dare_ties", {"density": 0.3}),
        ("breadcrumbs", {}),
    ],
)
def test_lambda_zero_returns_the_base(method, params):
    base, experts = state_dicts(3)
    merged = merge_state_dicts(method, base, experts, params={**params, "lambda": 0.0})
    for name in base:
        assert torch.equal(merged[name], base[name]), name


@pytest.mark.parametrize("divide_by", ["count", "none"])
@pytest.mark.parametrize("trim_scope", ["model", "tensor"])
def test_one_expert_ties_at_density_one_is_task_arithmetic(trim_scope, divide_by):
    base, experts = state_dicts(1)
    params = {"density": 1.0, "lambda": 0.7, "trim_scope": trim_scope, "divide_by": divide_by}
    ties = merge_state_dicts("ties", base, experts, weights=[0.6], params=params)
    ta = merge_state_dicts("task_arithmetic", base, experts, weights=[0.6], params={"lambda": 0.7})
    for name in base:  # equal up to float32 rounding (fused multiply-adds in a different order)
        torch.testing.assert_close(ties[name], ta[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [0.0, 1.0])
@pytest.mark.parametrize("colinear", [False, True])
def test_slerp_endpoints(t, colinear):
    base, (expert,) = state_dicts(1)
    if colinear:  # exercise the linear fall-back too
        expert = {k: 2 * v if v.is_floating_point() else v for k, v in base.items()}
    merged = merge_state_dicts("slerp", base, [expert], params={"t": t})
    endpoint = base if t == 0 else expert
    for name in base:
        torch.testing.assert_close(merged[name], endpoint[name], rtol=1e-6, atol=1e-6)


# Parameters under which merging n copies of one expert must give that expert back: weights that
# sum to one for the un-normalised sums, density 1 where the method would otherwise sparsify.
IDENTICAL = {
    "linear": {"weights": [0.2, 3.0, 1.0]},
    "slerp": {},
    "task_arithmetic": {"weights": [0.5, 0.25, 0.25]},
    "ties": {"weights": [0.2, 3.0, 1.0], "params": {"density": 1.0, "divide_by": "weight_sum"}},
    "dare_linear": {"weights": [0.5, 0.25, 0.25], "params": {"density": 1.0}},
    "dare_ties": {"params": {"density": 1.0}},
    "breadcrumbs": {"weights": [0.5, 0.25, 0.25], "params": {"density": 1.0}},
    "model_stock": {},
}


@pytest.mark.parametrize("method", BUILT_IN)
def test_merging_identical_experts_returns_that_expert(method):
    base, (expert,) = state_dicts(1)
    setting = IDENTICAL[method]
    copies = 2 if method == "slerp" else 3
    merged = merge_state_dicts(
        method,
        None if method == "slerp" else base,  # slerp interpolates the two copies themselves
        [expert] * copies,
        weights=setting.get("weights"),
        params=setting.get("params"),
    )
    for name in base:
        torch.testing.assert_close(merged[name], expert[name], rtol=1e-6, atol=1e-6)


def test_ties_of_identical_experts_keeps_their_common_trimmed_vector():
    """At density < 1, n copies of one expert merge to base + its own trimmed task vector."""
    base, (expert,) = state_dicts(1)
    merged = merge_state_dicts("ties", base, [expert] * 3, params={"density": 0.25})
    single = merge_state_dicts("ties", base, [expert], params={"density": 0.25})
    for name in base:
        torch.testing.assert_close(merged[name], single[name], rtol=1e-6, atol=1e-6)
        kept = (merged[name] != base[name]).float().mean()
        if base[name].is_floating_point():
            assert 0 < kept < 0.5


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
def test_dare_is_reproducible_for_a_seed_and_differs_across_seeds(method):
    base, experts = state_dicts(2)
    run = lambda seed: merge_state_dicts(method, base, experts, params={"density": 0.5}, seed=seed)  # noqa: E731
    a, b, c = run(0), run(0), run(1)
    for name in base:
        assert torch.equal(a[name], b[name])
    assert any(not torch.equal(a[n], c[n]) for n in base if base[n].is_floating_point())


def test_dare_masks_differ_between_tensors_and_keep_about_density():
    g1 = TensorContext(name="a", seed=0).generator()
    g2 = TensorContext(name="b", seed=0).generator()
    m1 = torch.rand(10_000, generator=g1) < 0.3
    m2 = torch.rand(10_000, generator=g2) < 0.3
    assert not torch.equal(m1, m2)
    assert abs(m1.float().mean().item() - 0.3) < 0.02


def test_dare_keep_rate_rescale_is_unbiased():
    """E[DARE(τ)] = τ under the paper's 1/(1−p) rescale: the mean over many seeds approaches τ."""
    base = torch.zeros(2000)
    expert = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    method = get_merge_method("dare_linear")
    mean = torch.zeros(2000)
    for seed in range(200):
        mean += method(base, [expert], ctx=TensorContext("w", seed), density=0.5) / 200
    # each entry averages 200 draws of τ·Bernoulli(0.5)/0.5: std |τ|/sqrt(200) ≈ 0.07|τ|
    assert (mean - expert).abs().mean() < 0.1 * expert.abs().mean()


def test_inputs_are_not_modified():
    base, experts = state_dicts(3)
    snapshot = [{k: v.clone() for k, v in sd.items()} for sd in [base, *experts]]
    for method in BUILT_IN:
        used = experts[:1] if method == "slerp" else experts
        sparse = "density" in get_merge_method(method).per_model
        merge_state_dicts(method, base, used, params={"density": 0.5} if sparse else None)
    for sd, saved in zip([base, *experts], snapshot):
        for name in sd:
            assert torch.equal(sd[name], saved[name])


def test_output_dtype_follows_the_checkpoint_and_buffers_are_copied():
    base, experts = state_dicts(2)

    def half(sd):
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}

    merged = merge_state_dicts("ties", half(base), [half(e) for e in experts])
    assert merged["layer.weight"].dtype == torch.bfloat16
    assert torch.equal(merged["step"], base["step"])
