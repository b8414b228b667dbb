"""The registered merge methods. Each is a pure function over one parameter tensor.

Conventions: ``base`` is θ_b, ``experts`` are θ_i, a *task vector* is τ_i = θ_i − θ_b. All
tensors arrive in the compute dtype (float32 by default); the engine casts the result back.
"""

from __future__ import annotations

import torch

from .registry import TensorContext, merge_method


def task_vectors(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """Stack τ_i = θ_i − θ_b into shape ``[n_experts, *base.shape]``."""
    return torch.stack([e - base for e in experts])


def _broadcast(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-expert scalars as a ``[n, 1, 1, ...]`` tensor that broadcasts against a stack."""
    t = torch.tensor(values, dtype=like.dtype, device=like.device)
    return t.view(-1, *([1] * (like.dim() - 1)))


@merge_method("linear", per_model=("weight",), needs_base=False)
def linear(
    base: torch.Tensor | None,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    normalize: bool = True,
    ctx: TensorContext,
) -> torch.Tensor:
    """Weighted average of the models (model soup): Σ w_i θ_i / Σ w_i.

    ``normalize=False`` gives the plain weighted sum Σ w_i θ_i. mergekit's ``linear`` normalises by
    default, as here. The base, if given, is not part of the average.
    """
    stack = torch.stack(experts)
    merged = (_broadcast(weight, stack) * stack).sum(0)
    if normalize:
        total = sum(weight)
        if total == 0:
            raise ValueError("linear merge: weights sum to zero, cannot normalise")
        merged = merged / total
    return merged


@merge_method("task_arithmetic", per_model=("weight",))
def task_arithmetic(
    base: torch.Tensor,
    experts: list[torch.Tensor],
    *,
    weight: list[float],
    lambda_: float = 1.0,
    ctx: TensorContext,
) -> torch.Tensor:
    """Task arithmetic (Ilharco et al. 2023): θ_b + λ Σ_i w_i τ_i.

    With λ = 1 and w_i = 1 on a model whose logits are linear in θ this is exactly logit
    composition. PEFT's ``task_arithmetic`` returns Σ w_i τ_i only (no base, no λ); mergekit's
    equals this with λ as its ``lambda`` (default 1) and ``normalize`` off.
    """
    tv = task_vectors(base, experts)
    return base + lambda_ * (_broadcast(weight, tv) * tv).sum(0)
