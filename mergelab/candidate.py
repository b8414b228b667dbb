"""The one protocol every study compares: a *candidate* is a next-token distribution.

A single model, a weight merge (which is again a single model) and a logit composition of
several models all implement :class:`Candidate`, so the evaluation harness, the diagnostics and
every study treat "TIES at density 0.2", "composition of math + code" and "the base model" as
interchangeable rows of one table.

The protocol has three calls:

* ``token_logprobs(input_ids, attention_mask)`` — teacher-forced next-token log-probabilities,
  shape ``[batch, seq, vocab]``; position ``t`` is the distribution of token ``t + 1``.
* ``generate(prompts, settings)`` — decoded text, one :class:`Generation` per prompt.
* ``score(prompts, continuations)`` — total log-likelihood (nats) of each continuation given its
  prompt, for likelihood-based benchmarks.

plus ``name`` (a row label), ``tokenizer`` and ``describe()`` (a JSON-able description that
identifies the candidate; the evaluation harness keys its on-disk cache on it).

Implementations live next to what they wrap: :class:`mergelab.compose.ModelCandidate` for one
model (or a merge) and :class:`mergelab.compose.ComposedDecoder` for a composition. Both share one
decoding loop, so sampling, stop strings and EOS handling are identical for every candidate.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class GenerationSettings:
    """How to decode. Defaults are greedy decoding, as in the paper's LLM experiments."""

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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_strings"] = list(self.stop_strings)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationSettings:
        d = dict(d)
        d["stop_strings"] = tuple(d.get("stop_strings", ()))
        return cls(**d)


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

    ``text`` excludes the prompt and is cut before any stop string; ``token_ids`` are the
    generated ids (EOS excluded). ``finish_reason`` is ``"eos"``, ``"stop_string"`` or
    ``"length"``. ``logprobs[t]`` is the candidate's log-prob (nats) of the t-th generated token;
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
