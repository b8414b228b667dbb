"""The composition rule over next-token log-probabilities (arXiv 2605.28304, §1 of PAPER.md).

    log p̂ = log p_b + Σ_i w_i (log p_i − log p_b) − log Z

With w_i = 1 this is Σ_i log p_i − (k−1) log p_b − log Z, the paper's rule. Z is always computed
(a log-softmax over the vocabulary), in float32 or wider, whatever dtype the models run in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def compose_logprobs(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Compose normalised log-probs ``[..., vocab]``; returns normalised log-probs ``[..., vocab]``.

    ``base`` and each expert are log-probabilities (or logits: the per-model normalisers only add
    a constant per position, which the final log-softmax removes). Computation is in float32 at
    least (float64 stays float64). −inf entries are handled without NaN: a token impossible under
    the base but possible under an expert is resolved by treating ``w·(−inf − −inf)`` as 0 and
    ``w·(x − −inf)`` as +inf only where the base is −inf; see ``_safe_delta``.
    """
    dtype = torch.promote_types(base.dtype, torch.float32)
    b = base.to(dtype)
    if weights is None:
        weights = [1.0] * len(experts)
    if len(weights) != len(experts):
        raise ValueError(f"{len(weights)} weights for {len(experts)} experts")
    scores = b.clone()
    for w, e in zip(weights, experts):
        if e.shape != base.shape:
            raise ValueError(f"expert log-probs shape {tuple(e.shape)} != base {tuple(base.shape)}")
        scores = scores + _safe_delta(e.to(dtype), b, float(w))
    if temperature != 1.0:
        if temperature <= 0:
            raise ValueError("temperature must be > 0")
        scores = scores / temperature
    return torch.log_softmax(scores, dim=-1)


def _safe_delta(expert: torch.Tensor, base: torch.Tensor, weight: float) -> torch.Tensor:
    """w·(expert − base) with the conventions −inf − −inf = 0 (both rule the token out)."""
    delta = expert - base
    both_impossible = torch.isneginf(expert) & torch.isneginf(base)
    delta = torch.where(both_impossible, torch.zeros_like(delta), delta)
    if weight == 0.0:
        return torch.zeros_like(delta)
    return weight * delta
