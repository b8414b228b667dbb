"""What the testbed measures: distance to the composition (nats) and per-task accuracy."""

from __future__ import annotations

import torch
from torch import nn

from mergelab.compose.diagnostics import kl_divergence

from .tasks import TaskFamily, all_contexts, task_targets


@torch.no_grad()
def context_logprobs(model: nn.Module, vocab_size: int) -> torch.Tensor:
    """Normalised next-token log-probs ``[V*V, V]`` (float64) on every context (a, b)."""
    model.eval()
    return torch.log_softmax(model(all_contexts(vocab_size)).to(torch.float64), dim=-1)


def per_context_kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) in nats per row, for normalised log-probs ``[N, V]`` → ``[N]``."""
    if logp.shape != logq.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(logp.shape)} vs {tuple(logq.shape)}")
    return kl_divergence(logp, logq)


def mean_kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """Mean per-token KL(p ‖ q) in nats, uniform over the rows (contexts)."""
    return float(per_context_kl(logp, logq).mean())


def max_abs_logprob_difference(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """max |log p − log q| over all entries: the equivalence tests' metric (nats)."""
    return float((logp - logq).abs().max())


def task_accuracies(logp: torch.Tensor, family: TaskFamily) -> dict[str, float]:
    """Top-1 accuracy on each task's contexts (uniform over contexts), keys ``acc_<task>``."""
    top1 = logp.argmax(-1)
    out = {}
    for name, (mask, target) in task_targets(family).items():
        out[f"acc_{name}"] = float((top1[mask] == target[mask]).double().mean())
    return out


def measure_against_composition(
    logp: torch.Tensor, composition: torch.Tensor, family: TaskFamily
) -> dict[str, float]:
    """One candidate's row: mean KL(p_candidate ‖ p_composition) (nats), the max absolute
    log-prob difference (nats) and the accuracy on every task plus the mean over experts."""
    accs = task_accuracies(logp, family)
    expert_accs = [accs[f"acc_expert_{i}"] for i in range(family.n_experts)]
    return {
        "kl_to_composition": mean_kl(logp, composition),
        "max_abs_logprob_diff": max_abs_logprob_difference(logp, composition),
        **accs,
        "acc_experts_mean": sum(expert_accs) / len(expert_accs),
    }
