"""When should composition work? Measure how "factorised" a base and its experts are.

The theory (docs/composition.md §2) says composition is exact when each expert differs from the base only
where it is active, and the experts' active sets do not overlap. On a set of texts (teacher
forced) :func:`composition_diagnostics` measures, per predicted token,

* ``KL(p_i ‖ p_b)`` for each expert i (nats) — how much expert i departs from the base there;
* which positions (and which target tokens) each expert is *active* on: KL above a threshold
  (defaults 0.01, 0.1, 1.0 nats);
* how often experts are active together (pairwise co-activity, and "all experts at once");
* how often the composed top-1 token differs from the top-1 of *every* component — the
  composition inventing a token no model would pick.

    report = composition_diagnostics(decoder, texts)
    json.dump(report.to_dict(), f)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import combinations
from typing import Any

import torch

from .decoding import DecodingCandidate, left_pad

DEFAULT_THRESHOLDS = (0.01, 0.1, 1.0)


def kl_divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q)`` over the last axis, in nats; 0·log 0 = 0, +inf where q = 0 < p.

    Computed in float32 at least; float64 inputs stay float64 (the testbed's round-off checks).
    """
    dtype = torch.promote_types(p_logprobs.dtype, torch.float32)
    p = p_logprobs.to(dtype).exp()
    diff = p_logprobs.to(dtype) - q_logprobs.to(dtype)
    terms = torch.where(p > 0, p * diff, torch.zeros_like(p))
    return terms.sum(-1)


def _key(threshold: float) -> str:
    return f"{threshold:g}"


@dataclass
class CompositionDiagnostics:
    """Per-token diagnostics of a composition; fractions are over ``n_positions`` positions.

    Keys of the per-threshold dicts are thresholds written with ``%g`` (``"0.01"``). Pairs are
    named ``"a&b"``. ``active_tokens[expert][threshold]`` counts the target tokens (decoded) at
    the positions where the expert was active, the ``top_tokens`` most common.
    ``per_position_kl[s][t][i]`` (only with ``keep_positions=True``) is KL(p_i ‖ p_b) at the
    t-th scored position of sequence s.
    """

    base: str
    experts: list[str]
    thresholds: list[float]
    n_sequences: int
    n_positions: int
    mean_kl: dict[str, float]
    median_kl: dict[str, float]
    active_fraction: dict[str, dict[str, float]]
    coactive_fraction: dict[str, dict[str, float]]
    all_active_fraction: dict[str, float]
    none_active_fraction: dict[str, float]
    composed_top1_differs_fraction: float
    active_tokens: dict[str, dict[str, dict[str, int]]]
    per_position_kl: list[list[list[float]]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def composition_diagnostics(
    decoder: DecodingCandidate,
    texts: Sequence[str],
    continuations: Sequence[str] | None = None,
    *,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    batch_size: int = 4,
    keep_positions: bool = False,
    top_tokens: int = 20,
) -> CompositionDiagnostics:
    """Diagnose ``decoder`` (a composition with a base) on ``texts``, teacher forced.

    Without ``continuations`` every position of each text that predicts a following token is
    scored. With them, ``texts`` are prompts and only the continuation's tokens are scored.
    """
    composition = decoder.composition
    if composition.anchor is None:
        raise ValueError("diagnostics measure experts against a base; the composition has none")
    names = list(decoder.runner.names)
    base_index = names.index(composition.anchor)
    experts = [n for n in names if n != composition.anchor]
    if continuations is not None and len(continuations) != len(texts):
        raise ValueError(f"{len(texts)} texts but {len(continuations)} continuations")
    thresholds = [float(t) for t in thresholds]

    sequences: list[tuple[list[int], int]] = []  # (ids, number of scored targets at the end)
    for i, text in enumerate(texts):
        if continuations is None:
            ids = decoder.encode_prompt(text)
            sequences.append((ids, len(ids) - 1))
        else:
            prompt, cont = (
                decoder.encode_prompt(text),
                decoder.encode_continuation(continuations[i]),
            )
            sequences.append((prompt + cont, len(cont)))

    kls: list[torch.Tensor] = []  # [n_scored, k] per sequence
    differs: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        ids, mask = left_pad([s for s, _ in chunk], decoder.pad_id, decoder.device)
        comps, composed = decoder.component_and_candidate_logprobs(ids, mask)
        base_lp = comps[base_index]
        kl = torch.stack(
            [kl_divergence(c, base_lp) for j, c in enumerate(comps) if j != base_index], dim=-1
        )  # [B, T, k]
        component_top1 = torch.stack([c.argmax(-1) for c in comps], dim=-1)  # [B, T, n]
        composed_top1 = composed.argmax(-1, keepdim=True)
        new_token = ~(component_top1 == composed_top1).any(-1)  # [B, T]
        length = ids.shape[1]
        for row, (_, n) in enumerate(chunk):
            if n <= 0:
                kls.append(kl.new_zeros((0, len(experts))))
                differs.append(torch.zeros(0, dtype=torch.bool))
                targets.append(torch.zeros(0, dtype=torch.long))
                continue
            span = slice(length - n - 1, length - 1)  # positions predicting the last n tokens
            kls.append(kl[row, span].cpu())
            differs.append(new_token[row, span].cpu())
            targets.append(ids[row, length - n :].cpu())

    all_kl = torch.cat(kls) if kls else torch.zeros(0, len(experts))
    all_differs = torch.cat(differs) if differs else torch.zeros(0, dtype=torch.bool)
    all_targets = torch.cat(targets) if targets else torch.zeros(0, dtype=torch.long)
    n_positions = all_kl.shape[0]

    def fraction(flags: torch.Tensor) -> float:
        return float(flags.float().mean()) if flags.numel() else 0.0

    active_fraction: dict[str, dict[str, float]] = {e: {} for e in experts}
    coactive: dict[str, dict[str, float]] = {f"{a}&{b}": {} for a, b in combinations(experts, 2)}
    all_active, none_active = {}, {}
    active_tokens: dict[str, dict[str, dict[str, int]]] = {e: {} for e in experts}
    for t in thresholds:
        active = all_kl > t  # [N, k]
        for i, e in enumerate(experts):
            active_fraction[e][_key(t)] = fraction(active[:, i])
            counts = Counter(all_targets[active[:, i]].tolist()).most_common(top_tokens)
            active_tokens[e][_key(t)] = {decoder.tokenizer.decode([tok]): c for tok, c in counts}
        for (i, a), (j, b) in combinations(list(enumerate(experts)), 2):
            coactive[f"{a}&{b}"][_key(t)] = fraction(active[:, i] & active[:, j])
        all_active[_key(t)] = fraction(active.all(-1))
        none_active[_key(t)] = fraction(~active.any(-1))

    finite = lambda x: float(x) if torch.isfinite(x) else float("inf")  # noqa: E731
    return CompositionDiagnostics(
        base=composition.anchor,
        experts=experts,
        thresholds=thresholds,
        n_sequences=len(sequences),
        n_positions=n_positions,
        mean_kl={
            e: finite(all_kl[:, i].mean()) if n_positions else 0.0 for i, e in enumerate(experts)
        },
        median_kl={
            e: finite(all_kl[:, i].median()) if n_positions else 0.0 for i, e in enumerate(experts)
        },
        active_fraction=active_fraction,
        coactive_fraction=coactive,
        all_active_fraction=all_active,
        none_active_fraction=none_active,
        composed_top1_differs_fraction=fraction(all_differs),
        active_tokens=active_tokens,
        per_position_kl=[k.tolist() for k in kls] if keep_positions else None,
    )
