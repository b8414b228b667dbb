"""End-of-sequence policies: who decides when a composition stops.

The paper found that composing more than two experts degraded termination: the EOS token's
composed probability is a product of ratios like every other token's, and small disagreements
about *when* to stop compound. A policy replaces the composed probability of each EOS id and
rescales the other tokens so the distribution still sums to 1:

* ``"plain"`` (default) — the composition's own EOS probability (the paper's rule).
* ``"base"`` — the anchor (base) model's EOS probability: stop when the base would stop.
* ``"max"`` — the largest EOS probability over all components: stop as soon as any would.
* ``"min"`` — the smallest: stop only when every component is ready to.
* ``"most_confident"`` — the EOS probability of the component whose top-1 probability is
  highest at this step (the one most sure of what comes next).

"Each EOS id" is every id of the candidate's EOS set: its tokenizer's EOS and every id its models
declare in ``generation_config.eos_token_id`` (see :mod:`mergelab.compose.decoding`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

EOS_POLICIES = ("plain", "base", "max", "min", "most_confident")


def check_eos_policy(policy: str, has_anchor: bool) -> str:
    if policy not in EOS_POLICIES:
        raise ValueError(f"unknown eos_policy {policy!r}; choose one of {EOS_POLICIES}")
    if policy == "base" and not has_anchor:
        raise ValueError("eos_policy 'base' needs a composition with a base (anchor) model")
    return policy


def apply_eos_policy(
    composed: torch.Tensor,
    components: Sequence[torch.Tensor],
    eos_ids: torch.Tensor,
    policy: str,
    anchor_index: int | None = 0,
) -> torch.Tensor:
    """Replace the EOS log-probs of ``composed [..., V]`` per ``policy``; returns ``[..., V]``.

    ``components`` are the component log-probs (same shape, anchor at ``anchor_index``);
    ``eos_ids`` a 1-D long tensor of the EOS token ids. Non-EOS tokens keep their relative
    composed probabilities and share the remaining mass ``1 − Σ p(EOS)``.
    """
    if policy == "plain" or eos_ids.numel() == 0:
        return composed
    stacked_eos = torch.stack([c.index_select(-1, eos_ids) for c in components])  # [n, ..., E]
    if policy == "base":
        assert anchor_index is not None
        target = stacked_eos[anchor_index]
    elif policy == "max":
        target = stacked_eos.max(dim=0).values
    elif policy == "min":
        target = stacked_eos.min(dim=0).values
    elif policy == "most_confident":
        top1 = torch.stack([c.max(dim=-1).values for c in components])  # [n, ...]
        who = top1.argmax(dim=0)  # [...]
        target = torch.gather(
            stacked_eos, 0, who.unsqueeze(0).unsqueeze(-1).expand_as(stacked_eos[:1])
        )[0]
    else:
        raise ValueError(f"unknown eos_policy {policy!r}")
    target = target.to(composed.dtype)
    # Several EOS ids whose chosen probabilities sum past 1 (possible under "max"): scale down.
    total = torch.logsumexp(target, dim=-1, keepdim=True)
    target = target - total.clamp(min=0.0)
    total = total.clamp(max=0.0)
    rest = (-torch.expm1(total)).clamp(min=0.0)  # 1 − Σ p(EOS)

    is_eos = torch.zeros(composed.shape[-1], dtype=torch.bool, device=composed.device)
    is_eos[eos_ids] = True
    others = torch.log_softmax(composed.masked_fill(is_eos, float("-inf")), dim=-1)
    others = others.masked_fill(torch.isnan(others), float("-inf"))  # all mass was on EOS
    out = others + torch.log(rest)
    out[..., eos_ids] = target
    return out
