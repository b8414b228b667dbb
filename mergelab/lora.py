"""Reading PEFT LoRA adapters: one reader and one set of rules for composition and merging.

An adapted linear layer's weight ``W [out, in]`` changes by ``ΔW = s·B A`` with ``A [r, in]``,
``B [out, r]`` and the scaling ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), where
``r`` and ``lora_alpha`` are the config's ``r`` / ``lora_alpha`` unless its ``rank_pattern`` /
``alpha_pattern`` name the module (matched with PEFT's own ``get_pattern_key``). Module names are
those of the plain base model (``model.layers.0.self_attn.q_proj``): PEFT's ``base_model.model.``
prefix is removed.

Supported: plain LoRA (and rsLoRA) on linear layers (``nn.Linear``, and transformers' ``Conv1D``
with ``fan_in_fan_out``). Refused with :class:`LoraAdapterError`, saying what was found: other
PEFT types, DoRA and other LoRA variants, trained biases, ``modules_to_save``, LoRA on embeddings,
a module without both A and B, ranks that disagree with the config, NaN/Inf.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergelab.errors import UserInputError

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")


class LoraAdapterError(UserInputError):
    """An adapter that cannot be read or is not plain LoRA (a ``ValueError``; the CLI exits 2)."""


@dataclass
class LoraModule:
    """One adapted linear layer: ``A [r, in]``, ``B [out, r]``, ``ΔW = scaling·B A``."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float
    fan_in_fan_out: bool = False  # GPT-2's Conv1D stores W as [in, out]

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """ΔW in the layout of the base's stored weight (``[in, out]`` for ``fan_in_fan_out``)."""
        delta = (self.B.to(dtype) @ self.A.to(dtype)) * self.scaling
        return delta.T if self.fan_in_fan_out else delta

    @property
    def delta_shape(self) -> tuple[int, int]:
        shape = (self.B.shape[0], self.A.shape[1])
        return (shape[1], shape[0]) if self.fan_in_fan_out else shape


@dataclass
class LoraAdapter:
    """A LoRA adapter: module name (as in the base model) → :class:`LoraModule`.

    ``config`` is the adapter's ``adapter_config.json`` content (PEFT's ``LoraConfig`` as a dict);
    ``path`` the folder it was read from (``None`` for one read from a live PEFT model).
    """

    name: str
    modules: dict[str, LoraModule]
    config: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    def checksum(self) -> str:
        """A short digest of the weights and scalings (identifies the adapter in records)."""
        digest = hashlib.sha1()
        for key in sorted(self.modules):
            m = self.modules[key]
            digest.update(
                f"{key}:{float(m.A.double().sum()):.8e}:"
                f"{float(m.B.double().sum()):.8e}:{m.scaling}".encode()
            )
        return digest.hexdigest()[:16]

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, name: str | None = None, *, label: str = "adapter"
    ) -> LoraAdapter:
        """Read a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors`` or
        ``.bin``). ``label`` starts every error message (e.g. "adapter 2")."""
        path = Path(path)
        where = f"{label} {path}"
        if not is_lora_adapter(path):
            raise LoraAdapterError(f"{where} is not a PEFT adapter (no {ADAPTER_CONFIG_NAME})")
        try:
            config = json.loads((path / ADAPTER_CONFIG_NAME).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LoraAdapterError(f"{where}: cannot read {ADAPTER_CONFIG_NAME} ({exc})") from None
        if not isinstance(config, dict):
            raise LoraAdapterError(f"{where}: {ADAPTER_CONFIG_NAME} is not a JSON object")
        check_lora_config(config, where)
        weights = _read_weights(path, where)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            module = key.removeprefix(PEFT_PREFIX)
            for part in ("lora_A", "lora_B"):
                suffix = f".{part}.weight"
                if module.endswith(suffix):
                    pairs.setdefault(module.removesuffix(suffix), {})[part] = tensor
                    break
            else:
                raise LoraAdapterError(
                    f"{where}: tensor {key!r} is not a LoRA A/B matrix of a linear layer "
                    "(embedding LoRA, DoRA magnitudes, biases and modules_to_save are not "
                    "supported)"
                )
        modules = {}
        for module, ab in sorted(pairs.items()):
            if set(ab) != {"lora_A", "lora_B"}:
                raise LoraAdapterError(f"{where}: module {module} lacks lora_A or lora_B")
            modules[module] = _lora_module(module, ab["lora_A"], ab["lora_B"], config, where)
        if not modules:
            raise LoraAdapterError(f"{where} holds no LoRA weights")
        return cls(name or path.name, modules, config, path)

    @classmethod
    def from_peft_model(
        cls, model: Any, adapter_name: str | None = None, name: str | None = None
    ) -> LoraAdapter:
        """Read adapter ``adapter_name`` (default: the active one) from a live PEFT model."""
        peft_config = getattr(model, "peft_config", None)
        if peft_config is None:
            raise LoraAdapterError(f"{type(model).__name__} is not a PEFT model (no peft_config)")
        if adapter_name is None:
            active = getattr(model, "active_adapter", None)
            adapter_name = active[0] if isinstance(active, list | tuple) else active
        if adapter_name not in peft_config:
            raise LoraAdapterError(f"adapter {adapter_name!r} not in {list(peft_config)}")
        config = peft_config[adapter_name].to_dict()
        where = f"adapter {adapter_name!r}"
        check_lora_config(config, where)
        modules = {}
        for module_name, module in model.named_modules():
            if adapter_name in (getattr(module, "lora_embedding_A", None) or {}):
                raise LoraAdapterError(
                    f"{where}: LoRA on embeddings ({module_name}) is not supported"
                )
            lora_a = getattr(module, "lora_A", None)
            if lora_a is None or adapter_name not in lora_a:
                continue
            if getattr(module, "lora_variant", {}).get(adapter_name) is not None:
                raise LoraAdapterError(
                    f"{where}: {module_name} is a LoRA variant (DoRA, ...), not plain LoRA"
                )
            key = module_name.removeprefix(PEFT_PREFIX)
            a = lora_a[adapter_name].weight.detach()
            b = module.lora_B[adapter_name].weight.detach()
            modules[key] = _lora_module(key, a, b, config, where)
        if not modules:
            raise LoraAdapterError(f"{where} adapts no module")
        return cls(name or adapter_name, modules, config, None)


def is_lora_adapter(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PEFT adapter folder (has ``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG_NAME).is_file()


def as_lora_adapter(obj: Any) -> LoraAdapter:
    """A :class:`LoraAdapter` from an adapter, a PEFT model or an adapter folder."""
    if isinstance(obj, LoraAdapter):
        return obj
    if isinstance(obj, str | os.PathLike):
        return LoraAdapter.from_pretrained(obj)
    if hasattr(obj, "peft_config"):
        return LoraAdapter.from_peft_model(obj)
    raise TypeError(f"cannot read a LoRA adapter from {type(obj).__name__}")


def check_lora_config(config: dict[str, Any], where: str) -> None:
    """Refuse what is not plain LoRA on linear layers, naming it."""
    peft_type = str(config.get("peft_type") or "LORA")
    if peft_type.upper().removeprefix("PEFTTYPE.") != "LORA":
        raise LoraAdapterError(f"{where} is a {peft_type} adapter, not LoRA")
    if config.get("use_dora"):
        raise LoraAdapterError(f"{where} is a DoRA adapter; only plain LoRA is supported")
    if config.get("modules_to_save"):
        raise LoraAdapterError(
            f"{where} has modules_to_save {config['modules_to_save']}; "
            "only LoRA matrices are supported"
        )
    if (config.get("bias") or "none") != "none" or config.get("lora_bias"):
        raise LoraAdapterError(f"{where} trains biases; only LoRA matrices are supported")


def _pattern_value(pattern: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module override: ``pattern`` maps module-name patterns to values."""
    if not pattern:
        return default
    from peft.utils.other import get_pattern_key

    return pattern.get(get_pattern_key(pattern.keys(), module), default)


def _lora_module(module: str, a: torch.Tensor, b: torch.Tensor, config: dict, where: str):
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise LoraAdapterError(
            f"{where}: module {module} has A {tuple(a.shape)}, B {tuple(b.shape)}"
        )
    r = a.shape[0]
    expected = _pattern_value(config.get("rank_pattern"), module, config.get("r", r))
    if expected != r:
        raise LoraAdapterError(f"{where}: module {module} has rank {r}, its config says {expected}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraAdapterError(f"{where}: module {module} contains NaN or Inf")
    alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return LoraModule(a, b, float(scaling), bool(config.get("fan_in_fan_out", False)))


def _read_weights(path: Path, where: str) -> dict[str, torch.Tensor]:
    try:
        if (path / ADAPTER_WEIGHTS_NAMES[0]).is_file():
            from safetensors.torch import load_file

            return load_file(str(path / ADAPTER_WEIGHTS_NAMES[0]), device="cpu")
        if (path / ADAPTER_WEIGHTS_NAMES[1]).is_file():
            return torch.load(
                path / ADAPTER_WEIGHTS_NAMES[1], map_location="cpu", weights_only=True
            )
    except Exception as exc:  # a corrupt file: safetensors, pickle and OS errors alike
        raise LoraAdapterError(f"{where}: cannot read the adapter weights ({exc})") from None
    raise LoraAdapterError(f"{where}: no {' or '.join(ADAPTER_WEIGHTS_NAMES)}")
