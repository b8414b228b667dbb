"""Synthetic next-token tasks with a known, factorised structure (the testbed's data).

A *context* is the last ``context_length`` tokens of a sequence over a vocabulary of ``V`` tokens
(two by default: ``(a, b)`` with ``b`` the most recent); a *task* is a conditional next-token
distribution p(y | a, b), stored as a table of logits of shape ``[V, V, V]`` indexed ``[a, b, y]``.

* The **background** task has log-linear logits ``A[b, y] + B[a, y]`` (random, fixed by the seed).
* **Expert i** adds a boost γ to one token, ``π_i(b)``, whenever the last token ``b`` is one of its
  trigger tokens ``S_i`` ("after b, say π_i(b)", like the paper's letter-replacement experts) and
  equals the background everywhere else: it differs from the base only on its own contexts, the
  factorised setting in which logit composition is projective (docs/composition.md §2).
* ``overlap`` ρ ∈ [0, 1] makes all experts share ``round(ρ·m)`` of their ``m`` trigger tokens. On a
  shared trigger the experts want *different* tokens: that is where interference is predicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TaskFamily:
    """A background task and ``n_experts`` expert tasks over the same vocabulary and contexts."""

    vocab_size: int
    background_logits: torch.Tensor  # [V, V, V] logits of p_b(y | a, b), indexed [a, b, y]
    expert_logits: tuple[torch.Tensor, ...]  # one [V, V, V] table per expert
    triggers: tuple[tuple[int, ...], ...]  # S_i: the last tokens on which expert i is active
    targets: torch.Tensor  # [n_experts, V] long: π_i(b) for b in S_i, −1 elsewhere
    overlap: float
    boost: float
    seed: int

    @property
    def n_experts(self) -> int:
        return len(self.expert_logits)

    @property
    def task_names(self) -> list[str]:
        return ["background"] + [f"expert_{i}" for i in range(self.n_experts)]


def make_task_family(
    *,
    vocab_size: int = 16,
    n_experts: int = 2,
    triggers_per_expert: int = 4,
    overlap: float = 0.0,
    boost: float = 10.0,
    background_scale: float = 2.0,
    seed: int = 0,
) -> TaskFamily:
    """Draw a background task and experts (see the module docstring). Logits are float64.

    ``boost`` γ is added, in nats, to the logit of the expert's target token on its triggers;
    ``background_scale`` is the standard deviation of the background's random logits.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if n_experts < 1:
        raise ValueError(f"n_experts must be >= 1, got {n_experts}")
    shared = round(overlap * triggers_per_expert)
    own = triggers_per_expert - shared
    if shared + n_experts * own > vocab_size - 1:
        raise ValueError(
            f"{n_experts} experts with {triggers_per_expert} triggers each at overlap {overlap} need "
            f"{shared + n_experts * own} trigger tokens; vocab_size {vocab_size} leaves too few "
            "background tokens (at least one must stay background)"
        )
    if shared > 0 and n_experts > vocab_size - 1:
        raise ValueError("too few tokens to give each expert a different target on shared triggers")
    g = torch.Generator().manual_seed(seed)
    V = vocab_size
    A = background_scale * torch.randn(V, V, generator=g, dtype=torch.float64)  # [b, y]
    B = background_scale * torch.randn(V, V, generator=g, dtype=torch.float64)  # [a, y]
    background = A[None, :, :] + B[:, None, :]  # [a, b, y]

    order = torch.randperm(V, generator=g).tolist()
    shared_triggers, rest = order[:shared], order[shared:]
    triggers, targets = [], torch.full((n_experts, V), -1, dtype=torch.long)
    for i in range(n_experts):
        triggers.append(tuple(sorted(shared_triggers + rest[i * own : (i + 1) * own])))
    for b in range(V):
        # Experts active on the same trigger get distinct targets, so they genuinely conflict.
        owners = [i for i in range(n_experts) if b in triggers[i]]
        if owners:
            choices = torch.randperm(V, generator=g).tolist()
            for i, y in zip(owners, choices):
                targets[i, b] = y
    experts = []
    for i in range(n_experts):
        logits = background.clone()
        for b in triggers[i]:
            logits[:, b, targets[i, b]] += boost
        experts.append(logits)
    return TaskFamily(
        vocab_size=V,
        background_logits=background,
        expert_logits=tuple(experts),
        triggers=tuple(triggers),
        targets=targets,
        overlap=float(overlap),
        boost=float(boost),
        seed=seed,
    )


def sample_sequences(
    logits_table: torch.Tensor, n_sequences: int, length: int, *, generator: torch.Generator
) -> torch.Tensor:
    """Sample token sequences ``[n_sequences, length]`` from the task's next-token table.

    The first two tokens are uniform; every later token is drawn from p(· | previous two).
    """
    V = logits_table.shape[-1]
    if length < 3:
        raise ValueError(
            f"sequences need at least 3 tokens to hold a (context, next) pair, got {length}"
        )
    # Inverse-CDF sampling: one uniform per token (torch.multinomial is ~20x slower here).
    cdf = torch.softmax(logits_table.to(torch.float64), dim=-1).cumsum(-1)  # [V, V, V]
    seqs = torch.empty(n_sequences, length, dtype=torch.long)
    seqs[:, :2] = torch.randint(0, V, (n_sequences, 2), generator=generator)
    u = torch.rand(n_sequences, length, generator=generator, dtype=torch.float64)
    for t in range(2, length):
        row = cdf[seqs[:, t - 2], seqs[:, t - 1]]  # [N, V]
        seqs[:, t] = (row < u[:, t : t + 1]).sum(-1).clamp(max=V - 1)
    return seqs


def all_contexts(vocab_size: int) -> torch.Tensor:
    """Every context ``(a, b)`` once, as ``[V*V, 2]`` long, row ``a*V + b``."""
    a, b = torch.meshgrid(torch.arange(vocab_size), torch.arange(vocab_size), indexing="ij")
    return torch.stack([a.reshape(-1), b.reshape(-1)], dim=1)


def next_token_counts(sequences: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts of ``(a, b) → y`` in the sequences, as ``[V*V, V]`` float64 rows aligned with
    :func:`all_contexts`. Maximum likelihood on the sequences equals weighted cross-entropy on
    these rows (the models see only the context), which makes training cheap and exact."""
    V = vocab_size
    a, b, y = sequences[:, :-2], sequences[:, 1:-1], sequences[:, 2:]
    flat = ((a * V + b) * V + y).reshape(-1)
    return torch.bincount(flat, minlength=V**3).to(torch.float64).view(V * V, V)


def task_targets(family: TaskFamily) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For each task, ``(mask [V*V] bool, target [V*V] long)`` over :func:`all_contexts`.

    ``background``: contexts whose last token triggers no expert; target = the background's most
    likely next token. ``expert_i``: contexts whose last token is in ``S_i``; target = ``π_i(b)``
    (on shared triggers each expert keeps its own target, so both cannot be met at once).
    """
    V = family.vocab_size
    ctx = all_contexts(V)
    last = ctx[:, 1]
    any_trigger = torch.zeros(V * V, dtype=torch.bool)
    out = {}
    for i in range(family.n_experts):
        mask = family.targets[i, last] >= 0
        any_trigger |= mask
        out[f"expert_{i}"] = (mask, family.targets[i, last].clamp(min=0))
    background_target = family.background_logits.reshape(V * V, V).argmax(-1)
    return {"background": (~any_trigger, background_target), **out}
