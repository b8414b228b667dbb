"""Merge configs in YAML or TOML: one file says what ``mergelab merge`` does.

Two dialects, told apart by the method key and never mixed in one file:

* ``method:`` — mergelab's own spelling and semantics (the papers' defaults), below;
* ``merge_method:`` — mergekit's spelling, read with mergekit 0.1.5's semantics and defaults
  (:mod:`mergelab.merge.mergekit_dialect`): mergekit's configs work as they are, and give
  mergekit's model.

mergelab's dialect:

    method: ties                 # any registered method
    base: models/base            # optional for methods without a base
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
models can move together. A model that is not a local folder but is named like a Hugging Face
hub id (``org/name``, ``name``) is taken from the local Hugging Face cache, or refused as not
available offline (:func:`locate_model`); a local folder of that name always wins. A key given twice in one mapping is an error (YAML would otherwise
keep the last one silently; TOML refuses it itself), and so is a value of the wrong kind: numbers
may be written as strings (``density: "0.5"``), every error names the key (and the model).
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from mergelab.inputs import parse_nested, read_config_bytes

from .checkpoint import parse_size
from .registry import get_merge_method, to_number
from .validation import VOCAB_PADDING_RULES

if TYPE_CHECKING:
    from .mergekit_dialect import MergekitConfig

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
    "method": ("method",),
    "base": ("base",),
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
    given: str | None = None  # the path as written (a hub id is looked up as written)


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
    base_given: str | None = None  # the base as written
    text: str | None = None  # the config file as written (quoted in the model card)

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


# Keys only mergekit's dialect has, with the mergelab spelling where there is one.
MERGEKIT_ONLY_KEYS = {
    "merge_method": "method",
    "base_model": "base",
    "slices": None,
    "modules": None,
    "tokenizer_source": None,
    "tokenizer": None,
    "chat_template": None,
}


def config_dialect(raw: Any) -> str:
    """``"mergekit"`` for a config with ``merge_method``, ``"mergelab"`` for one with ``method``;
    a config that mixes the two spellings is refused, naming the keys."""
    if not isinstance(raw, dict):
        raise ValueError("a merge config must be a mapping of keys to values")
    if "merge_method" in raw and "method" in raw:
        raise ValueError(
            "merge config gives both 'method' (mergelab's dialect) and 'merge_method' "
            "(mergekit's); write one dialect: method/base/... or merge_method/base_model/..."
        )
    if "merge_method" in raw:
        from .mergekit_dialect import MERGEKIT_KEYS, RUN_OPTION_KEYS

        mixed = sorted(str(k) for k in set(raw) - set(MERGEKIT_KEYS) - set(RUN_OPTION_KEYS))
        ours = [k for k in mixed if k in TOP_LEVEL_KEYS or k in ("params", "out")]
        if ours:
            raise ValueError(
                f"merge config mixes dialects: merge_method is mergekit's spelling but {ours} "
                "are mergelab's; a mergekit config takes base_model, parameters, models/slices, "
                "dtype, out_dtype, tokenizer_source, tokenizer, chat_template"
            )
        return "mergekit"
    theirs = [k for k in raw if k in MERGEKIT_ONLY_KEYS]
    if theirs:
        spelled = {k: MERGEKIT_ONLY_KEYS[k] for k in theirs}
        if "method" in raw:
            raise ValueError(
                f"merge config mixes dialects: 'method' is mergelab's spelling but {theirs} are "
                "mergekit's; write mergelab's keys ("
                + ", ".join(f"{v} for {k}" for k, v in spelled.items() if v)
                + ") or mergekit's merge_method to read the whole file as mergekit does"
            )
    if "method" not in raw:
        _no_method(raw, theirs)
    return "mergelab"


def _no_method(raw: dict[str, Any], theirs: list[str]) -> None:
    """A config naming no method: a misspelled ``merge_method`` / ``method`` is named as such
    (rather than reported as mergelab's unknown keys), and so is a mergekit config without one."""
    import difflib

    for key in map(str, raw):
        close = difflib.get_close_matches(key, ["merge_method", "method"], n=1, cutoff=0.75)
        if close:
            dialect = "mergekit's dialect" if close[0] == "merge_method" else "mergelab's dialect"
            raise ValueError(
                f"merge config: unknown key {key!r}: did you mean {close[0]!r} ({dialect})?"
            )
    if theirs:
        raise ValueError(
            f"merge config has mergekit's keys {theirs} but no merge_method: name the method "
            "(merge_method: ties, ...)"
        )


def merge_config_from_dict(raw: dict[str, Any], root: str | os.PathLike = ".") -> MergeConfig:
    """Build a mergelab-dialect :class:`MergeConfig` from a parsed file; relative paths are
    resolved under ``root``. A mergekit-dialect mapping is refused here (see
    :func:`config_from_dict`, which reads either)."""
    if config_dialect(raw) == "mergekit":
        raise ValueError(
            "this is a mergekit-dialect config (merge_method); read it with config_from_dict "
            "or load_merge_config"
        )
    raw = load_config_plugins(raw, root)
    known = {k for keys in TOP_LEVEL_KEYS.values() for k in keys} | {"plugins"}
    unknown = sorted(str(k) for k in set(raw) - known)
    if unknown:
        raise ValueError(f"merge config: unknown key(s) {unknown}; known: {sorted(known)}")
    root = Path(root)

    def resolve(path: Any) -> str | None:
        if path is None:
            return None
        p = Path(os.path.expanduser(str(path)))
        if not p.is_absolute() and not (root / p).exists():
            cached = hub_snapshot(str(path)) if looks_like_hub_id(str(path)) else None
            if cached is not None:
                return str(cached)
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
            models.append(ModelSpec(resolve(entry), given=entry))
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
        models.append(ModelSpec(resolve(path), params, given=str(path)))
    lora = _pick(raw, "lora") or {}
    if not isinstance(lora, dict) or set(lora) - {"output", "rank"}:
        raise ValueError("merge config: 'lora' takes {output: full|adapter, rank: N}")
    config = MergeConfig(
        method=str(method),
        models=models,
        base=resolve(_pick(raw, "base")),
        params=_mapping(_pick(raw, "params"), "parameters"),
        base_given=str(_pick(raw, "base")) if _pick(raw, "base") is not None else None,
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


def config_from_dict(
    raw: Any, root: str | os.PathLike = ".", text: str | None = None
) -> MergeConfig | MergekitConfig:
    """A parsed config in either dialect (see the module docstring). Its ``plugins`` (files
    relative to ``root``, or module names) are loaded first, so their methods can be named."""
    if config_dialect(raw) == "mergekit":
        raw = load_config_plugins(raw, root)
        from .mergekit_dialect import mergekit_config_from_dict

        return mergekit_config_from_dict(raw, root=root, text=text)
    config = merge_config_from_dict(raw, root=root)
    config.text = text
    return config


def load_config_plugins(raw: dict[str, Any], root: str | os.PathLike) -> dict[str, Any]:
    """Load the plugins a config lists (:mod:`mergelab.plugins`); ``raw`` without that key."""
    if "plugins" not in raw:
        return raw
    from mergelab.plugins import check_list, load_plugins

    load_plugins(check_list(raw["plugins"], "merge config"), root)
    return {k: v for k, v in raw.items() if k != "plugins"}


def load_merge_config(path: str | os.PathLike) -> MergeConfig | MergekitConfig:
    """Read a ``.yaml``/``.yml`` or ``.toml`` merge config, in mergelab's dialect (a
    :class:`MergeConfig`) or mergekit's (a :class:`~mergelab.merge.mergekit_dialect.MergekitConfig`)."""
    path = Path(path)
    data = read_config_bytes(path, "merge config")  # a FIFO or /dev/zero is refused unread
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
            raw = parse_nested(lambda: tomllib.loads(text), str(path))  # refuses a key twice
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    elif path.suffix.lower() in (".yaml", ".yml"):
        raw = load_yaml(text, path)
    else:
        raise ValueError(f"{path}: a merge config must end in .yaml, .yml or .toml")
    return config_from_dict(raw, root=path.parent, text=text)


# ----------------------------------------------------------------------------------------------
# Where a model is: a local folder, or a hub id found in the local Hugging Face cache.

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hub_id(text: str) -> bool:
    """``org/name`` or ``name`` (Hugging Face's repo id form), not ``./x``, ``a/b/c`` or ``~``."""
    return bool(HUB_ID.fullmatch(text)) and ".." not in text and not text.endswith(".git")


def hub_cache_dir() -> Path:
    """The hub cache as Hugging Face resolves it now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``,
    else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder of a hub model, or None; never touches the network."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True
        )
    except Exception:  # not cached, or not a valid repo id: either way, not available here
        return None
    return Path(folder) if (Path(folder) / "config.json").is_file() else None


def locate_model(given: str, roots: list[Path]) -> tuple[Path, bool]:
    """The folder of a model as written in a config: (folder, found in the hub cache?).

    A local folder wins: an absolute path, or a relative one under the first of ``roots`` that
    holds it (a config's folder, then — for mergekit's dialect — the working folder, as mergekit
    resolves it). Else a name shaped like a hub id (``org/name``, optionally ``@revision``) is
    looked up in the local Hugging Face cache. Else it is refused: a hub id as not available
    offline, anything else as not existing.
    """
    name, _, revision = given.partition("@")
    path = Path(os.path.expanduser(given))
    if path.is_absolute():
        if path.exists():
            return path, False
        raise FileNotFoundError(f"model {given} does not exist")
    for root in roots:
        if (root / path).exists():
            return root / path, False
    if looks_like_hub_id(name):
        cached = hub_snapshot(name, revision or None)
        if cached is not None:
            return cached, True
        raise FileNotFoundError(
            f"model {given!r} is not a local folder (looked in "
            f"{', '.join(str(r) for r in roots)}) and not in the local Hugging Face cache "
            f"({hub_cache_dir()}): not available offline. mergelab never downloads; fetch it "
            f"first (huggingface-cli download {name}) or give a local path"
        )
    raise FileNotFoundError(
        f"model {given} does not exist (looked in {', '.join(map(str, roots))})"
    )


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
        return parse_nested(lambda: yaml.load(text, Loader=_UniqueKeyLoader), str(path))
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
