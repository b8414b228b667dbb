"""Maximum-likelihood training, expert fine-tuning and tangent-space fine-tuning.

The models see only the context, so maximum likelihood on sequences equals a count-weighted
cross-entropy over the distinct contexts (see :func:`~mergelab.testbed.tasks.next_token_counts`);
training is full-batch Adam on those rows — exact and fast.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from mergelab.tiny import train

from .models import LinearizedModel


def mean_nll(model: nn.Module, contexts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per observed token (nats) of the counts ``[N, V]``."""
    logp = torch.log_softmax(model(contexts), dim=-1)
    return -(counts * logp).sum() / counts.sum()


def fit_max_likelihood(
    model: nn.Module,
    contexts: torch.Tensor,
    counts: torch.Tensor,
    *,
    steps: int = 300,
    lr: float = 1e-2,
) -> list[float]:
    """Train ``model`` in place by full-batch Adam on the count-weighted NLL; returns the losses."""
    if counts.shape[0] != contexts.shape[0]:
        raise ValueError(f"{counts.shape[0]} count rows for {contexts.shape[0]} contexts")
    full_batch = itertools.repeat((contexts, counts), steps)
    return train(model, full_batch, lambda m, batch: mean_nll(m, *batch), lr=lr, optimizer="adam")


def finetune(
    base: nn.Module,
    contexts: torch.Tensor,
    counts: torch.Tensor,
    *,
    steps: int = 150,
    lr: float = 5e-3,
    tangent: bool = False,
) -> nn.Module:
    """An expert fine-tuned from the base's parameters (the base is not modified).

    ``tangent=True`` fine-tunes the linearisation f(θ_b) + J(θ_b)(θ − θ_b) instead and returns a
    :class:`LinearizedModel`; otherwise a copy of ``base`` with all parameters trained.
    """
    expert = LinearizedModel(base) if tangent else copy.deepcopy(base)
    fit_max_likelihood(expert, contexts, counts, steps=steps, lr=lr)
    return expert
