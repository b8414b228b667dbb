"""The one protocol every study compares: a *candidate* is a next-token distribution.

A single model, a weight merge (which is again a single model) and a logit composition of
several models all implement :class:`Candidate`, so the evaluation harness, the diagnostics and
every study treat "TIES at density 0.2", "composition of math + code" and "the base model" as
interchangeable rows of one table.

The protocol has three calls:

* ``token_logprobs(input_ids, attention_mask)`` — teacher-forced next-token log-probabilities,
  shape ``[batch, seq, vocab]``; position ``t`` is the distribution of token ``t + 1``.
* ``generate(prompts, settings)`` — decoded text, one :class:`Generation` per prompt.
  ``settings`` is a :class:`GenerationSettings`; mergelab's own candidates also take a
  transformers ``GenerationConfig`` and generation keyword arguments (mapped by
  :func:`generation_settings`), ``logits_processor`` / ``stopping_criteria`` lists, and token
  ids instead of strings. Called as transformers' ``generate(input_ids=..., attention_mask=...,
  generation_config=...)`` they return what ``model.generate`` returns, token ids
  (:mod:`mergelab.compose.token_ids`).
* ``score(prompts, continuations)`` — total log-likelihood (nats) of each continuation given its
  prompt, for likelihood-based benchmarks.

plus ``name`` (a row label), ``tokenizer`` and ``describe()`` (a JSON-able description that
identifies the candidate; the evaluation harness keys its on-disk cache on it).

Implementations: :class:`mergelab.model_candidate.ModelCandidate` for one model — a base, an expert or a weight
merge — and :class:`mergelab.compose.ComposedDecoder` for a composition. Both run the one decoding
loop of :mod:`mergelab.compose.decoding`, so sampling, stop strings and EOS handling are identical
for every candidate.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class GenerationSettings:
    """How to decode. Defaults are greedy decoding, as in the paper's LLM experiments.

    ``eos_token_ids``: the ids that end a row for this call (None: the candidate's own, which
    are its tokenizer's EOS and every model's ``generation_config.eos_token_id``).
    ``min_new_tokens``: EOS is ruled out until this many tokens were generated.
    ``repetition_penalty``: transformers' (CTRL's) penalty on every token already in the row,
    prompt included (1.0 = none). A transformers ``GenerationConfig`` maps onto these fields:
    :func:`generation_settings`.
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    batch_size: int = 8
    # Keep, per step, the log-prob of the chosen token under every component model.
    return_component_logprobs: bool = False
    eos_token_ids: tuple[int, ...] | None = None
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    # Sequences per prompt (transformers' num_return_sequences): each prompt is decoded this many
    # times, as rows of its own (so sampled rows differ); more than 1 needs do_sample.
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        """Refuse settings that cannot mean anything, naming the field: at construction, not
        after a model was loaded and some prompts were decoded."""
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_int("batch_size", self.batch_size, minimum=1)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=0)  # 0 = no top-k filtering (transformers)
        if self.seed is not None:
            _check_int("seed", self.seed)
        for name in ("do_sample", "return_component_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        temperature = _check_real("temperature", self.temperature)
        if self.do_sample and temperature <= 0:
            raise ValueError(
                f"temperature must be > 0 when sampling, got {temperature:g} "
                "(for greedy decoding leave do_sample=False)"
            )
        if self.top_p is not None:
            top_p = _check_real("top_p", self.top_p)
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p must lie in (0, 1], got {top_p:g}")
        stops = self.stop_strings
        # One string is one stop string (iterating it would stop at each of its characters).
        stops = (stops,) if isinstance(stops, str) else tuple(stops)
        if not all(isinstance(x, str) and x for x in stops):
            raise ValueError(f"stop_strings must be non-empty strings, got {list(stops)!r}")
        object.__setattr__(self, "stop_strings", stops)
        if self.eos_token_ids is not None:
            eos = self.eos_token_ids
            eos = (eos,) if isinstance(eos, numbers.Integral) else tuple(eos)
            for i in eos:
                _check_int("eos_token_ids", i, minimum=0)
            object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in eos))
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens {self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}"
            )
        if not _check_real("repetition_penalty", self.repetition_penalty) > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("num_return_sequences", self.num_return_sequences, minimum=1)
        if self.num_return_sequences > 1 and not self.do_sample:
            # transformers refuses the same: greedy decoding has one answer per prompt
            raise ValueError(
                f"num_return_sequences={self.num_return_sequences} needs do_sample=True "
                "(greedy decoding gives one sequence per prompt)"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able fields. Fields added after the first release appear only when they differ
        from their defaults, so cache keys of earlier runs stay valid."""
        d = asdict(self)
        d["stop_strings"] = list(self.stop_strings)
        for name, default in _LATER_FIELDS.items():
            if d[name] == default:
                del d[name]
        if d.get("eos_token_ids") is not None:
            d["eos_token_ids"] = list(d["eos_token_ids"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationSettings:
        d = dict(d)
        d["stop_strings"] = tuple(d.get("stop_strings", ()))
        if d.get("eos_token_ids") is not None:
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)


_LATER_FIELDS = {
    "eos_token_ids": None,
    "min_new_tokens": 0,
    "repetition_penalty": 1.0,
    "num_return_sequences": 1,
}

# transformers GenerationConfig field -> GenerationSettings field. Unset fields take transformers'
# own defaults (GenerationConfig._get_default_generation_params), e.g. top_k = 50 when sampling.
GENERATION_CONFIG_FIELDS = {
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens",
    "do_sample": "do_sample",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "eos_token_id": "eos_token_ids",
    "stop_strings": "stop_strings",
    "num_return_sequences": "num_return_sequences",
}
# Fields that do not change what is decoded (ids the tokenizer already fixes, bookkeeping).
GENERATION_CONFIG_IGNORED = {
    "pad_token_id",
    "bos_token_id",
    "use_cache",
    "transformers_version",
    "_from_model_config",
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
}
# generate() keyword arguments of mergelab's own (no GenerationConfig field).
MERGELAB_GENERATION_KWARGS = {"seed", "batch_size", "return_component_logprobs"}


def generation_settings(
    settings: GenerationSettings | Any | None = None, **kwargs: Any
) -> GenerationSettings:
    """The :class:`GenerationSettings` of one ``generate`` call.

    ``settings`` is a :class:`GenerationSettings`, a transformers ``GenerationConfig`` or None;
    ``kwargs`` update it as ``model.generate(**kwargs)`` updates a config — transformers' names
    (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
    ``repetition_penalty``, ``min_new_tokens``, ``eos_token_id``, ``stop_strings``) plus mergelab's
    ``seed``, ``batch_size`` and ``return_component_logprobs``. From a ``GenerationConfig``,
    fields map by :data:`GENERATION_CONFIG_FIELDS`; unset ones take transformers' defaults
    (greedy; when sampling temperature 1, top-k 50, no top-p); an unset ``max_new_tokens`` is
    mergelab's 128, and ``max_length`` (which counts the prompt) is accepted only beside
    ``max_new_tokens``, which overrides it as in transformers. Any other field set to a
    non-default value (beams, ``no_repeat_ngram_size``, ``typical_p``, ...) is refused by name:
    pass a ``LogitsProcessor`` for anything else that reshapes the distribution.
    """
    if settings is None and not kwargs:
        return GenerationSettings()
    if isinstance(settings, GenerationSettings):
        if not kwargs:
            return settings
        changes = dict(kwargs)
        if "eos_token_id" in changes:
            changes["eos_token_ids"] = changes.pop("eos_token_id")
        unknown = sorted(set(changes) - {f.name for f in fields(GenerationSettings)})
        if unknown:
            raise ValueError(f"unknown generation arguments {unknown}")
        return replace(settings, **changes)
    if settings is not None and not _is_generation_config(settings):
        raise TypeError(
            f"generation settings must be GenerationSettings or a transformers GenerationConfig, "
            f"not {type(settings).__name__}"
        )
    from transformers import GenerationConfig

    ours = {k: kwargs.pop(k) for k in list(kwargs) if k in MERGELAB_GENERATION_KWARGS}
    config = copy.deepcopy(settings) if settings is not None else GenerationConfig()
    unused = config.update(**kwargs)
    if unused:
        raise ValueError(f"unknown generation arguments {sorted(unused)}")
    defaults = GenerationConfig().to_dict()
    given = config.to_dict()
    refused = sorted(
        k
        for k, v in given.items()
        if k not in GENERATION_CONFIG_FIELDS
        and k not in GENERATION_CONFIG_IGNORED
        and k in defaults
        and v != defaults[k]
        and not (k == "num_beams" and v == 1)
        # transformers too lets max_new_tokens override max_length (which counts the prompt)
        and not (k == "max_length" and given.get("max_new_tokens") is not None)
    )
    if refused:
        raise ValueError(
            f"GenerationConfig fields {refused} are not supported by mergelab's decoding loop; "
            f"supported: {sorted(GENERATION_CONFIG_FIELDS)} (use a LogitsProcessor for others)"
        )
    do_sample = bool(given.get("do_sample") or False)
    top_k = given.get("top_k")
    out: dict[str, Any] = {
        "do_sample": do_sample,
        "temperature": 1.0 if given.get("temperature") is None else given["temperature"],
        # transformers samples among the 50 most likely tokens unless told otherwise
        "top_k": (50 if top_k is None else top_k) if do_sample else None,
        "top_p": given.get("top_p") if (given.get("top_p") or 1.0) < 1.0 else None,
        "min_new_tokens": given.get("min_new_tokens") or 0,
        "repetition_penalty": given.get("repetition_penalty") or 1.0,
        "eos_token_ids": given.get("eos_token_id"),
        "stop_strings": given.get("stop_strings") or (),
        "num_return_sequences": given.get("num_return_sequences") or 1,
    }
    if given.get("max_new_tokens") is not None:
        out["max_new_tokens"] = given["max_new_tokens"]
    if not do_sample:
        out["temperature"] = 1.0  # greedy: sampling settings do not apply (transformers too)
    return GenerationSettings(**out, **ours)


def _is_generation_config(obj: Any) -> bool:
    try:
        from transformers import GenerationConfig
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, GenerationConfig)


def _check_int(name: str, value: Any, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass
class Generation:
    """One decoded continuation.

    ``text`` excludes the prompt and is cut before any stop string (lm-eval's ``until``);
    ``token_ids`` are the generated ids as transformers keeps them — through the token that
    completed a stop string, so ``decode(token_ids)`` is ``text`` followed by the stop string
    (and whatever else that last token held) — with EOS left out: ``eos_token_id`` is the EOS
    id that ended the row, if one did. ``finish_reason`` is ``"eos"``, ``"stop_string"``,
    ``"stopping_criteria"`` (a transformers stopping criterion ended the row) or ``"length"``.
    ``logprobs[t]`` is the candidate's log-prob (nats) of the t-th generated token;
    ``component_logprobs[t][j]`` that of component ``j`` (base first) when requested.
    """

    prompt: str
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[float] = field(default_factory=list)
    component_logprobs: list[list[float]] | None = None
    # Cost accounting: model forward calls made for this prompt's batch, divided evenly.
    forward_passes: float = 0.0
    seconds: float = 0.0
    # "model_evaluations_per_token" (forward calls per decoded position, every model counted);
    # speculative decoding adds "drafted_tokens", "accepted_tokens", "acceptance_rate".
    cost: dict[str, float] = field(default_factory=dict)
    eos_token_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Candidate(Protocol):
    """Anything the harness can evaluate: see the module docstring."""

    name: str
    tokenizer: Any

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced log-probs ``[batch, seq, vocab]`` (float32, normalised per position)."""
        ...

    def generate(
        self, prompts: Sequence[str], settings: GenerationSettings | None = None
    ) -> list[Generation]: ...

    def score(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[float]: ...

    def describe(self) -> dict[str, Any]: ...
