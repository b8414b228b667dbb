"""A composition of several models as one candidate: :class:`ComposedDecoder`.

    base_only = ModelCandidate(base, tokenizer, name="base")        # mergelab.model_candidate
    merged    = ModelCandidate(merge_models("ties", base, [math, code]), tokenizer, name="ties")
    composed  = ComposedDecoder(base, [math, code], tokenizer, expert_names=["math", "code"])
    for c in (base_only, merged, composed):
        c.generate(["2 + 2 ="], GenerationSettings(max_new_tokens=8))

All of them decode with the same loop (:mod:`mergelab.compose.decoding`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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

    # ------------------------------------------------------------ transformers' conventions
    @property
    def config(self) -> CompositionConfig:
        """The composition's :class:`CompositionConfig` — formula, component folders, options:
        what :meth:`save_pretrained` writes. (A composition has no architecture config of its
        own; each model keeps its ``config``.)"""
        return composition_config(self)

    def save_pretrained(
        self, save_directory: str | os.PathLike, *, save_models: bool = False, force: bool = False
    ) -> Path:
        """Write a small folder naming the components and the formula (no weights): each model
        by the folder it was loaded from, LoRA experts by their adapter folders. A model not
        loaded from a folder is refused unless ``save_models`` (then its weights are written
        under ``models/``). The folder appears only when complete; an existing one is replaced
        only with ``force`` and only if mergelab wrote it."""
        return save_composition(self, save_directory, save_models=save_models, force=force)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | os.PathLike,
        *,
        dtype: Any = None,
        device: str | torch.device | None = None,
        use_cache: bool = True,
        **options: Any,
    ) -> ComposedDecoder:
        """Load a folder written by :meth:`save_pretrained`: every model with transformers
        (``dtype`` and ``device`` as given, else as transformers loads them), the tokenizer,
        the options (``options`` override them: ``name``, ``eos_policy``, ...), and its
        ``generation_config.json`` as :attr:`generation_config`."""
        return load_composition(folder, dtype=dtype, device=device, use_cache=use_cache, **options)

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


# ---------------------------------------------------------------- saved compositions
#
# A composition saved is a small folder, as transformers saves a model, but holding no weights:
#
#   mergelab_composition.json   the formula, each component's folder, the options
#   generation_config.json      the defaults of generate(input_ids=...) (transformers' file)
#   tokenizer files             only when the tokenizer was not loaded from a folder
#   models/<name>/              only with save_models=True, for models not loaded from a folder

COMPOSITION_FILE = "mergelab_composition.json"
COMPOSITION_FORMAT = 1
COMPOSITION_KEYS = (
    "format",
    "formula",
    "composition",
    "models",
    "adapters",
    "tokenizer",
    "name",
    "eos_policy",
    "eos_token_ids",
    "token_masks",
)


def is_composition_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder written by :meth:`ComposedDecoder.save_pretrained` (or by
    hand in its format)."""
    return (Path(path) / COMPOSITION_FILE).is_file()


@dataclass
class CompositionConfig:
    """What identifies a composition, as its folder's ``mergelab_composition.json`` holds it
    (``ComposedDecoder.config``): the formula, each component's folder (``None`` for a model
    that was not loaded from one), LoRA adapters' folders, the tokenizer's folder and the
    decoding options. Paths in a file are absolute, or relative to the file's folder."""

    composition: Composition
    models: dict[str, str | None]
    adapters: dict[str, str | None] = field(default_factory=dict)  # LoRA experts of "base"
    tokenizer: str | None = None
    name: str | None = None
    eos_policy: str = "plain"
    eos_token_ids: list[int] | None = None
    token_masks: dict[str, list[int]] = field(default_factory=dict)  # expert -> allowed ids
    vocab_size: int | None = None
    name_or_path: str = ""

    @property
    def formula(self) -> str:
        return str(self.composition)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": COMPOSITION_FORMAT,
            "formula": self.formula,
            "composition": self.composition.to_dict(),
            "models": dict(self.models),
        }
        if self.adapters:
            out["adapters"] = dict(self.adapters)
        out.update(tokenizer=self.tokenizer, name=self.name, eos_policy=self.eos_policy)
        if self.eos_token_ids is not None:
            out["eos_token_ids"] = list(self.eos_token_ids)
        if self.token_masks:
            out["token_masks"] = {n: list(ids) for n, ids in self.token_masks.items()}
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> CompositionConfig:
        """Read ``mergelab_composition.json`` (or the folder holding it); errors name the file
        and the key."""
        path = Path(path)
        file = path / COMPOSITION_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{path} is not a saved composition (no {COMPOSITION_FILE})")
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: expected a JSON object")
        known = set(COMPOSITION_KEYS)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{file}: unknown key(s) {unknown}; known: {sorted(known)}")
        if raw.get("format", COMPOSITION_FORMAT) != COMPOSITION_FORMAT:
            raise ValueError(f"{file}: format {raw['format']!r}; this mergelab reads format 1")
        for key in ("composition", "models"):
            if not isinstance(raw.get(key), dict):
                raise ValueError(f"{file}: '{key}' must be an object")
        try:
            composition = Composition.from_dict(raw["composition"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{file}: composition: {exc}") from None
        folder = file.parent

        def where(p: Any, key: str) -> str | None:
            if p is None:
                return None
            if not isinstance(p, str) or not p:
                raise ValueError(f"{file}: {key} must be a folder path, got {p!r}")
            return str(folder / p) if not os.path.isabs(p) else p

        models = {n: where(p, f"models.{n}") for n, p in raw["models"].items()}
        adapters = {n: where(p, f"adapters.{n}") for n, p in (raw.get("adapters") or {}).items()}
        names = {*models, *adapters}
        if names != set(composition.components):
            raise ValueError(
                f"{file}: the formula {composition} names {sorted(composition.components)}; "
                f"models and adapters give {sorted(names)}"
            )
        return cls(
            composition=composition,
            models=models,
            adapters=adapters,
            tokenizer=where(raw.get("tokenizer"), "tokenizer"),
            name=raw.get("name"),
            eos_policy=raw.get("eos_policy", "plain"),
            eos_token_ids=raw.get("eos_token_ids"),
            token_masks=dict(raw.get("token_masks") or {}),
            name_or_path=str(folder),
        )


def _source_folder(obj: Any) -> str | None:
    """The folder a model or tokenizer was loaded from (transformers records it), if it still
    is one."""
    config = getattr(obj, "config", None)
    path = getattr(config, "_name_or_path", None) if config is not None else None
    path = path or getattr(obj, "name_or_path", None)
    return str(Path(path).resolve()) if path and Path(path).is_dir() else None


def composition_config(decoder: DecodingCandidate) -> CompositionConfig:
    """The :class:`CompositionConfig` of a live decoder (``ComposedDecoder.config``)."""
    runner = decoder.runner
    adapters = {}
    for n, a in getattr(runner, "adapters", {}).items():
        adapters[n] = str(Path(a.path).resolve()) if getattr(a, "path", None) else None
    return CompositionConfig(
        composition=decoder.composition,
        models={n: _source_folder(m) for n, m in runner.models.items()},
        adapters=adapters,
        tokenizer=_source_folder(decoder.tokenizer),
        name=decoder.name,
        eos_policy=decoder.eos_policy,
        eos_token_ids=list(decoder.eos_token_ids),
        token_masks={
            n: torch.nonzero(m).flatten().tolist() for n, m in (decoder.token_masks or {}).items()
        },
        vocab_size=decoder.vocab_size,
        name_or_path=getattr(decoder, "_name_or_path", ""),
    )


def save_composition(
    decoder: DecodingCandidate,
    folder: str | os.PathLike,
    *,
    save_models: bool = False,
    force: bool = False,
) -> Path:
    """Write ``decoder``'s composition folder (see :meth:`ComposedDecoder.save_pretrained`)."""
    from mergelab.outputs import atomic_output_dir

    config = composition_config(decoder)
    missing = [n for n, p in {**config.models, **config.adapters}.items() if p is None]
    if missing and not save_models:
        raise ValueError(
            f"model(s) {missing} were not loaded from a folder, so the composition cannot name "
            "them: save them first (model.save_pretrained) and load them from there, or pass "
            "save_models=True to write their weights into the composition folder"
        )
    if config.adapters and any(p is None for p in config.adapters.values()):
        raise ValueError("LoRA experts read from live PEFT models: save the adapters first")
    with atomic_output_dir(folder, force=force, kind="composition") as tmp:
        models = dict(config.models)
        for n in missing:
            decoder.runner.models[n].save_pretrained(tmp / "models" / n)
            models[n] = f"models/{n}"
        raw = config.to_dict()
        raw["models"] = models
        if config.tokenizer is None:
            decoder.tokenizer.save_pretrained(tmp)
            raw["tokenizer"] = "."
        (tmp / COMPOSITION_FILE).write_text(
            json.dumps(raw, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        decoder.generation_config.save_pretrained(tmp)
    return Path(folder)


def load_composition(
    folder: str | os.PathLike,
    *,
    dtype: Any = None,
    device: str | torch.device | None = None,
    use_cache: bool = True,
    **options: Any,
) -> ComposedDecoder:
    """The :class:`ComposedDecoder` of a composition folder (see
    :meth:`ComposedDecoder.from_pretrained`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = CompositionConfig.from_file(folder)
    for n, p in {**config.models, **config.adapters}.items():
        if p is None or not Path(p).is_dir():
            raise FileNotFoundError(
                f"{Path(folder) / COMPOSITION_FILE}: model {n!r}: folder {p} not found"
            )
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)

    def load(path: str) -> nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return (model.to(device) if device is not None else model).eval()

    tokenizer_folder = config.tokenizer or config.models.get(
        config.composition.anchor or "", next(iter(config.models.values()), None)
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    kwargs: dict[str, Any] = dict(
        name=options.pop("name", config.name),
        eos_policy=options.pop("eos_policy", config.eos_policy),
        eos_token_ids=options.pop("eos_token_ids", config.eos_token_ids),
    )
    if config.token_masks:
        vocab = tokenizer_vocab_size(tokenizer)
        masks = {}
        for n, ids in config.token_masks.items():
            m = torch.zeros(vocab, dtype=torch.bool)
            m[torch.tensor(ids, dtype=torch.long)] = True
            masks[n] = m
        kwargs["token_masks"] = masks
    kwargs.update(options)
    if config.adapters:
        if set(config.models) != {"base"}:
            raise ValueError(
                f"{folder}: LoRA adapters compose with the base alone; models gives "
                f"{sorted(config.models)}"
            )
        decoder = ComposedDecoder.from_lora(
            load(config.models["base"]),
            list(config.adapters.values()),
            tokenizer,
            composition=config.composition,
            expert_names=list(config.adapters),
            use_cache=use_cache,
            **kwargs,
        )
    else:
        models = {n: load(p) for n, p in config.models.items()}
        decoder = ComposedDecoder.from_models(
            models, config.composition, tokenizer, use_cache=use_cache, **kwargs
        )
    decoder._name_or_path = str(folder)
    if (Path(folder) / "generation_config.json").is_file():
        decoder.generation_config = GenerationConfig.from_pretrained(folder)
    return decoder
