"""Two helpers every decoding loop shares: how scores are warped for sampling, and the order
in which a batch's prompts are decoded."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def warp_logprobs(
    logprobs: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """Sampling scores ``[B, V]``: temperature, then top-k, then nucleus (top-p) filtering."""
    if temperature <= 0:
        raise ValueError(f"sampling temperature must be > 0, got {temperature}")
    scores = logprobs / temperature if temperature != 1.0 else logprobs
    if top_k is not None and 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        if top_p <= 0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # the most likely token is always kept
        sorted_scores = sorted_scores.masked_fill(mass_before >= top_p, float("-inf"))
        scores = torch.empty_like(scores).scatter_(-1, order, sorted_scores)
    return scores


def batch_order(encoded: Sequence[Sequence[int]]) -> list[int]:
    """The order rows are decoded in: longest prompts first, so that a batch holds prompts of
    similar length (results return in input order)."""
    return sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
