"""The candidates users build: one model, or a composition of several.

    base_only = ModelCandidate(base, tokenizer, name="base")
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

from .decoding import RunnerCandidate
from .formula import Composition
from .runners import ModelRunner
from .vocab import check_same_tokenizer, tokenizer_vocab_size


def _prepare(model: nn.Module) -> nn.Module:
    # Models built from a config start in train mode (dropout on): decoding needs eval mode.
    if isinstance(model, nn.Module) and model.training:
        model.eval()
    return model


def _default_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return (getattr(config, "_name_or_path", "") if config is not None else "") or type(
        model
    ).__name__


class ModelCandidate(RunnerCandidate):
    """One causal LM (a base, an expert or a weight merge) as a Candidate.

    ``use_cache=False`` recomputes the prefix at every step (a reference for tests).
    ``eos_token_ids``: the ids that end a generation; default the tokenizer's EOS id plus every id
    in the model's ``generation_config.eos_token_id`` (transformers' convention: a list is fine).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        name: str | None = None,
        *,
        use_cache: bool = True,
        eos_token_ids: Sequence[int] | None = None,
    ):
        name = name or _default_name(model)
        runner = ModelRunner(
            [_prepare(model)], [name], tokenizer_vocab_size(tokenizer), use_cache=use_cache
        )
        super().__init__(
            runner,
            Composition.single(name),
            tokenizer,
            name=name,
            eos_token_ids=eos_token_ids,
            kind="ModelCandidate",
        )
        self.model = model


class ComposedDecoder(RunnerCandidate):
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
        eos_policy: str = "plain",
        name: str | None = None,
        use_cache: bool = True,
        tokenizers: Sequence[Any] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        token_masks: Mapping[str, torch.Tensor] | None = None,
    ):
        expert_names = (
            list(expert_names)
            if expert_names is not None
            else [f"expert{i + 1}" for i in range(len(expert_models))]
        )
        if len(expert_names) != len(expert_models):
            raise ValueError(f"{len(expert_names)} expert names for {len(expert_models)} experts")
        if composition is None:
            if base_model is None:
                raise ValueError("base_model is None: pass a composition without a base")
            composition = Composition.weighted("base", expert_names, weights)
        elif weights is not None:
            raise ValueError("pass either weights or composition, not both")
        models: dict[str, nn.Module] = {}
        if base_model is not None:
            models["base"] = base_model
        for n, m in zip(expert_names, expert_models):
            if n in models:
                raise ValueError(f"model name {n!r} used twice")
            models[n] = m
        self._init_from_models(
            models, composition, tokenizer, eos_policy=eos_policy, name=name,
            use_cache=use_cache, tokenizers=tokenizers, eos_token_ids=eos_token_ids,
            token_masks=token_masks,
        )  # fmt: skip

    @classmethod
    def from_models(
        cls,
        models: Mapping[str, nn.Module],
        composition: Composition,
        tokenizer: Any,
        **kwargs: Any,
    ) -> ComposedDecoder:
        """Any composition over named models, e.g. proxy-tuning with a large and a small base."""
        self = cls.__new__(cls)
        self._init_from_models(dict(models), composition, tokenizer, **kwargs)
        return self

    @classmethod
    def from_lora(
        cls,
        base_model: nn.Module,
        adapters: Sequence[Any],
        tokenizer: Any,
        weights: Sequence[float] | None = None,
        **kwargs: Any,
    ) -> ComposedDecoder:
        """Experts given as LoRA adapters of ``base_model``: the batched fast path.

        ``adapters`` are :class:`~mergelab.compose.lora.LoraAdapter`, PEFT models or adapter
        folders. Base and all adapters run in one forward per step on a ``(k+1)·B`` batch,
        sharing one copy of the base weights and one cache; see :mod:`mergelab.compose.lora`.
        """
        from .lora import LoraRunner, as_lora_adapter

        loaded = [as_lora_adapter(a) for a in adapters]
        names = kwargs.pop("expert_names", None) or [a.name for a in loaded]
        if kwargs.get("composition") is None and (len(set(names)) != len(names) or "base" in names):
            names = [f"expert{i + 1}" for i in range(len(loaded))]  # e.g. PEFT's "default" twice
        if len(set(names)) != len(names) or "base" in names:
            raise ValueError(f"adapter names must be distinct and not 'base': {names}")
        composition = kwargs.pop("composition", None)
        if composition is None:
            composition = Composition.weighted("base", names, weights)
        elif weights is not None:
            raise ValueError("pass either weights or composition, not both")
        if set(composition.components) != {"base", *names}:
            raise ValueError(
                f"the LoRA fast path needs a composition over 'base' and {names}, got {composition}"
            )
        if kwargs.pop("use_cache", True) is False:
            raise ValueError("the LoRA fast path always uses its cache")
        by_name = dict(zip(names, loaded))
        ordered = [by_name[n] for n in composition.components if n != "base"]
        ordered_names = [n for n in composition.components if n != "base"]
        runner = LoraRunner(
            _prepare(base_model), ordered, ordered_names, tokenizer_vocab_size(tokenizer)
        )
        self = cls.__new__(cls)
        RunnerCandidate.__init__(
            self,
            runner,
            composition,
            tokenizer,
            name=kwargs.pop("name", None) or str(composition),
            eos_policy=kwargs.pop("eos_policy", "plain"),
            eos_token_ids=kwargs.pop("eos_token_ids", None),
            token_masks=kwargs.pop("token_masks", None),
            kind="ComposedDecoder",
        )
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        return self

    def _init_from_models(
        self,
        models: dict[str, nn.Module],
        composition: Composition,
        tokenizer: Any,
        *,
        eos_policy: str = "plain",
        name: str | None = None,
        use_cache: bool = True,
        tokenizers: Sequence[Any] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        token_masks: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
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
        runner = ModelRunner(
            [_prepare(models[n]) for n in names],
            names,
            tokenizer_vocab_size(tokenizer),
            use_cache=use_cache,
        )
        RunnerCandidate.__init__(
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
