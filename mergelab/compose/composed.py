"""A composition of several models as one candidate: :class:`ComposedDecoder`.

    base_only = ModelCandidate(base, tokenizer, name="base")        # mergelab.model_candidate
    merged    = ModelCandidate(merge_models("ties", base, [math, code]), tokenizer, name="ties")
    composed  = ComposedDecoder(base, [math, code], tokenizer, expert_names=["math", "code"])
    for c in (base_only, merged, composed):
        c.generate(["2 + 2 ="], GenerationSettings(max_new_tokens=8))

All of them decode with the same loop (:mod:`mergelab.compose.decoding`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .decoding import DecodingCandidate
from .formula import Composition
from .runners import ModelRunner
from .vocab import check_same_tokenizer, tokenizer_vocab_size


class ComposedDecoder(DecodingCandidate):
    """Logit composition of a base and experts as a Candidate (docs/composition.md §1).

    Default formula: ``base + Σ_i w_i·(expert_i − base)`` with ``weights`` (all 1 = the paper).
    Pass ``composition=`` for any other :class:`Composition` over the names ``"base"`` and
    ``expert_names`` (default ``expert1..k``); ``base_model`` may be ``None`` for a product of
    experts. Every model keeps its own KV cache. ``tokenizers`` (optional, one per model, base
    first) are checked to be identical to ``tokenizer``. ``eos_policy`` is one of
    :data:`mergelab.compose.eos.EOS_POLICIES`. ``token_masks`` maps expert names to bool ``[V]``
    masks for projective (token-mask) composition. ``eos_token_ids``: the ids that end a
    generation; default the tokenizer's EOS id plus every id in any model's
    ``generation_config.eos_token_id`` (the models share one vocabulary, so an expert's
    end-of-turn id ends the composition's turn too).
    """

    def __init__(
        self,
        base_model: nn.Module | None,
        expert_models: Sequence[nn.Module],
        tokenizer: Any,
        weights: Sequence[float] | None = None,
        *,
        composition: Composition | None = None,
        expert_names: Sequence[str] | None = None,
        use_cache: bool = True,
        tokenizers: Sequence[Any] | None = None,
        **options: Any,
    ):
        """``options``: ``name``, ``eos_policy``, ``eos_token_ids``, ``token_masks`` (see the
        class docstring); the same for every constructor."""
        names = (
            list(expert_names)
            if expert_names is not None
            else [f"expert{i + 1}" for i in range(len(expert_models))]
        )
        if len(names) != len(expert_models):
            raise ValueError(f"{len(names)} expert names for {len(expert_models)} experts")
        if composition is None and base_model is None:
            raise ValueError("base_model is None: pass a composition without a base")
        composition = _composition(composition, weights, names)
        models: dict[str, nn.Module] = {}
        if base_model is not None:
            models["base"] = base_model
        for n, m in zip(names, expert_models):
            if n in models:
                raise ValueError(f"model name {n!r} used twice")
            models[n] = m
        runner = _model_runner(models, composition, tokenizer, use_cache, tokenizers)
        self._setup(runner, composition, tokenizer, **options)

    @classmethod
    def from_models(
        cls,
        models: Mapping[str, nn.Module],
        composition: Composition,
        tokenizer: Any,
        *,
        use_cache: bool = True,
        tokenizers: Sequence[Any] | None = None,
        **options: Any,
    ) -> ComposedDecoder:
        """Any composition over named models, e.g. proxy-tuning with a large and a small base."""
        self = cls.__new__(cls)
        runner = _model_runner(dict(models), composition, tokenizer, use_cache, tokenizers)
        self._setup(runner, composition, tokenizer, **options)
        return self

    @classmethod
    def from_lora(
        cls,
        base_model: nn.Module,
        adapters: Sequence[Any],
        tokenizer: Any,
        weights: Sequence[float] | None = None,
        *,
        composition: Composition | None = None,
        expert_names: Sequence[str] | None = None,
        use_cache: bool = True,
        **options: Any,
    ) -> ComposedDecoder:
        """Experts given as LoRA adapters of ``base_model``: the batched fast path.

        ``adapters`` are :class:`~mergelab.lora.LoraAdapter`, PEFT models or adapter
        folders. Base and all adapters run in one forward per step on a ``(k+1)·B`` batch,
        sharing one copy of the base weights and one cache; see :mod:`mergelab.compose.lora`.
        """
        from mergelab.lora import as_lora_adapter

        from .lora import LoraRunner

        loaded = [as_lora_adapter(a) for a in adapters]
        names = list(expert_names or [a.name for a in loaded])
        if composition is None and (len(set(names)) != len(names) or "base" in names):
            names = [f"expert{i + 1}" for i in range(len(loaded))]  # e.g. PEFT's "default" twice
        if len(set(names)) != len(names) or "base" in names:
            raise ValueError(f"adapter names must be distinct and not 'base': {names}")
        composition = _composition(composition, weights, names)
        if set(composition.components) != {"base", *names}:
            raise ValueError(
                f"the LoRA fast path needs a composition over 'base' and {names}, got {composition}"
            )
        if use_cache is False:
            raise ValueError("the LoRA fast path always uses its cache")
        by_name = dict(zip(names, loaded))
        ordered_names = [n for n in composition.components if n != "base"]
        runner = LoraRunner(
            base_model,
            [by_name[n] for n in ordered_names],
            ordered_names,
            tokenizer_vocab_size(tokenizer),
        )
        self = cls.__new__(cls)
        self._setup(runner, composition, tokenizer, **options)
        return self

    def _setup(
        self,
        runner: Any,
        composition: Composition,
        tokenizer: Any,
        *,
        name: str | None = None,
        eos_policy: str = "plain",
        eos_token_ids: Sequence[int] | None = None,
        token_masks: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """What every constructor ends with: the options every composition takes."""
        DecodingCandidate.__init__(
            self,
            runner,
            composition,
            tokenizer,
            name=name or str(composition),
            eos_policy=eos_policy,
            eos_token_ids=eos_token_ids,
            token_masks=dict(token_masks) if token_masks else None,
            kind="ComposedDecoder",
        )


def _composition(
    composition: Composition | None, weights: Sequence[float] | None, names: Sequence[str]
) -> Composition:
    """The given composition, or the weighted rule over "base" and ``names``."""
    if composition is None:
        return Composition.weighted("base", list(names), weights)
    if weights is not None:
        raise ValueError("pass either weights or composition, not both")
    return composition


def _model_runner(
    models: dict[str, nn.Module],
    composition: Composition,
    tokenizer: Any,
    use_cache: bool,
    tokenizers: Sequence[Any] | None,
) -> ModelRunner:
    """One runner over separately loaded models, in the composition's component order."""
    missing = [n for n in composition.components if n not in models]
    unused = [n for n in models if n not in composition.components]
    if missing or unused:
        raise ValueError(
            f"composition {composition} needs models {list(composition.components)}; "
            f"missing {missing}, unused {unused}"
        )
    if tokenizers is not None:
        if len(tokenizers) != len(models):
            raise ValueError(f"{len(tokenizers)} tokenizers for {len(models)} models")
        check_same_tokenizer([tokenizer, *tokenizers], ["tokenizer", *models])
    names = list(composition.components)
    return ModelRunner(
        [models[n] for n in names], names, tokenizer_vocab_size(tokenizer), use_cache=use_cache
    )
