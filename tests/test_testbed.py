"""The linear testbed: task arithmetic ≡ logit composition exactly when logits are linear in θ.

Tolerances: "round-off" is a max |Δ log p| ≤ 1e-10 nats in float64 (observed ~1e-14); "breaks" is
a max |Δ log p| > 1e-4 nats and a mean KL > 1e-4 nats (observed ~1e-1 and more).
"""

from __future__ import annotations

import math

import pytest
import torch

from mergelab.compose import compose_logprobs
from mergelab.merge import merge_models, merge_state_dicts
from mergelab.outputs import OutputExistsError
from mergelab.testbed import (
    BlendedActivation,
    ContextFeatures,
    LinearizedModel,
    LogLinearModel,
    MLPModel,
    all_contexts,
    build_model,
    context_logprobs,
    finetune,
    fit_max_likelihood,
    make_task_family,
    max_abs_logprob_difference,
    mean_kl,
    next_token_counts,
    sample_sequences,
    task_accuracies,
    task_targets,
)

ROUNDOFF = 1e-10
V = 16


def _logprobs_of_state_dict(model: torch.nn.Module, state_dict) -> torch.Tensor:
    model.load_state_dict(state_dict)
    return context_logprobs(model, V)


# ---------------------------------------------------------------- the exact equivalence


@pytest.mark.parametrize("n_experts", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_task_arithmetic_equals_composition_for_random_log_linear_models(n_experts, seed):
    """θ_b + Σ w_i (θ_i − θ_b) and log p_b + Σ w_i (log p_i − log p_b): same distribution."""
    g = torch.Generator().manual_seed(seed)
    base = LogLinearModel(V)
    base_sd = {
        k: torch.randn(v.shape, generator=g, dtype=torch.float64)
        for k, v in base.state_dict().items()
    }
    expert_sds = [
        {
            k: v + 2.0 * torch.randn(v.shape, generator=g, dtype=torch.float64)
            for k, v in base_sd.items()
        }
        for _ in range(n_experts)
    ]
    weights = (3.0 * torch.rand(n_experts, generator=g, dtype=torch.float64) - 1.0).tolist()

    merged_sd = merge_state_dicts(
        "task_arithmetic", base_sd, expert_sds, weights=weights, dtype=torch.float64
    )
    merged_lp = _logprobs_of_state_dict(base, merged_sd)
    base_lp = _logprobs_of_state_dict(base, base_sd)
    expert_lps = [_logprobs_of_state_dict(base, sd) for sd in expert_sds]
    composed = compose_logprobs(base_lp, expert_lps, weights)

    assert merged_lp.dtype == torch.float64
    assert max_abs_logprob_difference(merged_lp, composed) <= ROUNDOFF
    # λ scales every weight: task arithmetic with λ is composition with λ·w_i.
    lam = 0.7
    merged_sd = merge_state_dicts(
        "task_arithmetic",
        base_sd,
        expert_sds,
        weights=weights,
        params={"lambda_": lam},
        dtype=torch.float64,
    )
    composed = compose_logprobs(base_lp, expert_lps, [lam * w for w in weights])
    assert (
        max_abs_logprob_difference(_logprobs_of_state_dict(base, merged_sd), composed) <= ROUNDOFF
    )


def _trained_family_and_counts(seed=0, n_sequences=1024):
    family = make_task_family(vocab_size=V, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    base_counts = next_token_counts(
        sample_sequences(family.background_logits, n_sequences, 32, generator=g), V
    )
    expert_counts = [
        next_token_counts(sample_sequences(e, n_sequences, 32, generator=g), V)
        for e in family.expert_logits
    ]
    return family, base_counts, expert_counts


@pytest.fixture(scope="module")
def trained_mlp():
    """A non-linear network (GELU MLP, depth 2) trained on the background task, and its data."""
    family, base_counts, expert_counts = _trained_family_and_counts()
    base = build_model("mlp", V, depth=2, hidden=32, alpha=1.0, seed=0)
    fit_max_likelihood(base, all_contexts(V), base_counts, steps=150, lr=3e-2)
    return family, base, expert_counts


def test_trained_log_linear_experts_merge_to_their_composition():
    family, base_counts, expert_counts = _trained_family_and_counts()
    ctx = all_contexts(V)
    base = build_model("loglinear", V, seed=0)
    fit_max_likelihood(base, ctx, base_counts, steps=150, lr=0.1)
    experts = [finetune(base, ctx, c, steps=100, lr=0.1) for c in expert_counts]
    merged = merge_models("task_arithmetic", base, experts, dtype=torch.float64)
    composed = compose_logprobs(
        context_logprobs(base, V), [context_logprobs(e, V) for e in experts]
    )
    assert max_abs_logprob_difference(context_logprobs(merged, V), composed) <= ROUNDOFF
    # ... and the composition carries both skills: each expert task well above the base.
    acc = task_accuracies(composed, family)
    base_acc = task_accuracies(context_logprobs(base, V), family)
    for i in range(family.n_experts):
        assert acc[f"acc_expert_{i}"] >= 0.7 > base_acc[f"acc_expert_{i}"] + 0.4


def test_equivalence_breaks_for_a_nonlinear_network_with_standard_finetuning(trained_mlp):
    family, base, expert_counts = trained_mlp
    ctx = all_contexts(V)
    experts = [finetune(base, ctx, c, steps=60, lr=1e-2) for c in expert_counts]
    merged = merge_models("task_arithmetic", base, experts, dtype=torch.float64)
    composed = compose_logprobs(
        context_logprobs(base, V), [context_logprobs(e, V) for e in experts]
    )
    merged_lp = context_logprobs(merged, V)
    assert max_abs_logprob_difference(merged_lp, composed) > 1e-4
    assert mean_kl(merged_lp, composed) > 1e-4


@pytest.mark.parametrize("weights", [None, [0.6, 1.7]])
def test_tangent_space_experts_merge_to_their_composition_again(trained_mlp, weights):
    family, base, expert_counts = trained_mlp
    ctx = all_contexts(V)
    experts = [finetune(base, ctx, c, steps=40, lr=1e-2, tangent=True) for c in expert_counts]
    reference = LinearizedModel(base)
    merged = merge_models(
        "task_arithmetic", reference, experts, weights=weights, dtype=torch.float64
    )
    composed = compose_logprobs(
        context_logprobs(reference, V), [context_logprobs(e, V) for e in experts], weights
    )
    # The experts really moved (so the check is not 0 = 0) ...
    assert mean_kl(context_logprobs(experts[0], V), context_logprobs(reference, V)) > 1e-3
    # ... and yet merging their parameters is composing their distributions.
    assert max_abs_logprob_difference(context_logprobs(merged, V), composed) <= ROUNDOFF


# ---------------------------------------------------------------- the parts


def test_linearized_model_is_the_first_order_taylor_model():
    net = MLPModel(V, depth=2, hidden=16, alpha=1.0)
    lin = LinearizedModel(net)
    ctx = all_contexts(V)
    with torch.no_grad():
        assert torch.equal(lin(ctx), net(ctx))  # at θ = θ_b
        errors = []
        for eps in (1e-2, 1e-3):
            g = torch.Generator().manual_seed(0)
            moved = MLPModel(V, depth=2, hidden=16, alpha=1.0)
            moved.load_state_dict(net.state_dict())
            for p_lin, p_net in zip(lin.network.parameters(), moved.parameters()):
                d = eps * torch.randn(p_lin.shape, generator=g, dtype=torch.float64)
                p_lin.add_(d)
                p_net.add_(d)
            errors.append(float((lin(ctx) - moved(ctx)).abs().max()))
            lin = LinearizedModel(net)
        # The error of a first-order model shrinks quadratically: ×10 smaller step, ~×100 smaller.
        assert errors[1] < errors[0] / 30
    # θ_b is not in the state dict (so it is never merged), θ is.
    assert set(lin.state_dict()) == {f"network.{k}" for k in net.state_dict()}


def test_blended_activation_interpolates_identity_to_gelu():
    u = torch.linspace(-3, 3, 13, dtype=torch.float64)
    assert torch.equal(BlendedActivation(0.0)(u), u)
    assert torch.allclose(BlendedActivation(1.0)(u), torch.nn.functional.gelu(u))
    assert torch.allclose(BlendedActivation(1.0, "relu")(u), u.clamp(min=0))
    with pytest.raises(ValueError, match="alpha"):
        BlendedActivation(1.5)
    with pytest.raises(ValueError, match="activation"):
        BlendedActivation(0.5, "tanh")


def test_feature_map_rejects_wrong_context_shape():
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        ContextFeatures(V)(torch.zeros(4, 3, dtype=torch.long))
    assert ContextFeatures(V)(all_contexts(V)).sum(-1).eq(2).all()  # two one-hots per row


@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_task_family_is_factorised_with_the_requested_overlap(overlap):
    fam = make_task_family(
        vocab_size=V, n_experts=2, triggers_per_expert=4, overlap=overlap, seed=3
    )
    shared = set(fam.triggers[0]) & set(fam.triggers[1])
    assert len(shared) == round(4 * overlap)
    for i, logits in enumerate(fam.expert_logits):
        changed = (logits != fam.background_logits).any(-1).any(0)  # [b]: which last tokens differ
        assert set(changed.nonzero().flatten().tolist()) == set(fam.triggers[i])
    for b in shared:  # on a shared trigger the experts want different tokens
        assert fam.targets[0, b] != fam.targets[1, b]
    masks = task_targets(fam)
    total = sum(m.long() for m, _ in masks.values())
    assert total.min() >= 1 and masks["background"][0].sum() > 0
    with pytest.raises(ValueError, match="overlap"):
        make_task_family(overlap=1.5)


def test_counts_match_the_sampled_sequences_and_the_task():
    fam = make_task_family(vocab_size=V, seed=0)
    g = torch.Generator().manual_seed(0)
    seqs = sample_sequences(fam.background_logits, 8192, 24, generator=g)
    counts = next_token_counts(seqs, V)
    assert counts.sum() == 8192 * 22
    # A well-visited context: the empirical next-token distribution is close to the task's.
    row = int(counts.sum(-1).argmax())
    empirical = counts[row] / counts[row].sum()
    truth = torch.softmax(fam.background_logits.reshape(V * V, V)[row], -1)
    assert float((empirical - truth).abs().max()) < 0.03


def test_mean_kl_and_accuracy():
    p = torch.log_softmax(torch.randn(5, V, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(5, V, dtype=torch.float64), -1)
    assert mean_kl(p, p) == 0.0
    manual = (
        sum(
            sum(math.exp(a) * (a - b) for a, b in zip(pr.tolist(), qr.tolist()))
            for pr, qr in zip(p, q)
        )
        / 5
    )
    assert mean_kl(p, q) == pytest.approx(manual, rel=1e-12) and manual > 0
    fam = make_task_family(vocab_size=V, seed=0)
    truth = torch.log_softmax(fam.expert_logits[0].reshape(V * V, V), -1)
    assert (
        task_accuracies(torch.log_softmax(fam.background_logits.reshape(V * V, V), -1), fam)[
            "acc_background"
        ]
        == 1.0
    )
    assert task_accuracies(truth, fam)["acc_expert_0"] > 0.9


# ---------------------------------------------------------------- the study script


def test_the_ceiling_counts_each_shared_trigger_once():
    from studies.testbed.run import experts_accuracy_ceiling

    assert experts_accuracy_ceiling(((1, 2), (3, 4))) == 1.0  # disjoint: every expert can be right
    assert experts_accuracy_ceiling(((1, 2), (1, 2))) == 0.5  # same triggers, different targets
    assert experts_accuracy_ceiling(((1, 2, 3, 4), (1, 5, 6, 7))) == 7 / 8
    assert (
        experts_accuracy_ceiling(((1,), (1, 2))) == (1 + 1 / 2) / 2
    )  # the smaller task weighs more


def test_study_writes_results_then_figures_from_them_and_refuses_to_overwrite(tmp_path):
    from studies.testbed import figures, run

    cfg = {
        **run.CONFIG,
        "n_sequences": 256,
        "base_steps": 20,
        "finetune_steps": 10,
        "lambdas": [0.5, 1.0],
        "alphas": [0.0, 1.0],
        "depths": [1],
        "tangent_alphas": [1.0],
        "overlaps": [0.0, 1.0],
        "overlap_model": {"depth": 1, "alpha": 1.0},
    }
    out = tmp_path / "results"
    run.run_study(cfg, [0], out, force=False)
    rows, meta = figures.load_rows(out)
    assert meta["config"] == cfg and meta["seeds"] == [0]
    tangent = [
        r
        for r in rows
        if r["finetune"] == "tangent" and r["method"] == "task_arithmetic" and r["lambda"] == 1.0
    ]
    assert tangent and all(r["max_abs_logprob_diff"] <= ROUNDOFF for r in tangent)
    loglin = [
        r
        for r in rows
        if r["model"] == "loglinear" and r["method"] == "task_arithmetic" and r["lambda"] == 1.0
    ]
    assert len(loglin) == 2 and all(r["max_abs_logprob_diff"] <= ROUNDOFF for r in loglin)
    comp = [r for r in rows if r["method"] == "composition"]
    assert {r["acc_experts_ceiling"] for r in comp if r["overlap"] == 1.0} == {0.5}
    assert {r["acc_experts_ceiling"] for r in comp if r["overlap"] == 0.0} == {1.0}
    assert all(r["acc_experts_mean"] <= r["acc_experts_ceiling"] for r in rows)
    paths = figures.plot_all(out, tmp_path / "figures")
    assert all(p.exists() and p.stat().st_size > 10_000 for p in paths)
    with pytest.raises(OutputExistsError, match="--force"):
        run.run_study(cfg, [0], out, force=False)


def test_force_never_replaces_a_file_the_study_did_not_write(tmp_path):
    from mergelab.outputs import ForeignOutputError
    from studies.testbed import run

    out = tmp_path / "results"
    out.mkdir()
    mine = out / "config.json"
    mine.write_text('{"my": "own settings"}')
    with pytest.raises(ForeignOutputError, match="config.json"):
        run.run_study(run.CONFIG, [0], out, force=True)  # refused before any training
    assert mine.read_text() == '{"my": "own settings"}' and sorted(
        p.name for p in out.iterdir()
    ) == ["config.json"]


def test_rerun_check_finds_every_difference_and_only_those(tmp_path):
    import csv as _csv

    from studies.testbed import rerun_check

    committed = rerun_check.read_rows(rerun_check.ROOT / rerun_check.COMMITTED)
    same = rerun_check.compare_rows(committed, committed)
    assert same["rows_shared"] == len(committed)
    assert all(
        c["rows_differing"] == 0 and c["max_abs_diff"] == 0.0 for c in same["columns"].values()
    )
    rows = [dict(r) for r in committed.values()]
    rows[3]["kl_to_composition"] = str(float(rows[3]["kl_to_composition"]) + 2.5e-4)
    path = tmp_path / "rerun.csv"
    with open(path, "w", newline="") as f:
        writer = _csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    diff = rerun_check.compare_rows(committed, rerun_check.read_rows(path))["columns"]
    assert diff["kl_to_composition"]["rows_differing"] == 1
    assert abs(diff["kl_to_composition"]["max_abs_diff"] - 2.5e-4) < 1e-12
    assert diff["acc_experts_mean"]["rows_differing"] == 0
    assert rerun_check.main([str(tmp_path / "missing.csv"), str(tmp_path / "out.json")]) == 2
    assert rerun_check.main([str(path), str(tmp_path / "out.json")]) == 0
