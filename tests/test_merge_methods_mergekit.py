"""The methods added from mergekit (della, della_linear, sce, nuslerp, multislerp, karcher,
nearswap, arcee_fusion, passthrough), pinned to mergekit 0.1.5 tensor by tensor and end to end.

Tolerance: float32 round-off, ``rtol = atol = 1e-6`` (same terms, possibly summed in another
order). Nothing is compared statistically against mergekit:

* DELLA's random draws are reproduced exactly. mergekit draws one ``torch.bernoulli`` per expert
  from torch's global RNG, we draw the same call from the per-tensor generator; seeding the global
  RNG with that generator's seed (``with_rng_of``) makes both draw the same masks, so the random
  methods are compared to 1e-6 like the deterministic ones. The same holds for arcee_fusion's
  quantile sample (tensors over 10⁶ entries, ``torch.randint``). MAGPRUNE alone is
  bit-identical in float32, bfloat16 and float16; in bfloat16 DELLA's sign election may differ
  at entries where Σ w τ ≈ 0 (summation order), bounded to < 0.1% of the entries.
* SCE's selection keeps exact ties with its last entry where mergekit's ``topk`` keeps exactly k;
  the data are continuous random values, so there are none (asserted).

The paper's DELLA rescaling (``rescale="keep_rate"``, not in mergekit) is pinned by its defining
properties instead: survivors are τ_j / p_j and the estimate is unbiased, with keep frequencies
that follow the rank-linear probabilities (statistical checks with 5-sigma bounds).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _reference import require

from mergelab.merge import TensorContext, merge_models
from mergelab.merge.accelerator import thresholds
from mergelab.merge.methods import steps

mk_registry = require("mergekit.merge_methods.registry")
from mergekit.merge_methods.karcher import karcher_merge_tensors  # noqa: E402

mk_sparsify = require("mergekit.sparsify")

from _mergekit import WEIGHTS, mergekit, run, tiny_llama_family  # noqa: E402

TOL = {"rtol": 1e-6, "atol": 1e-6}
SHAPES = [(48, 40), (40,), (6, 5, 4)]


def make(shape, k, seed=0, scale=0.1):
    """A base and ``k`` experts = base + seeded perturbations of different sizes."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    experts = [base + scale * (i + 1) * torch.randn(shape, generator=g) for i in range(k)]
    return base, experts


@contextlib.contextmanager
def with_rng_of(name, seed):
    """torch's global RNG seeded as our generator for tensor ``name`` is (restored afterwards)."""
    with torch.random.fork_rng():
        torch.manual_seed(TensorContext(name=name, seed=seed).generator().initial_seed())
        yield


# --- DELLA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(
    ("method", "normalize", "rescale"),
    [
        ("della", True, True),
        ("della", False, False),
        ("della_linear", False, True),
        ("della_linear", True, False),
    ],
)
def test_della_equals_mergekit(shape, k, method, normalize, rescale):
    base, experts = make(shape, k, seed=k)
    density, epsilon = [0.5, 1.0, 0.6][:k], [0.1, 0.15, 0.05][:k]  # density 1: no draw in either
    weights = [1.0, -0.5, 0.8][:k] if method == "della" else WEIGHTS[:k]
    with with_rng_of("w", 3):
        ref = mergekit(
            method,
            base,
            experts,
            weight=weights,
            density=density,
            epsilon=epsilon,
            normalize=normalize,
            rescale=rescale,
            **{"lambda": 1.3},
        )
    ours = run(
        method,
        base,
        experts,
        seed=3,
        weight=weights,
        density=density,
        epsilon=epsilon,
        normalize=normalize,
        rescale="l1" if rescale else "none",
        lambda_=1.3,
    )
    torch.testing.assert_close(ours, ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 300), (3000,), (6, 5, 4)])
@pytest.mark.parametrize("rescale", [True, False])
def test_magprune_equals_mergekit_in_every_dtype(dtype, shape, rescale):
    """The sparsification alone is bit-identical, in bfloat16 (ranks > 256 round, many ties in
    |τ|) and float16 (drawn and rescaled in float32 on CPU) too."""
    tau = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.random.fork_rng():
        torch.manual_seed(11)
        ref = mk_sparsify.della_magprune(
            tau, 0.6, 0.15, mk_sparsify.RescaleNorm.l1 if rescale else None
        )
    ours = steps.magprune_(
        tau.clone(), 0.6, 0.15, torch.Generator().manual_seed(11), "l1" if rescale else "none"
    )
    assert ours.dtype == dtype and torch.equal(ours, ref)


def test_della_bfloat16_agrees_except_at_sign_ties():
    """In bfloat16 the draws are identical, but the sign election sums in another order: a few
    entries whose Σ w τ is ~0 may elect the other sign; the rest agree to bfloat16 rounding."""
    base, experts = make((64, 512), 3)
    base, experts = base.bfloat16(), [e.bfloat16() for e in experts]
    kw = {"weight": WEIGHTS, "density": 0.5, "epsilon": 0.1}
    with with_rng_of("w", 3):
        ref = mergekit("della", base, experts, dtype=torch.bfloat16, **kw)
    ours = run("della", base, experts, seed=3, rescale="l1", **kw)
    close = torch.isclose(ours.float(), ref.float(), rtol=1.6e-2, atol=1e-2)
    assert ours.dtype == torch.bfloat16 and (~close).float().mean() < 1e-3


def test_della_draws_differ_per_tensor_and_seed():
    base, experts = make((48, 40), 2)
    a = run("della", base, experts, name="a", seed=0)
    assert not torch.equal(a, run("della", base, experts, name="b", seed=0))
    assert not torch.equal(a, run("della", base, experts, name="a", seed=1))
    assert torch.equal(a, run("della", base, experts, name="a", seed=0))


def test_magprune_keep_probabilities_are_rank_linear():
    tau = torch.randn(7, 33)
    p = steps.magprune_keep_probabilities(tau, 0.6, 0.15)
    ranks = tau.abs().argsort(1).argsort(1).float()
    torch.testing.assert_close(p, 0.45 + 0.3 * ranks / 32, **TOL)
    torch.testing.assert_close(p.mean(1), torch.full((7,), 0.6), **TOL)
    one_row = steps.magprune_keep_probabilities(torch.randn(33), 0.6, 0.15)
    assert one_row.min() == pytest.approx(0.45) and one_row.max() == pytest.approx(0.75)
    assert torch.all(steps.magprune_keep_probabilities(torch.randn(5, 1), 0.6, 0.15) == 0.6)


def test_magprune_paper_rescale_is_unbiased_and_follows_the_probabilities():
    """rescale="keep_rate" (DELLA paper): survivors τ_j / p_j, E[result] = τ; keep frequency by
    rank ≈ p(rank). 4000 rows × 50: binomial standard errors ≈ 0.008 per rank."""
    rows, n, density, epsilon = 4000, 50, 0.5, 0.2
    tau = torch.randn(rows, n, generator=torch.Generator().manual_seed(9))
    p = steps.magprune_keep_probabilities(tau, density, epsilon)
    out = steps.magprune_(tau.clone(), density, epsilon, torch.Generator().manual_seed(1))
    kept = out != 0
    torch.testing.assert_close(out[kept], (tau / p)[kept], **TOL)  # each survivor over its own p
    ratio = (out / tau).mean()  # E[keep / p] = 1, standard error ≈ 0.002
    assert abs(float(ratio) - 1) < 0.01
    rank = tau.abs().argsort(1).argsort(1)
    by_rank = torch.zeros(n).scatter_add_(0, rank.reshape(-1), kept.float().reshape(-1)) / rows
    expected = density - epsilon + 2 * epsilon * torch.arange(n) / (n - 1)
    assert (by_rank - expected).abs().max() < 5 * (0.25 / rows) ** 0.5
    assert abs(float(kept.float().mean()) - density) < 5 * (0.25 / kept.numel()) ** 0.5


def test_della_paper_and_mergekit_rescale_differ():
    base, experts = make((48, 40), 3)
    paper = run("della", base, experts, weight=WEIGHTS)
    l1 = run("della", base, experts, weight=WEIGHTS, rescale="l1")
    assert (paper - l1).abs().max() > 1e-3


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_della_refuses_a_window_outside_0_1(method):
    base, experts = make((8, 8), 2)
    with pytest.raises(ValueError, match=r"model 1 has density 0.9 and epsilon 0.15.*\(0, 1\)"):
        run(method, base, experts, density=[0.5, 0.9], epsilon=0.15)
    with pytest.raises(ValueError, match=r"epsilon must lie in \[0, 0.5\)"):
        run(method, base, experts, epsilon=-0.1)


# --- SCE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("select_topk", [1.0, 0.5, 0.1])
def test_sce_equals_mergekit(shape, k, select_topk):
    base, experts = make(shape, k, seed=k)
    if select_topk < 1:  # the premise of exact agreement (module docstring)
        variance = torch.stack([e - base for e in experts]).var(0, correction=0)
        n_kept = int(torch.count_nonzero(variance) * select_topk)
        assert int((variance == thresholds.kth_largest_abs(variance, n_kept)).sum()) == 1
    ref = mergekit("sce", base, experts, select_topk=select_topk)
    torch.testing.assert_close(run("sce", base, experts, select_topk=select_topk), ref, **TOL)


def test_sce_tiny_task_vectors_fall_back_to_equal_coefficients():
    base, experts = make((48, 40), 3, scale=1e-4)  # Σ mean(τ²) < 1e-6: mergekit's uniform η
    taus = torch.stack([e - base for e in experts])
    assert torch.equal(steps.sce_coefficients(taus), torch.full((3,), 1 / 3))
    torch.testing.assert_close(run("sce", base, experts), mergekit("sce", base, experts), **TOL)


# --- NuSLERP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_base", [True, False])
@pytest.mark.parametrize("weights", [[1.0, 1.0], [0.3, 0.9], [1.0, -1.0]])
@pytest.mark.parametrize(("flatten", "row_wise"), [(True, False), (False, False), (False, True)])
def test_nuslerp_equals_mergekit(shape, with_base, weights, flatten, row_wise):
    base, experts = make(shape, 2)
    options = {"nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}
    used_base = base if with_base else None
    ref = mergekit("nuslerp", used_base, experts, weight=weights, **options)
    ours = run("nuslerp", used_base, experts, weight=weights, **options)
    torch.testing.assert_close(ours, ref, **TOL)


def test_nuslerp_colinear_is_linear_and_equal_weights_are_the_midpoint():
    a = torch.randn(40)
    ours = run("nuslerp", None, [a, 2 * a], weight=[1.0, 3.0])
    torch.testing.assert_close(ours, 0.25 * a + 0.75 * (2 * a), **TOL)
    torch.testing.assert_close(
        ours, mergekit("nuslerp", None, [a, 2 * a], weight=[1.0, 3.0]), **TOL
    )
    b = torch.randn(40)
    b = b - (a @ b) / (a @ a) * a  # orthogonal to a, then scaled to a's norm
    b = b * a.norm() / b.norm()
    torch.testing.assert_close(run("nuslerp", None, [a, b]), (a + b) / 2**0.5, **TOL)


def test_nuslerp_refuses_other_than_two_models():
    base, experts = make((8,), 3)
    with pytest.raises(
        ValueError, match="'nuslerp' takes exactly 2 models besides any base, got 3"
    ):
        run("nuslerp", base, experts)


# --- Multi-SLERP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("with_base", [True, False])
@pytest.mark.parametrize("normalize_weights", [True, False])
def test_multislerp_equals_mergekit(shape, k, with_base, normalize_weights):
    base, experts = make(shape, k, seed=k)
    used_base = base if with_base else None
    kw = {"weight": WEIGHTS[:k], "normalize_weights": normalize_weights}
    ref = mergekit("multislerp", used_base, experts, **kw)
    torch.testing.assert_close(run("multislerp", used_base, experts, **kw), ref, **TOL)


def test_multislerp_antipodal_models():
    a = torch.randn(40)
    ref = mergekit("multislerp", None, [a, -a], weight=[1.0, 1.0])
    torch.testing.assert_close(run("multislerp", None, [a, -a]), ref, **TOL)  # linear fallback
    with pytest.raises(ValueError, match="weighted mean direction of the models is zero"):
        run("multislerp", None, [a, -a, a, -a])
    with pytest.raises(ValueError, match="weights sum to zero"):
        run("multislerp", None, [a, 2 * a], weight=[1.0, -1.0])


def test_multislerp_of_one_model_is_that_model():
    base, (expert,) = make((8, 4), 1)
    torch.testing.assert_close(run("multislerp", base, [expert]), expert, rtol=0, atol=0)


# --- Karcher mean --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize(("max_iter", "tol"), [(10, 1e-5), (3, 1e-5), (10, 1e-3)])
def test_karcher_equals_mergekit(shape, k, max_iter, tol):
    _, experts = make(shape, k, seed=k, scale=0.5)
    ref = mergekit("karcher", None, experts, max_iter=max_iter, tol=tol)
    torch.testing.assert_close(
        run("karcher", None, experts, max_iter=max_iter, tol=tol), ref, **TOL
    )


def test_weighted_karcher_equals_mergekits_weighted_kernel():
    """Weights (the paper's weighted mean; mergekit's method passes equal ones) reach the same
    kernel as α_i = w_i / Σ w_i."""
    _, experts = make((48, 40), 3, scale=0.5)
    alphas = [w / sum(WEIGHTS) for w in WEIGHTS]
    ref = karcher_merge_tensors(experts, alphas)
    torch.testing.assert_close(run("karcher", None, experts, weight=WEIGHTS), ref, **TOL)


def test_karcher_of_identical_tensors_is_that_tensor():
    x = torch.randn(48, 40)
    torch.testing.assert_close(run("karcher", None, [x, x.clone(), x.clone()]), x, **TOL)
    torch.testing.assert_close(run("karcher", None, [x, 2 * x]), 1.5 * x, **TOL)  # norms average
    zero = torch.zeros(5)
    assert torch.equal(run("karcher", None, [zero, zero]), zero)


# --- NearSwap ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [0.0, 1e-3, 0.05, 1.0])
def test_nearswap_equals_mergekit(shape, t):
    base, experts = make(shape, 1)
    torch.testing.assert_close(
        run("nearswap", base, experts, t=t), mergekit("nearswap", base, experts, t=t), **TOL
    )


def test_nearswap_limits():
    base, (other,) = make((48, 40), 1)
    assert torch.equal(run("nearswap", base, [other], t=0.0), base)  # t → 0: the base
    torch.testing.assert_close(run("nearswap", base, [other], t=1e3), other, **TOL)
    near = (base - other).abs() < 0.05  # closer than t: the other model's value
    torch.testing.assert_close(run("nearswap", base, [other], t=0.05)[near], other[near], **TOL)
    with pytest.raises(
        ValueError, match="'nearswap' takes exactly 1 model besides the base, got 2"
    ):
        run("nearswap", base, [other, other])


# --- Arcee Fusion --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [*SHAPES, (1001, 1000)])  # > 10⁶ entries: sampled quantiles
def test_arcee_fusion_equals_mergekit(shape):
    base, experts = make(shape, 1)
    with with_rng_of("w", 4):
        ref = mergekit("arcee_fusion", base, experts)
    ours = run("arcee_fusion", base, experts, seed=4)
    torch.testing.assert_close(ours, ref, **TOL)
    taken = ours != base  # the other model's values where taken, the base's elsewhere
    assert 0 < int(taken.sum()) < ours.numel()
    torch.testing.assert_close(ours[taken], experts[0][taken], **TOL)


def test_arcee_fusion_refuses_two_models():
    base, experts = make((8, 8), 2)
    with pytest.raises(ValueError, match="'arcee_fusion' takes exactly 1 model besides the base"):
        run("arcee_fusion", base, experts)


# --- passthrough ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [None, 1.0, 0.5])
def test_passthrough_equals_mergekit(shape, scale):
    _, experts = make(shape, 1)
    params = {} if scale is None else {"scale": scale}
    ours = run("passthrough", None, experts, **params)
    torch.testing.assert_close(ours, mergekit("passthrough", None, experts, **params), **TOL)
    assert ours.data_ptr() != experts[0].data_ptr()  # a new tensor, never the input


def test_passthrough_refusals():
    base, experts = make((8,), 2)
    with pytest.raises(
        ValueError, match="'passthrough' takes exactly 1 model besides any base, got 2"
    ):
        run("passthrough", None, experts)
    with pytest.raises(ValueError, match="without a base"):
        run("passthrough", base, experts[:1])


# --- end to end on a tiny Llama ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llamas():
    return tiny_llama_family()


SEED = 21
# method: (use the base, number of experts, our params, weights, mergekit params)
TINY_CASES = {
    "della": (
        True,
        3,
        {"density": 0.6, "epsilon": 0.1, "rescale": "l1"},
        WEIGHTS,
        {"density": 0.6, "epsilon": 0.1, "weight": WEIGHTS},
    ),
    "della_linear": (
        True,
        3,
        {"density": 0.6, "epsilon": 0.2, "rescale": "l1"},
        WEIGHTS,
        {"density": 0.6, "epsilon": 0.2, "weight": WEIGHTS},
    ),
    "sce": (True, 3, {"select_topk": 0.3}, None, {"select_topk": 0.3}),
    "nuslerp": (True, 2, {}, [0.4, 0.6], {"weight": [0.4, 0.6]}),
    "multislerp": (True, 3, {}, WEIGHTS, {"weight": WEIGHTS}),
    "karcher": (False, 3, {}, None, {}),
    "nearswap": (True, 1, {"t": 0.01}, None, {"t": 0.01}),
    "arcee_fusion": (True, 1, {}, None, {}),
    "passthrough": (False, 1, {"scale": 0.5}, None, {"scale": 0.5}),
}


@pytest.mark.parametrize("method", sorted(TINY_CASES))
def test_tiny_llama_against_mergekit(llamas, method):
    base, experts = llamas
    use_base, k, params, weights, mk_params = TINY_CASES[method]
    base = base if use_base else None
    experts = experts[:k]
    merged = merge_models(method, base, experts, params=params, weights=weights, seed=SEED)
    base_sd = base.state_dict() if base is not None else None
    expert_sds = [e.state_dict() for e in experts]
    ours = merged.state_dict()
    assert ours.keys() == expert_sds[0].keys()
    for name in ours:
        with with_rng_of(name, SEED):
            ref = mergekit(
                method,
                base_sd[name] if base_sd is not None else None,
                [sd[name] for sd in expert_sds],
                name=name,
                **mk_params,
            )
        torch.testing.assert_close(ours[name], ref, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert not merged.training
