"""The one decoding loop every candidate shares.

:class:`DecodingCandidate` turns a component runner (:mod:`mergelab.compose.runners`) plus a
:class:`~mergelab.compose.formula.Composition` into a :class:`mergelab.candidate.Candidate`.
:class:`~mergelab.model_candidate.ModelCandidate` (one model, or a merged one) and
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
  it (lm-eval's ``until``), ``token_ids`` keep the token that completed it (transformers'
  ``stop_strings``: the ids of ``generate(input_ids=...)`` are transformers' ids). That call
  checks with transformers' ``StopStringCriteria``, which also reads the prompt: a stop string
  begun in the prompt ends the row there, and not in the text call (docs/conventions.md).

transformers' conventions (``generate`` takes what ``model.generate`` takes, within reason):

* Two calls: ``generate(prompts, settings)`` returns one ``Generation`` per prompt (text, ids,
  log-probs); ``generate(input_ids=..., attention_mask=..., generation_config=...)`` returns
  what ``model.generate`` returns — a ``LongTensor`` of prompt + new tokens, or with
  ``return_dict_in_generate`` an output object with ``sequences`` (and ``scores``) — see
  :mod:`mergelab.compose.token_ids`.
* Settings: a :class:`~mergelab.candidate.GenerationSettings`, a ``GenerationConfig`` or keyword
  arguments, mapped by :func:`mergelab.candidate.generation_settings` (unsupported fields are
  refused by name). Prompts: strings, a tensor of input ids ``[B, T]`` (with ``attention_mask``
  for padded rows, on either side), or lists of ids.
* EOS: a candidate stops on its tokenizer's EOS id and on every id any of its models lists in
  ``generation_config.eos_token_id`` — the union, because the models share one vocabulary and an
  expert's end-of-turn id ends the composition's turn too (an explicit ``eos_token_ids`` replaces
  the union; per call, ``eos_token_id`` replaces it for that call).
* ``logits_processor`` / ``stopping_criteria`` (transformers' lists) act on the candidate's
  next-token scores with transformers' signatures: ``input_ids`` is the left-padded prompt plus
  the tokens so far (rows already finished continue with the pad id), ``scores [B, V]`` are, for
  one model, its logits — exactly what transformers passes — and, for a composition, its composed
  log-probabilities (a composition has no logits of its own; only shift-sensitive processors such
  as the repetition penalty see the difference). Order, as in transformers: repetition penalty and
  ``min_new_tokens`` (transformers' own processors), then the given processors, then temperature /
  top-k / top-p when sampling. Processors choose tokens; ``Generation.logprobs`` stay the
  candidate's own.
* Sampled tokens are not transformers' for the same seed: transformers draws
  ``torch.multinomial`` from the global generator for the whole batch, mergelab draws per row (see
  above) so that a prompt's sample does not depend on its batch. The distribution drawn from is
  the same (``tests/test_generation_conventions.py`` checks it step by step); greedy decoding is
  token-identical.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..candidate import Generation, GenerationSettings, generation_settings
from .eos import apply_eos_policy, check_eos_policy
from .formula import Composition
from .projective import project_onto_mask
from .sampling import batch_order, warp_logprobs
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


class DecodingCandidate:
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
        kind: str = "DecodingCandidate",
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
            eos_token_ids = default_eos_token_ids(tokenizer, runner.models.values())
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])
        self.token_masks = _check_masks(token_masks, composition, self.vocab_size, self.device)
        # One model, temperature 1, no masks: its log-softmax already is the candidate.
        self._identity = len(composition.components) == 1 and composition.temperature == 1.0
        self.score_batch_size = 8
        self._identity_cache: dict[str, Any] | None = None

    @property
    def generation_config(self) -> Any:
        """transformers' ``GenerationConfig`` that ``generate(input_ids=...)`` starts from when
        given none (as ``model.generate`` starts from ``model.generation_config``): one model's
        own, else one naming the candidate's EOS, pad and BOS ids (greedy). Settable."""
        if getattr(self, "_generation_config", None) is None:
            from transformers import GenerationConfig

            models = list(self.runner.models.values())
            own = getattr(models[0], "generation_config", None) if len(models) == 1 else None
            if own is not None:
                self._generation_config = copy.deepcopy(own)
            else:
                self._generation_config = GenerationConfig(
                    eos_token_id=list(self.eos_token_ids),
                    pad_token_id=self.pad_id,
                    bos_token_id=getattr(self.tokenizer, "bos_token_id", None),
                )
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        self._generation_config = value

    # ---------------------------------------------------------------- the distribution
    @property
    def _needs_component_logprobs(self) -> bool:
        return bool(self.token_masks) or self.eos_policy != "plain"

    def compose(
        self,
        component_scores: Sequence[torch.Tensor],
        *,
        normalised: bool = False,
        eos_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Candidate log-probs ``[..., V]`` from component logits or log-probs (runner order).

        Logits suffice for the plain formula (the final log-softmax removes each model's
        normaliser); EOS policies and token masks need the components' log-probs, computed
        here unless ``normalised`` says they already are. ``eos_ids`` (a 1-D long tensor): the
        ids the EOS policy treats as EOS, default the candidate's; a decoding call passes its
        own (:meth:`call_eos_ids`), so a per-call ``eos_token_ids`` reaches the policy too.
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
            self._eos if eos_ids is None else eos_ids,
            self.eos_policy,
            0 if self.composition.anchor is not None else None,
        )

    def call_eos_ids(self, settings: GenerationSettings) -> torch.Tensor:
        """The EOS ids of one decoding call, as :meth:`compose` takes them."""
        if settings.eos_token_ids is None:
            return self._eos
        return torch.tensor(_eos_of(self, settings), dtype=torch.long, device=self.device)

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
        return ids or self._start_ids(repr(prompt))

    def _start_ids(self, what: str) -> list[int]:
        """Nothing to condition on: start from BOS (or EOS, as lm-eval does)."""
        start = getattr(self.tokenizer, "bos_token_id", None)
        if start is None:
            start = self.eos_token_ids[0] if self.eos_token_ids else None
        if start is None:
            raise ValueError(f"prompt {what} encodes to no tokens and there is no BOS/EOS")
        return [int(start)]

    def encode_prompts(
        self, prompts: Any, attention_mask: torch.Tensor | None = None
    ) -> tuple[list[str], list[list[int]]]:
        """(prompt texts, token ids) for strings, an id tensor ``[B, T]`` (``attention_mask``
        marks its real tokens, padding may sit on either side) or lists of ids."""
        if isinstance(prompts, str):
            raise TypeError("generate takes a list of prompts, not one string")
        if isinstance(prompts, torch.Tensor):
            ids = prompts if prompts.dim() == 2 else prompts.reshape(1, -1)
            if attention_mask is None:
                mask = torch.ones_like(ids, dtype=torch.bool)
            else:
                mask = torch.as_tensor(attention_mask)
                if mask.numel() != ids.numel():
                    raise ValueError(
                        f"attention_mask has shape {tuple(mask.shape)}, the input ids "
                        f"{tuple(ids.shape)}"
                    )
                mask = mask.reshape(ids.shape).bool()
            rows = [ids[r][mask[r].to(ids.device)].tolist() for r in range(ids.shape[0])]
        else:
            if attention_mask is not None:
                raise ValueError("attention_mask goes with a tensor of input ids")
            prompts = list(prompts)
            if all(isinstance(p, str) for p in prompts):
                return prompts, [self.encode_prompt(p) for p in prompts]
            if not all(isinstance(p, (list, tuple)) for p in prompts):
                raise TypeError("prompts must all be strings or all be lists of token ids")
            rows = [[int(t) for t in p] for p in prompts]
        encoded = [r or self._start_ids(f"row {i}") for i, r in enumerate(rows)]
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
        return texts, encoded

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
        self,
        prompts: Sequence[str] | torch.Tensor | Sequence[Sequence[int]] | None = None,
        settings: GenerationSettings | Any | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        **kwargs: Any,
    ) -> Any:
        """One :class:`~mergelab.candidate.Generation` per prompt (input order), or, called as
        transformers' ``model.generate(input_ids=..., ...)``, what that returns.

        ``settings``: :class:`GenerationSettings`, a transformers ``GenerationConfig`` or None,
        updated by ``kwargs`` (transformers' names, plus ``seed``/``batch_size``); prompts:
        strings, an id tensor with its ``attention_mask``, or id lists; ``logits_processor`` /
        ``stopping_criteria``: transformers' lists (see the module docstring). With
        ``num_return_sequences`` n, the result holds n generations per prompt, prompt by prompt.
        """
        if prompts is None or "input_ids" in kwargs or "inputs" in kwargs:
            from .token_ids import generate_token_ids

            return generate_token_ids(
                self,
                prompts,
                settings,
                attention_mask=attention_mask,
                logits_processor=logits_processor,
                stopping_criteria=stopping_criteria,
                **kwargs,
            )
        from .token_ids import refuse_output_options

        refuse_output_options(kwargs)
        if "generation_config" in kwargs:  # transformers' name for the settings
            if settings is not None:
                raise ValueError("pass the settings or generation_config, not both")
            settings = kwargs.pop("generation_config")
        settings = generation_settings(settings, **kwargs)
        texts, encoded = self.encode_prompts(prompts, attention_mask)
        if settings.num_return_sequences > 1:
            n = settings.num_return_sequences
            texts = [t for t in texts for _ in range(n)]
            encoded = [e for e in encoded for _ in range(n)]
        hooks = _Hooks(logits_processor, stopping_criteria)
        if (hooks or _needs_processors(settings)) and not self._plain_loop:
            raise NotImplementedError(
                f"{self.kind} does not apply logits processors, stopping criteria, "
                "repetition_penalty or min_new_tokens; generate with the composition itself"
            )
        order = batch_order(encoded)
        results: list[Generation | None] = [None] * len(texts)
        for start in range(0, len(order), settings.batch_size):
            rows = order[start : start + settings.batch_size]
            args = ([texts[i] for i in rows], [encoded[i] for i in rows], rows, settings)
            batch = (
                self._generate_batch(*args, hooks=hooks) if hooks else self._generate_batch(*args)
            )
            for i, g in zip(rows, batch):
                results[i] = g
        assert all(g is not None for g in results)
        return results  # type: ignore[return-value]

    @property
    def _plain_loop(self) -> bool:
        """Whether this class decodes with the loop below (others, e.g. speculative, do not)."""
        return type(self)._generate_batch is DecodingCandidate._generate_batch

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
        hooks: _Hooks | None = None,
    ) -> list[Generation]:
        ids, mask = left_pad(encoded, self.pad_id, self.device)
        positions = positions_from_mask(mask)
        batch = len(prompts)
        generators = self._row_generators(indices, settings)
        rows = RowOutputs(self, batch, settings)
        processors = self._processors(settings, ids, mask, hooks)
        criteria = hooks.stopping_criteria if hooks else None
        sequences = ids  # prompt + tokens so far, what transformers' processors see
        passes_before = self.runner.forward_passes
        started = time.perf_counter()
        eos_ids = self.call_eos_ids(settings)
        with self.runner.session():
            comps = self.runner.prefill(ids, mask, positions)
            for step in range(settings.max_new_tokens):
                lp = self.compose(comps, eos_ids=eos_ids)
                scores = lp
                if processors:
                    # One model: its logits, as transformers passes them; a composition: its
                    # log-probs.
                    scores = processors(sequences, comps[0] if self._identity else lp)
                if settings.do_sample:
                    warped = warp_logprobs(
                        scores, settings.temperature, settings.top_k, settings.top_p
                    )
                    next_ids = sample_tokens(warped, generators)
                else:
                    next_ids = scores.argmax(dim=-1)
                if processors or criteria:
                    # Finished rows continue with the pad id (transformers does the same).
                    finished = torch.tensor(rows.done, device=next_ids.device)
                    appended = next_ids.masked_fill(finished, self.pad_id)
                    sequences = torch.cat([sequences, appended.unsqueeze(-1)], dim=1)
                rows.add_step(next_ids, lp, comps)
                if criteria:
                    stop = criteria(sequences, scores).tolist()
                    for row in range(batch):
                        if stop[row]:
                            rows.stop(row, "stopping_criteria")
                if all(rows.done) or step == settings.max_new_tokens - 1:
                    break
                mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
                positions = positions[:, -1:] + 1
                comps = self.runner.step(next_ids.unsqueeze(-1), mask, positions)
        return rows.generations(
            prompts, self.runner.forward_passes - passes_before, time.perf_counter() - started
        )

    def _processors(
        self,
        settings: GenerationSettings,
        ids: torch.Tensor,
        mask: torch.Tensor,
        hooks: _Hooks | None,
    ) -> Any:
        """transformers' repetition-penalty and min-new-tokens processors (as ``model.generate``
        builds them), then the given ones; None when there are none."""
        if not (_needs_processors(settings) or (hooks and hooks.logits_processor)):
            return None
        from transformers import LogitsProcessorList
        from transformers.generation.logits_process import (
            MinNewTokensLengthLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        processors = LogitsProcessorList()
        if settings.repetition_penalty != 1.0:
            padding = (mask != 0).int().argmax(dim=1)  # left padding is not a repetition
            processors.append(
                RepetitionPenaltyLogitsProcessor(
                    float(settings.repetition_penalty), prompt_ignore_length=padding
                )
            )
        eos = _eos_of(self, settings)
        if settings.min_new_tokens and eos:
            processors.append(
                MinNewTokensLengthLogitsProcessor(
                    ids.shape[1],
                    settings.min_new_tokens,
                    torch.tensor(eos, device=ids.device),
                    device=ids.device,
                )
            )
        processors.extend(hooks.logits_processor if hooks and hooks.logits_processor else [])
        return processors

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
    ``done`` (EOS, a stop string, a stopping criterion or ``max_new_tokens`` decided tokens, EOS
    included). The EOS ids are the call's (``settings.eos_token_ids``), else the candidate's.
    """

    def __init__(self, candidate: DecodingCandidate, batch: int, settings: GenerationSettings):
        self.tokenizer = candidate.tokenizer
        self.eos = set(_eos_of(candidate, settings))
        self.stops = tuple(settings.stop_strings)
        self.window = 2 * max((len(s) for s in self.stops), default=0) + 8  # tokens to re-decode
        self.max_new_tokens = settings.max_new_tokens
        self.with_components = settings.return_component_logprobs
        self.tokens: list[list[int]] = [[] for _ in range(batch)]  # kept tokens (EOS excluded)
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.component_logprobs: list[list[list[float]]] = [[] for _ in range(batch)]
        self.steps = [0] * batch  # tokens decided, EOS included
        self.reason = ["length"] * batch
        self.eos_token: list[int | None] = [None] * batch  # the EOS id that ended the row
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
            self.eos_token[row] = token
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

    def stop(self, row: int, reason: str) -> None:
        """End ``row`` now (e.g. a stopping criterion said so), keeping its tokens."""
        if not self.done[row]:
            self.done[row], self.reason[row] = True, reason

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
                    eos_token_id=self.eos_token[row],
                )
            )
        return out


def component_logprobs_of(comps: Sequence[torch.Tensor], chosen: torch.Tensor) -> torch.Tensor:
    """Each component's log-prob of ``chosen [..., 1]`` from its logits ``[..., V]`` → ``[..., n]``."""
    return torch.cat(
        [c.gather(-1, chosen) - torch.logsumexp(c, -1, keepdim=True) for c in comps], dim=-1
    )


def default_eos_token_ids(tokenizer: Any, models: Any) -> list[int]:
    """The tokenizer's EOS id, then every id in the models' ``generation_config.eos_token_id``
    (an int or a list), without repeats; ids outside the tokenizer's vocabulary (which can never
    be generated) are left out."""
    vocab = tokenizer_vocab_size(tokenizer)
    found: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    for model in models:
        declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        found += declared if isinstance(declared, (list, tuple)) else [declared]
    out: list[int] = []
    for i in found:
        if i is not None and 0 <= int(i) < vocab and int(i) not in out:
            out.append(int(i))
    return out


def _eos_of(candidate: DecodingCandidate, settings: GenerationSettings) -> list[int]:
    """The ids that end a row in this call."""
    if settings.eos_token_ids is not None:
        return list(settings.eos_token_ids)
    return list(candidate.eos_token_ids)


def _needs_processors(settings: GenerationSettings) -> bool:
    return settings.repetition_penalty != 1.0 or settings.min_new_tokens > 0


class _Hooks:
    """transformers' ``LogitsProcessorList`` / ``StoppingCriteriaList`` given to one call."""

    def __init__(self, logits_processor: Any, stopping_criteria: Any):
        self.logits_processor = _as_list(logits_processor, "logits_processor")
        self.stopping_criteria = _as_list(stopping_criteria, "stopping_criteria")

    def __bool__(self) -> bool:
        return bool(self.logits_processor or self.stopping_criteria)


def _as_list(hooks: Any, what: str) -> Any:
    if hooks is None:
        return None
    if callable(hooks) and not isinstance(hooks, list):
        hooks = [hooks]
    if not isinstance(hooks, list) or not all(callable(h) for h in hooks):
        raise TypeError(f"{what} must be a list of callables (transformers' {what} list)")
    if not hooks:
        return None
    from transformers import LogitsProcessorList, StoppingCriteriaList

    wrap = LogitsProcessorList if what == "logits_processor" else StoppingCriteriaList
    return hooks if isinstance(hooks, wrap) else wrap(hooks)


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
