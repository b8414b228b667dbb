"""Token-mask (projective) composition: the factorised-conditionals theorem, made checkable.

Split the vocabulary into disjoint masks M_1..M_k (the rest is the background M_b). If expert i
differs from the base only on M_i — p_i(y) = c·p_b(y) for every y outside M_i — then the
composition p̂ ∝ p_b Π_i p_i/p_b is *projective*: restricted to M_i and renormalised it equals
p_i restricted to M_i, and on M_b it equals p_b (docs/composition.md §2; Bradley et al. 2025).

* :func:`project_onto_mask` turns any expert into one that satisfies the assumption exactly:
  it keeps p_i on M_i and puts the base's shape (with p_i's total mass) outside. Passing
  ``token_masks=`` to :class:`~mergelab.compose.ComposedDecoder` composes projected experts.
* :func:`check_projectivity` measures how far given distributions are from the assumption and
  from the conclusion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

NEG_INF = float("-inf")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float32 at least; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def project_onto_mask(base: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[..., V]`` equal to ``expert`` on ``mask`` and ∝ ``base`` off it.

    Off the mask the result is ``base + log p_e(¬M) − log p_b(¬M)``, so the total mass off the
    mask stays the expert's and the result sums to 1.
    """
    mask = mask.to(device=expert.device, dtype=torch.bool)
    base, expert = _wide(base), _wide(expert)
    off_expert = torch.logsumexp(expert.masked_fill(mask, NEG_INF), dim=-1, keepdim=True)
    off_base = torch.logsumexp(base.masked_fill(mask, NEG_INF), dim=-1, keepdim=True)
    outside = base + (off_expert - off_base)
    outside = torch.nan_to_num(outside, nan=NEG_INF, posinf=NEG_INF)  # base has no mass off M
    return torch.where(mask, expert, outside)


def check_disjoint(masks: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` if two masks share a token."""
    masks = [torch.as_tensor(m, dtype=torch.bool) for m in masks]
    for i in range(len(masks)):
        for j in range(i + 1, len(masks)):
            shared = (masks[i] & masks[j]).nonzero().flatten()
            if shared.numel():
                raise ValueError(f"masks {i} and {j} share tokens {shared[:10].tolist()}")


def _restricted(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-probs renormalised over ``mask`` (−inf elsewhere)."""
    out = torch.log_softmax(_wide(lp).masked_fill(~mask, NEG_INF), dim=-1)
    return out.masked_fill(torch.isnan(out), NEG_INF)  # an empty mask has no distribution


def _max_abs_on(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a − b| over the mask, counting −inf == −inf as 0."""
    both_inf = torch.isneginf(a) & torch.isneginf(b)
    diff = (a - b).abs().masked_fill(both_inf | ~mask, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


@dataclass
class ProjectivityReport:
    """How far a composition is from the factorised-conditionals assumption and conclusion.

    ``factorisation_violation[i]``: max over positions of the spread (max − min) of
    log p_i − log p_b over tokens outside M_i (0 when expert i differs from the base only on
    M_i). ``projection_error[i]``: max |log p̂|_{M_i} − log p_i|_{M_i}| of the distributions
    renormalised on M_i; ``projection_tv[i]`` the total-variation distance between them.
    ``background_error``: the same for p̂ vs p_b on the background mask (no expert's tokens).
    """

    factorisation_violation: list[float]
    projection_error: list[float]
    projection_tv: list[float]
    background_error: float
    background_tv: float

    def holds(self, atol: float = 1e-4) -> bool:
        return max(self.projection_error + [self.background_error]) <= atol

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_projectivity(
    composed: torch.Tensor,
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
) -> ProjectivityReport:
    """Compare ``composed [..., V]`` with each expert on its mask and with the base elsewhere.

    All inputs are log-probs of the same shape; ``masks`` are bool ``[V]`` and must be disjoint.
    """
    if len(experts) != len(masks):
        raise ValueError(f"{len(experts)} experts but {len(masks)} masks")
    masks = [torch.as_tensor(m, dtype=torch.bool, device=composed.device) for m in masks]
    check_disjoint(masks)
    violation, error, tv = [], [], []
    for lp, m in zip(experts, masks):
        ratio = (_wide(lp) - _wide(base)).masked_fill(m, NEG_INF)
        finite = torch.isfinite(ratio)
        hi = ratio.masked_fill(~finite, NEG_INF).max(dim=-1).values
        lo = ratio.masked_fill(~finite, float("inf")).min(dim=-1).values
        spread = (hi - lo).clamp(min=0.0)
        spread = spread.masked_fill(~torch.isfinite(spread), 0.0)
        violation.append(float(spread.max()) if spread.numel() else 0.0)
        a, b = _restricted(composed, m), _restricted(lp, m)
        error.append(_max_abs_on(a, b, m.expand_as(a)))
        tv.append(float(0.5 * (a.exp() - b.exp()).abs().sum(-1).max()) if bool(m.any()) else 0.0)
    background = (
        ~torch.stack(masks).any(0) if masks else torch.ones_like(composed[..., 0], dtype=torch.bool)
    )
    a, b = _restricted(composed, background), _restricted(base, background)
    if bool(background.any()):
        bg_error = _max_abs_on(a, b, background.expand_as(a))
        bg_tv = float(0.5 * (a.exp() - b.exp()).abs().sum(-1).max())
    else:
        bg_error = bg_tv = 0.0
    return ProjectivityReport(violation, error, tv, bg_error, bg_tv)
