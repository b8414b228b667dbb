"""The one decoding loop every candidate shares.

:class:`RunnerCandidate` turns a component runner (:mod:`mergelab.compose.runners`) plus a
:class:`~mergelab.compose.formula.Composition` into a :class:`mergelab.candidate.Candidate`.
:class:`~mergelab.compose.ModelCandidate` (one model, or a merged one) and
:class:`~mergelab.compose.ComposedDecoder` are thin constructors around it, so greedy decoding,
sampling, batching, EOS, stop strings, log-probs and cost counters are the same code for both.

Conventions:

* Prompts are left-padded; ``position_ids`` count only real tokens (``cumsum(mask) − 1``) so a
  padded row decodes exactly as it would alone.
* ``Generation.logprobs`` are under the candidate's own distribution (composition, its
  temperature and EOS policy included) — *not* under the sampling temperature / top-k / top-p,
  which only choose tokens. They are therefore comparable with :meth:`score`.
* Sampling draws one uniform number per row and step from a generator seeded with
  ``(seed, prompt index)``, and inverts the CDF. Results do not depend on the batch size or
  the order of batching.
* A stop string ends a row as soon as it appears in the generated text; ``text`` is cut before
  it, ``token_ids`` keep the token that completed it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from ..candidate import Generation, GenerationSettings
from .eos import apply_eos_policy, check_eos_policy
from .formula import Composition
from .projective import project_onto_mask
from .vocab import tokenizer_fingerprint, tokenizer_vocab_size

_SEED_STRIDE = 1_000_003  # row i of seed s draws from generator seed s·stride + i


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad id lists → ``input_ids [B, L]`` and ``attention_mask [B, L]`` (1 = real)."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, length - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, length - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the row's real tokens; 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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


def sample_tokens(
    scores: torch.Tensor, generators: Sequence[torch.Generator] | None
) -> torch.Tensor:
    """One token per row of ``scores [B, V]`` by inverting the CDF at a uniform draw."""
    probs = torch.softmax(scores.float(), dim=-1)
    cdf = probs.cumsum(-1)
    if generators is None:
        u = torch.rand(scores.shape[0], device=scores.device)
    else:
        u = torch.cat([torch.rand(1, generator=g, device=scores.device) for g in generators])
    target = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=scores.shape[-1] - 1)


class RunnerCandidate:
    """A :class:`~mergelab.candidate.Candidate` from a runner and a composition formula.

    ``runner.names`` must list the composition's components (in the same order); the runner
    yields per-component logits, which :meth:`compose` turns into the candidate's log-probs.
    ``token_masks`` (optional, name → bool ``[V]``) projects that expert onto its mask before
    composing (see :func:`mergelab.compose.projective.project_onto_mask`).
    """

    def __init__(
        self,
        runner: Any,
        composition: Composition,
        tokenizer: Any,
        *,
        name: str,
        eos_policy: str = "plain",
        eos_token_ids: Sequence[int] | None = None,
        token_masks: dict[str, torch.Tensor] | None = None,
        kind: str = "RunnerCandidate",
    ):
        if tuple(runner.names) != tuple(composition.components):
            raise ValueError(
                f"models {list(runner.names)} do not match the composition's components "
                f"{list(composition.components)} ({composition})"
            )
        self.runner = runner
        self.composition = composition
        self.tokenizer = tokenizer
        self.name = name
        self.kind = kind
        self.eos_policy = check_eos_policy(eos_policy, composition.anchor is not None)
        self.vocab_size = tokenizer_vocab_size(tokenizer)
        self.device = _first_device(runner)
        if eos_token_ids is None:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])
        self.token_masks = _check_masks(token_masks, composition, self.vocab_size, self.device)
        # One model, temperature 1, no masks: its log-softmax already is the candidate.
        self._identity = len(composition.components) == 1 and composition.temperature == 1.0
        self.score_batch_size = 8
        self._identity_cache: dict[str, Any] | None = None

    # ---------------------------------------------------------------- the distribution
    @property
    def _needs_component_logprobs(self) -> bool:
        return bool(self.token_masks) or self.eos_policy != "plain"

    def compose(
        self, component_scores: Sequence[torch.Tensor], *, normalised: bool = False
    ) -> torch.Tensor:
        """Candidate log-probs ``[..., V]`` from component logits or log-probs (runner order).

        Logits suffice for the plain formula (the final log-softmax removes each model's
        normaliser); EOS policies and token masks need the components' log-probs, computed
        here unless ``normalised`` says they already are.
        """
        comps = list(component_scores)
        if self._identity:
            return comps[0] if normalised else torch.log_softmax(comps[0], dim=-1)
        if self._needs_component_logprobs and not normalised:
            comps = [torch.log_softmax(c, dim=-1) for c in comps]
        if self.token_masks:
            anchor = comps[0]
            comps = [
                project_onto_mask(anchor, lp, self.token_masks[n]) if n in self.token_masks else lp
                for n, lp in zip(self.runner.names, comps)
            ]
        composed = self.composition.log_probs(comps)
        return apply_eos_policy(
            composed,
            comps,
            self._eos,
            self.eos_policy,
            0 if self.composition.anchor is not None else None,
        )

    def _teacher_forced_logits(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """Every component's logits ``[B, T, V]`` on the whole (left-padded) sequence."""
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device)
        with self.runner.session():
            return self.runner.teacher_forced(
                input_ids, attention_mask, positions_from_mask(attention_mask)
            )

    def component_and_candidate_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Teacher-forced ``([B, T, V] per component, [B, T, V] candidate)`` log-probs."""
        logits = self._teacher_forced_logits(input_ids, attention_mask)
        comps = [torch.log_softmax(z, dim=-1) for z in logits]
        return comps, self.compose(comps, normalised=True)

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced log-probs ``[B, T, V]`` float32; position t predicts token t + 1."""
        return self.compose(self._teacher_forced_logits(input_ids, attention_mask))

    # ---------------------------------------------------------------- tokenisation
    def encode_prompt(self, prompt: str) -> list[int]:
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if not ids:  # nothing to condition on: start from BOS (or EOS, as lm-eval does)
            start = getattr(self.tokenizer, "bos_token_id", None)
            if start is None:
                start = self.eos_token_ids[0] if self.eos_token_ids else None
            if start is None:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens and there is no BOS/EOS")
            ids = [int(start)]
        return ids

    def encode_continuation(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---------------------------------------------------------------- scoring
    def score(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[float]:
        """Candidate log-likelihood (nats) of each continuation given its prompt."""
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        pairs = [
            (self.encode_prompt(p), self.encode_continuation(c))
            for p, c in zip(prompts, continuations)
        ]
        scores = [0.0] * len(pairs)
        for start in range(0, len(pairs), self.score_batch_size):
            chunk = pairs[start : start + self.score_batch_size]
            ids, mask = left_pad([p + c for p, c in chunk], self.pad_id, self.device)
            lp = self.token_logprobs(ids, mask)
            length = ids.shape[1]
            for row, (_, cont) in enumerate(chunk):
                if not cont:
                    continue
                n = len(cont)
                targets = ids[row, length - n :]
                predicted = lp[row, length - n - 1 : length - 1]
                scores[start + row] = float(predicted.gather(-1, targets[:, None]).sum())
        return scores

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompts: Sequence[str], settings: GenerationSettings | None = None
    ) -> list[Generation]:
        settings = settings or GenerationSettings()
        if isinstance(prompts, str):
            raise TypeError("generate takes a list of prompts, not one string")
        encoded = [self.encode_prompt(p) for p in prompts]
        # Batch prompts of similar length together; results return in input order.
        order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
        results: list[Generation | None] = [None] * len(prompts)
        if settings.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {settings.batch_size}")
        for start in range(0, len(order), settings.batch_size):
            rows = order[start : start + settings.batch_size]
            batch = self._generate_batch(
                [prompts[i] for i in rows], [encoded[i] for i in rows], rows, settings
            )
            for i, g in zip(rows, batch):
                results[i] = g
        assert all(g is not None for g in results)
        return results  # type: ignore[return-value]

    def _row_generators(
        self, indices: list[int], settings: GenerationSettings
    ) -> list[torch.Generator] | None:
        """One generator per row, seeded with ``(seed, prompt index)``; None: the global RNG."""
        if not (settings.do_sample and settings.seed is not None):
            return None
        generators = []
        for i in indices:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(settings.seed) * _SEED_STRIDE + i)
            generators.append(g)
        return generators

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[str],
        encoded: list[list[int]],
        indices: list[int],
        settings: GenerationSettings,
    ) -> list[Generation]:
        ids, mask = left_pad(encoded, self.pad_id, self.device)
        positions = positions_from_mask(mask)
        batch = len(prompts)
        generators = self._row_generators(indices, settings)
        rows = RowOutputs(self, batch, settings)
        passes_before = self.runner.forward_passes
        started = time.perf_counter()
        with self.runner.session():
            comps = self.runner.prefill(ids, mask, positions)
            for step in range(settings.max_new_tokens):
                lp = self.compose(comps)
                if settings.do_sample:
                    scores = warp_logprobs(lp, settings.temperature, settings.top_k, settings.top_p)
                    next_ids = sample_tokens(scores, generators)
                else:
                    next_ids = lp.argmax(dim=-1)
                chosen = next_ids.unsqueeze(-1)
                rows.add_step(next_ids, lp, comps)
                if all(rows.done) or step == settings.max_new_tokens - 1:
                    break
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
                positions = positions[:, -1:] + 1
                comps = self.runner.step(chosen, mask, positions)
        return rows.generations(
            prompts, self.runner.forward_passes - passes_before, time.perf_counter() - started
        )

    # ---------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        """JSON-able identity: name, formula, EOS policy, models (with checksums), tokenizer."""
        if self._identity_cache is None:
            self._identity_cache = {
                "type": self.kind,
                "name": self.name,
                "composition": self.composition.to_dict(),
                "eos_policy": self.eos_policy,
                "eos_token_ids": self.eos_token_ids,
                "models": self.runner.describe_models(),
                "tokenizer": tokenizer_fingerprint(self.tokenizer),
                "token_masks": {n: int(m.sum()) for n, m in (self.token_masks or {}).items()},
            }
        return self._identity_cache

    def __repr__(self) -> str:
        return f"{self.kind}(name={self.name!r}, composition={self.composition})"


class RowOutputs:
    """Per-row bookkeeping of a decoding loop: tokens, EOS, stop strings, log-probs, Generations.

    Shared by the plain loop and the speculative one (:mod:`mergelab.compose.speculative`), so
    both end rows, cut text and report log-probs the same way. A row takes tokens until it is
    ``done`` (EOS, a stop string or ``max_new_tokens`` decided tokens, EOS included).
    """

    def __init__(self, candidate: RunnerCandidate, batch: int, settings: GenerationSettings):
        self.tokenizer = candidate.tokenizer
        self.eos = set(candidate.eos_token_ids)
        self.stops = tuple(settings.stop_strings)
        self.window = 2 * max((len(s) for s in self.stops), default=0) + 8  # tokens to re-decode
        self.max_new_tokens = settings.max_new_tokens
        self.with_components = settings.return_component_logprobs
        self.tokens: list[list[int]] = [[] for _ in range(batch)]  # kept tokens (EOS excluded)
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.component_logprobs: list[list[list[float]]] = [[] for _ in range(batch)]
        self.steps = [0] * batch  # tokens decided, EOS included
        self.reason = ["length"] * batch
        self.done = [settings.max_new_tokens <= 0] * batch

    def add(
        self, row: int, token: int, logprob: float, component_logprobs: list[float] | None = None
    ) -> None:
        """Decide the next token of ``row`` (ignored once the row is done)."""
        if self.done[row]:
            return
        self.steps[row] += 1
        if token in self.eos:
            self.done[row], self.reason[row] = True, "eos"
            return
        self.tokens[row].append(token)
        self.logprobs[row].append(logprob)
        if self.with_components:
            self.component_logprobs[row].append(component_logprobs or [])
        if self.stops:
            tail = self.tokenizer.decode(self.tokens[row][-self.window :], skip_special_tokens=True)
            if any(s in tail for s in self.stops):
                self.done[row], self.reason[row] = True, "stop_string"
                return
        if self.steps[row] >= self.max_new_tokens:
            self.done[row] = True

    def add_step(
        self, next_ids: torch.Tensor, lp: torch.Tensor, comps: Sequence[torch.Tensor]
    ) -> None:
        """One token per row: ``next_ids [B]`` under candidate log-probs ``lp [B, V]`` and
        component logits ``comps`` (each ``[B, V]``)."""
        chosen = next_ids.unsqueeze(-1)
        logprobs = lp.gather(-1, chosen).squeeze(-1).tolist()
        components = component_logprobs_of(comps, chosen).tolist() if self.with_components else None
        for row, token in enumerate(next_ids.tolist()):  # the one sync per step
            self.add(row, token, logprobs[row], components[row] if components else None)

    def remaining(self, row: int) -> int:
        return 0 if self.done[row] else self.max_new_tokens - self.steps[row]

    def generations(
        self,
        prompts: Sequence[str],
        forward_passes: float,
        seconds: float,
        cost: Sequence[dict[str, float]] | None = None,
    ) -> list[Generation]:
        """``forward_passes``: model forward calls made for the whole batch (divided evenly)."""
        batch = len(prompts)
        positions = max(max(self.steps, default=0), 1)
        per_token = forward_passes / positions  # forward calls per decoded position
        out = []
        for row in range(batch):
            text = self.tokenizer.decode(self.tokens[row], skip_special_tokens=True)
            if self.reason[row] == "stop_string":
                found = [text.find(s) for s in self.stops if s in text]
                text = text[: min(found)] if found else text
            out.append(
                Generation(
                    prompt=prompts[row],
                    text=text,
                    token_ids=list(self.tokens[row]),
                    finish_reason=self.reason[row],
                    logprobs=list(self.logprobs[row]),
                    component_logprobs=(
                        list(self.component_logprobs[row]) if self.with_components else None
                    ),
                    forward_passes=forward_passes / batch,
                    seconds=seconds / batch,
                    cost={
                        "model_evaluations_per_token": per_token,
                        **(cost[row] if cost is not None else {}),
                    },
                )
            )
        return out


def component_logprobs_of(comps: Sequence[torch.Tensor], chosen: torch.Tensor) -> torch.Tensor:
    """Each component's log-prob of ``chosen [..., 1]`` from its logits ``[..., V]`` → ``[..., n]``."""
    return torch.cat(
        [c.gather(-1, chosen) - torch.logsumexp(c, -1, keepdim=True) for c in comps], dim=-1
    )


def _first_device(runner: Any) -> torch.device:
    for model in runner.models.values():
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def _check_masks(
    masks: dict[str, torch.Tensor] | None, composition: Composition, vocab_size: int, device
) -> dict[str, torch.Tensor] | None:
    if not masks:
        return None
    if composition.anchor is None:
        raise ValueError("token masks project experts relative to a base; the composition has none")
    out = {}
    for name, m in masks.items():
        if name not in composition.components or name == composition.anchor:
            raise ValueError(
                f"token mask given for {name!r}, which is not an expert of {composition}"
            )
        m = torch.as_tensor(m, dtype=torch.bool, device=device)
        if m.shape != (vocab_size,):
            raise ValueError(
                f"token mask of {name!r} has shape {tuple(m.shape)}, expected ({vocab_size},)"
            )
        out[name] = m
    return out
