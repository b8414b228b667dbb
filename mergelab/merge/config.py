"""Merge configs in YAML or TOML: one file says what ``mergelab merge`` does.

    method: ties                 # any registered method (mergekit's key merge_method works too)
    base: models/base            # base_model works too; optional for methods without a base
    models:
      - model: models/math       # path works too; a plain string is a model with no parameters
        parameters: {weight: 1.0, density: 0.2}
      - model: models/code
        parameters: {weight: 0.5}
    parameters: {lambda: 1.0, density: 0.3}   # global; a per-model name here is every model's default
    dtype: float32               # compute dtype; stored dtype stays the checkpoint's unless out_dtype
    out_dtype: bfloat16          # optional
    output: merged/
    seed: 0
    shard_size: 5GB
    vocab_padding: error         # or truncate (see mergelab.merge.checkpoint)
    lora: {output: full, rank: 16}   # only for PEFT LoRA adapters: full | adapter

Relative paths are resolved against the folder holding the config file, so a config and its
models can move together. A key given twice in one mapping is an error (YAML would otherwise
keep the last one silently; TOML refuses it itself), and so is a value of the wrong kind: numbers
may be written as strings (``density: "0.5"``), every error names the key (and the model).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from .checkpoint import parse_size
from .registry import get_merge_method, to_number
from .validation import VOCAB_PADDING_RULES

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}

TOP_LEVEL_KEYS = {
    "method": ("method", "merge_method"),
    "base": ("base", "base_model"),
    "models": ("models",),
    "params": ("parameters", "params"),
    "dtype": ("dtype",),
    "out_dtype": ("out_dtype",),
    "output": ("output", "out"),
    "seed": ("seed",),
    "shard_size": ("shard_size",),
    "vocab_padding": ("vocab_padding",),
    "lora": ("lora",),
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


@dataclass
class ModelSpec:
    """One model (checkpoint folder or LoRA adapter folder) and its per-model parameters."""

    path: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class MergeConfig:
    method: str
    models: list[ModelSpec]
    base: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    out_dtype: str | None = None
    output: str | None = None
    seed: int = 0
    shard_size: int | str = "5GB"
    vocab_padding: str = "error"
    lora_output: str = "full"
    rank: int | None = None

    def split_params(self) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """(global params, per-model lists) for the registry, per-model names filled per model:
        the model's own value, else the global value, else the method's default."""
        method = get_merge_method(self.method)
        global_params = dict(self.params)
        per_model: dict[str, list[Any]] = {}
        keys = {k for spec in self.models for k in spec.params}
        for spec in self.models:
            unknown = set(spec.params) - set(method.per_model)
            if unknown:
                raise ValueError(
                    f"model {spec.path}: {sorted(unknown)} are not per-model parameters of "
                    f"{method.name!r} (per-model: {list(method.per_model)})"
                )
        n = len(self.models)
        for key in keys:
            fallback = global_params.pop(key, method.per_model_defaults.get(key))
            if isinstance(fallback, (list, tuple)) and len(fallback) != n:
                raise ValueError(f"parameter {key!r} has {len(fallback)} values for {n} models")
            values = []
            for i, spec in enumerate(self.models):
                default = fallback[i] if isinstance(fallback, (list, tuple)) else fallback
                value = spec.params.get(key, default)
                if value is None:
                    raise ValueError(f"model {spec.path} needs a value for {key!r}")
                values.append(to_number(value, f"model {spec.path}: parameter {key!r}"))
            per_model[key] = values
        return global_params, per_model

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pick(raw: dict[str, Any], field_name: str) -> Any:
    found = [k for k in TOP_LEVEL_KEYS[field_name] if k in raw]
    if len(found) > 1:
        raise ValueError(f"merge config gives both {found[0]!r} and {found[1]!r}")
    return raw[found[0]] if found else None


def merge_config_from_dict(raw: dict[str, Any], root: str | os.PathLike = ".") -> MergeConfig:
    """Build a :class:`MergeConfig` from a parsed file; relative paths are resolved under ``root``."""
    if not isinstance(raw, dict):
        raise ValueError("a merge config must be a mapping of keys to values")
    known = {k for keys in TOP_LEVEL_KEYS.values() for k in keys}
    unknown = sorted(str(k) for k in set(raw) - known)
    if unknown:
        raise ValueError(f"merge config: unknown key(s) {unknown}; known: {sorted(known)}")
    root = Path(root)

    def resolve(path: Any) -> str | None:
        if path is None:
            return None
        p = Path(os.path.expanduser(str(path)))
        return str(p if p.is_absolute() else root / p)

    method = _pick(raw, "method")
    if not method:
        raise ValueError("merge config: 'method' is missing")
    models_raw = _pick(raw, "models") or []
    if not isinstance(models_raw, list) or not models_raw:
        raise ValueError("merge config: 'models' must be a non-empty list")
    models = []
    for i, entry in enumerate(models_raw):
        if isinstance(entry, str):
            models.append(ModelSpec(resolve(entry)))
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"merge config: models[{i}] must be a path or a mapping")
        path = entry.get("model", entry.get("path"))
        if path is None:
            raise ValueError(f"merge config: models[{i}] has no 'model' (path)")
        params = _mapping(entry.get("parameters", entry.get("params")), f"models[{i}].parameters")
        extra = set(entry) - {"model", "path", "parameters", "params"}
        if extra:
            raise ValueError(
                f"merge config: models[{i}] has unknown key(s) {sorted(map(str, extra))}"
            )
        models.append(ModelSpec(resolve(path), params))
    lora = _pick(raw, "lora") or {}
    if not isinstance(lora, dict) or set(lora) - {"output", "rank"}:
        raise ValueError("merge config: 'lora' takes {output: full|adapter, rank: N}")
    config = MergeConfig(
        method=str(method),
        models=models,
        base=resolve(_pick(raw, "base")),
        params=_mapping(_pick(raw, "params"), "parameters"),
        output=resolve(_pick(raw, "output")),
    )
    for name in ("dtype", "out_dtype", "seed", "shard_size", "vocab_padding"):
        value = _pick(raw, name)
        if value is not None:
            setattr(config, name, value)
    if "output" in lora:
        config.lora_output = lora["output"]
    if "rank" in lora:
        config.rank = lora["rank"]
    validate_config(config)
    return config


def _mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"merge config: {key!r} must be a mapping of names to values, got {value!r}"
        )
    return dict(value)


def validate_config(config: MergeConfig) -> None:
    """Check every field (each error names its key); normalise seed and rank to ints."""
    get_merge_method(config.method)  # KeyError naming the registered methods
    parse_dtype(config.dtype)
    parse_dtype(config.out_dtype)
    if config.lora_output not in ("full", "adapter"):
        raise ValueError(f"lora output must be 'full' or 'adapter', not {config.lora_output!r}")
    if config.rank is not None:
        config.rank = to_number(config.rank, "merge config: lora rank", integer=True)
        if config.rank < 1:
            raise ValueError(
                f"merge config: lora rank must be a positive integer, not {config.rank}"
            )
    config.seed = to_number(config.seed, "merge config: seed", integer=True)
    if config.vocab_padding not in VOCAB_PADDING_RULES:
        raise ValueError(
            f"merge config: vocab_padding must be one of {', '.join(VOCAB_PADDING_RULES)}, "
            f"not {config.vocab_padding!r}"
        )
    if config.shard_size is not None:
        shard_size_bytes(config.shard_size)


def shard_size_bytes(size: Any) -> int:
    """``shard_size`` (``5GB``, ``500MB``, a byte count) in bytes; it must be positive."""
    message = f"shard_size must be a positive size such as 5GB, 500MB or a byte count, got {size!r}"
    if isinstance(size, bool) or not isinstance(size, (str, int, float)):
        raise ValueError(message)
    try:
        n = parse_size(size if not isinstance(size, float) else str(size))
    except (ValueError, OverflowError):
        raise ValueError(message) from None
    if n <= 0:
        raise ValueError(message)
    return n


def load_merge_config(path: str | os.PathLike) -> MergeConfig:
    """Read a ``.yaml``/``.yml`` or ``.toml`` merge config."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"merge config {path} does not exist")
    if not path.is_file():
        raise IsADirectoryError(f"merge config {path} is not a file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at byte offset "
            f"{exc.start}); save the config as UTF-8"
        ) from None
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        try:
            raw = tomllib.loads(text)  # refuses a key given twice
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    elif path.suffix.lower() in (".yaml", ".yml"):
        raw = load_yaml(text, path)
    else:
        raise ValueError(f"{path}: a merge config must end in .yaml, .yml or .toml")
    return merge_config_from_dict(raw, root=path.parent)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping that gives one key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (instead of last-wins).

    Keys brought in by a merge key (``<<: *defaults``) may still be overridden, as YAML intends.
    """

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    continue  # SafeLoader reports an unhashable key itself
                if key in first_line:
                    raise DuplicateKeyError(
                        None,
                        None,
                        f"duplicate key {key!r} (first given on line {first_line[key]})",
                        key_node.start_mark,
                    )
                first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, path: str | os.PathLike = "<string>") -> Any:
    """Parse YAML safely, refusing duplicate keys; errors are one line ``path:line:col: ...``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = getattr(exc, "context", None)
        detail = (
            f"{problem} ({context})"
            if context and not isinstance(exc, DuplicateKeyError)
            else problem
        )
        raise ValueError(f"{where}: invalid YAML: {detail}") from None
