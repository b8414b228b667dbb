"""The composition rule over next-token log-probabilities (arXiv 2605.28304; docs/composition.md §1).

    log p̂ = log p_b + Σ_i w_i (log p_i − log p_b) − log Z

With w_i = 1 this is Σ_i log p_i − (k−1) log p_b − log Z, the paper's rule. Z is always computed
(a log-softmax over the vocabulary), in float32 or wider, whatever dtype the models run in.

A :class:`Composition` is that expression as an object over *named* components, general enough
for the special cases the field knows by other names::

    Composition.paper("base", ["math", "code"])      base + 1.0·(math − base) + 1.0·(code − base)
    Composition.classifier_free_guidance("base", "cond", 1.5)
                                                     base + 1.5·(cond − base)
    Composition.dexperts("base", "expert", "anti", 2.0)
                                                     base + 2.0·(expert − anti)
    Composition.proxy_tuning("large", "small_tuned", "small_base")   (also: emulated fine-tuning)
                                                     large + 1.0·(small_tuned − small_base)
    Composition.product_of_experts(["math", "code"]) 1.0·math + 1.0·code

Conventions for impossible tokens (log-prob −inf), chosen so that no NaN can appear:
a token that *any* component with a non-zero net coefficient rules out is ruled out of the
composition. (For a component with a negative coefficient — e.g. the base in the paper's rule
with two experts — the ratio p_i/p_b is undefined where p_b = 0; we rule the token out rather
than give it infinite mass.) Components whose net coefficient is exactly 0 do not matter at all,
so one expert with weight 1 reproduces that expert exactly, −inf entries included.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Term:
    """``weight·(model − minus)`` when ``minus`` is set, else ``weight·model`` (log-prob space)."""

    weight: float
    model: str
    minus: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "model": self.model, "minus": self.minus}


@dataclass(frozen=True)
class Composition:
    """``anchor + Σ terms``, divided by ``temperature``, renormalised over the vocabulary.

    ``anchor`` is the model the deltas are added to (the base / background); ``None`` for a
    product of experts without a base. Component names are labels that the decoder maps to
    models; ``components`` lists them anchor first, then in order of appearance.
    """

    anchor: str | None
    terms: tuple[Term, ...] = ()
    temperature: float = 1.0
    components: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every way of building a composition (special cases, decoders, JSON, the CLI) ends here,
        # so this is where a NaN/Inf weight is refused: it would turn every log-prob into NaN.
        terms = tuple(
            replace(t, weight=_finite(t.weight, f"weight of term {t.model!r}")) for t in self.terms
        )
        object.__setattr__(self, "terms", terms)
        object.__setattr__(self, "temperature", _finite(self.temperature, "temperature"))
        if self.anchor is None and not self.terms:
            raise ValueError("a composition needs an anchor model or at least one term")
        if not (self.temperature > 0):
            raise ValueError(f"composition temperature must be > 0, got {self.temperature}")
        names: list[str] = [] if self.anchor is None else [self.anchor]
        for t in self.terms:
            if t.minus is not None and t.minus == t.model:
                raise ValueError(f"term {t} subtracts a model from itself")
            for n in (t.model, t.minus):
                if n is not None and n not in names:
                    names.append(n)
        object.__setattr__(self, "components", tuple(names))

    # ---------------------------------------------------------------- special cases
    @classmethod
    def single(cls, name: str) -> Composition:
        """One model alone (what :class:`ModelCandidate` decodes)."""
        return cls(anchor=name)

    @classmethod
    def weighted(
        cls,
        base: str,
        experts: Sequence[str],
        weights: Sequence[float] | None = None,
        *,
        temperature: float = 1.0,
    ) -> Composition:
        """``base + Σ_i w_i·(expert_i − base)``; ``weights=None`` means all 1 (the paper)."""
        experts = list(experts)
        weights = [1.0] * len(experts) if weights is None else _weight_list(weights)
        if len(weights) != len(experts):
            raise ValueError(f"{len(weights)} weights for {len(experts)} experts")
        if len(set(experts)) != len(experts) or base in experts:
            raise ValueError(f"component names must be distinct: base={base!r}, experts={experts}")
        terms = tuple(Term(w, e, base) for w, e in zip(weights, experts))
        return cls(anchor=base, terms=terms, temperature=temperature)

    @classmethod
    def paper(cls, base: str, experts: Sequence[str]) -> Composition:
        """The paper's rule: p̂ ∝ p_b · Π_i p_i / p_b (all weights 1)."""
        return cls.weighted(base, experts)

    @classmethod
    def classifier_free_guidance(cls, base: str, expert: str, guidance: float) -> Composition:
        """``base + γ·(expert − base)``: one expert with weight γ (γ > 1 extrapolates)."""
        return cls.weighted(base, [expert], [guidance])

    @classmethod
    def dexperts(cls, base: str, expert: str, anti_expert: str, alpha: float = 1.0) -> Composition:
        """DExperts (Liu et al. 2021): ``base + α·(expert − anti_expert)``."""
        return cls(anchor=base, terms=(Term(alpha, expert, anti_expert),))

    @classmethod
    def proxy_tuning(
        cls, large_base: str, small_tuned: str, small_base: str, alpha: float = 1.0
    ) -> Composition:
        """Proxy-tuning / emulated fine-tuning (EFT): ``large + α·(small_tuned − small_base)``."""
        return cls(anchor=large_base, terms=(Term(alpha, small_tuned, small_base),))

    emulated_fine_tuning = proxy_tuning

    @classmethod
    def product_of_experts(
        cls, experts: Sequence[str], weights: Sequence[float] | None = None
    ) -> Composition:
        """``Σ_i w_i·log p_i`` renormalised: a product of experts with no base."""
        experts = list(experts)
        weights = [1.0] * len(experts) if weights is None else _weight_list(weights)
        if len(weights) != len(experts):
            raise ValueError(f"{len(weights)} weights for {len(experts)} experts")
        return cls(anchor=None, terms=tuple(Term(w, e) for w, e in zip(weights, experts)))

    # ---------------------------------------------------------------- reading it
    def coefficients(self) -> dict[str, float]:
        """Net coefficient of each component's log-prob: the formula as Σ_j c_j log p_j."""
        c = dict.fromkeys(self.components, 0.0)
        if self.anchor is not None:
            c[self.anchor] += 1.0
        for t in self.terms:
            c[t.model] += t.weight
            if t.minus is not None:
                c[t.minus] -= t.weight
        return c

    def __str__(self) -> str:
        parts: list[str] = [] if self.anchor is None else [self.anchor]
        for t in self.terms:
            body = t.model if t.minus is None else f"({t.model} − {t.minus})"
            sign = "−" if t.weight < 0 else "+"
            piece = f"{abs(t.weight)!r}·{body}"
            parts.append(piece if not parts and sign == "+" else f"{sign} {piece}")
        text = " ".join(parts)
        if self.temperature != 1.0:
            text = f"[{text}] / {self.temperature!r}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "anchor": self.anchor,
            "terms": [t.to_dict() for t in self.terms],
            "temperature": self.temperature,
            "formula": str(self),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Composition:
        unknown = set(d) - {"anchor", "terms", "temperature", "formula"}
        if unknown:
            raise ValueError(f"unknown composition keys {sorted(unknown)}")
        terms = []
        for i, t in enumerate(d.get("terms", [])):
            if not isinstance(t, Mapping) or "weight" not in t or "model" not in t:
                raise ValueError(f"composition term {i} needs a 'weight' and a 'model', got {t!r}")
            terms.append(Term(t["weight"], str(t["model"]), t.get("minus")))
        return cls(
            anchor=d.get("anchor"), terms=tuple(terms), temperature=d.get("temperature", 1.0)
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> Composition:
        return cls.from_dict(json.loads(text))

    # ---------------------------------------------------------------- evaluating it
    def log_probs(
        self, component_logprobs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Composed, normalised log-probs ``[..., vocab]`` (float32 at least).

        ``component_logprobs`` maps each name in ``components`` to log-probs (or logits) of
        shape ``[..., vocab]``; a sequence is read in the order of ``components``.
        """
        if not isinstance(component_logprobs, Mapping):
            if len(component_logprobs) != len(self.components):
                raise ValueError(
                    f"{len(component_logprobs)} log-prob tensors for components {self.components}"
                )
            component_logprobs = dict(zip(self.components, component_logprobs))
        missing = [n for n in self.components if n not in component_logprobs]
        if missing:
            raise ValueError(f"no log-probs given for components {missing}")
        shape = component_logprobs[self.components[0]].shape
        dtype = torch.float32
        for n in self.components:
            lp = component_logprobs[n]
            if lp.shape != shape:
                raise ValueError(
                    f"log-probs of {n!r} have shape {tuple(lp.shape)}, expected {tuple(shape)}"
                )
            dtype = torch.promote_types(dtype, lp.dtype)

        coefficients = self.coefficients()
        scores = self._combine(component_logprobs, coefficients, dtype)
        # One reduction instead of an elementwise test: ±inf and NaN propagate into the sum.
        if not math.isfinite(float(scores.sum())):
            # Some component rules tokens out (−inf): redo the sum with the conventions of the
            # module docstring, so that −inf − −inf never turns into NaN.
            scores = self._combine_with_neg_inf(component_logprobs, coefficients, dtype)
        if self.temperature != 1.0:
            scores = scores / self.temperature
        return torch.log_softmax(scores, dim=-1)

    def _combine(
        self, xs: Mapping[str, torch.Tensor], coefficients: dict[str, float], dtype: torch.dtype
    ) -> torch.Tensor:
        """Σ_j c_j x_j, one fused pass per component; components with c_j = 0 are skipped."""
        scores: torch.Tensor | None = None
        for n, c in coefficients.items():
            if c == 0.0:
                continue
            x = xs[n].to(dtype)
            if scores is None:
                scores = x * c if c != 1.0 else x.clone()
            else:
                scores.add_(x, alpha=c)
        if scores is None:  # every coefficient cancelled: the uniform distribution
            scores = torch.zeros_like(xs[self.components[0]], dtype=dtype)
        return scores

    def _combine_with_neg_inf(
        self, xs: Mapping[str, torch.Tensor], coefficients: dict[str, float], dtype: torch.dtype
    ) -> torch.Tensor:
        finite: dict[str, torch.Tensor] = {}
        ruled_out: torch.Tensor | None = None
        for n, c in coefficients.items():
            x = xs[n].to(dtype)
            if torch.isnan(x).any():
                raise ValueError(f"log-probs of {n!r} contain NaN")
            neg_inf = torch.isneginf(x)
            finite[n] = x.masked_fill(neg_inf, 0.0)
            if c != 0.0:
                ruled_out = neg_inf if ruled_out is None else ruled_out | neg_inf
        scores = self._combine(finite, coefficients, dtype)
        if ruled_out is not None:
            if bool(ruled_out.all(dim=-1).any()):
                raise ValueError(f"composition {self} rules out every token at some position")
            scores = scores.masked_fill(ruled_out, float("-inf"))
        return scores


def _finite(value: Any, what: str) -> float:
    """``value`` as a finite float; NaN, ±inf, bools and non-numbers are refused by name."""
    try:
        if isinstance(value, bool):  # a bool is an int to Python, but not a weight
            raise TypeError
        number = float(value)  # numbers, numeric strings, numpy scalars, 0-d tensors
    except (TypeError, ValueError):
        raise ValueError(f"composition {what} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"composition {what} must be a finite number, got {value!r}")
    return number


def _weight_list(weights: Any) -> list[Any]:
    """One weight per expert; a string or a single number is not a list of weights."""
    if isinstance(weights, (str, bytes, numbers.Number)) or not isinstance(weights, Iterable):
        raise ValueError(f"weights must be a list with one number per expert, got {weights!r}")
    return list(weights)


def compose_logprobs(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Compose normalised log-probs ``[..., vocab]``; returns normalised log-probs ``[..., vocab]``.

    ``base`` and each expert are log-probabilities (or logits: the per-model normalisers only add
    a constant per position, which the final log-softmax removes). Computation is in float32 at
    least (float64 stays float64); −inf follows the conventions in the module docstring.
    """
    names = [f"expert{i + 1}" for i in range(len(experts))]
    composition = Composition.weighted("base", names, weights, temperature=temperature)
    return composition.log_probs([base, *experts])
