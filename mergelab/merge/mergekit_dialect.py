"""mergekit's config dialect: a config spelled the mergekit way means what mergekit 0.1.5 means.

A merge config that says ``merge_method`` (mergekit's key) is read here, with mergekit's
semantics and defaults, and planned as a streamed checkpoint merge that gives mergekit's model;
one that says ``method`` (mergelab's key) keeps mergelab's semantics (the papers' defaults,
:mod:`mergelab.merge.config`). The two spellings are never mixed in one file. docs/mergekit.md
lists every key and how it maps; in short:

* **Methods** map to mergelab's registered methods with the parameters that reproduce mergekit's
  variant (e.g. ``ties`` → mergelab ``ties`` with ``trim_scope="tensor"``,
  ``weighted_sign=True``, ``divide_by="weight_sum"`` when ``normalize`` is true, else ``"none"``)
  and with mergekit's defaults (``density`` 1.0, ``normalize`` per method, ``rescale`` per
  method). See :data:`METHODS`.
* **Parameters** are resolved per output tensor exactly as mergekit resolves them: a model's own
  ``parameters``, then its slice's, then the global ones, then the method's default; a list of
  numbers is a gradient interpolated linearly over the layers of a slice (t = i / (n − 1) for
  layer i of n; tensors outside the layers use t = 0); a list of ``{filter, value}`` takes the
  first entry whose ``filter`` is a substring of the tensor's name (or has no filter).
  Per-model parameters see the input tensor's name, shared ones the output's.
* **Inputs**: with ``models:``, every layer comes from the same layer of every model, and a
  ``base_model`` not listed among the models is added as the last input. With ``slices:``, each
  slice stacks ``layer_range`` of its sources; output layers are numbered in order and
  ``num_hidden_layers`` becomes the total. Tensors before the first layer (embeddings) come from
  the first slice's sources, those after the last layer (final norm, output head) from the last
  slice's. Two references to a model are the same model only when written the same way (as in
  mergekit).
* **dtype**: inputs are cast to ``dtype`` when read and the method computes in it (linear and
  slerp compute in float32 internally and hand back ``dtype``, as mergekit's do); the output is
  stored in ``out_dtype``, else ``dtype``, else the checkpoints' dtype.
* **Tokenizers**: ``tokenizer_source`` / ``tokenizer:`` build the output tokenizer and align
  embedding rows (:mod:`mergelab.merge.tokenizer`); ``chat_template`` sets its template.
* Anything mergekit 0.1.5 accepts that mergelab does not support is refused with a message that
  names it (:class:`MergekitConfigError`), never reinterpreted.

Randomness: DARE-style methods draw their masks from mergelab's generator seeded by (seed, tensor
name); mergekit draws from torch's global generator. The distribution is the same, the draws are
not, so only the maths around the draw can be compared to mergekit's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergelab.errors import UserInputError

from .checkpoint import (
    COPIED_FILES,
    TIED_PAIRS,
    TOKENIZER_FILES,
    CheckpointFolder,
    CheckpointMergePlan,
    OutputTensor,
    TensorRecipe,
    TensorSource,
    plan_recipe_merge,
)
from .registry import MergeMethod, UnknownMergeMethodError, get_merge_method, to_number
from .validation import check_same_architecture, is_vocab_tensor

# Keys of a mergekit config (mergekit 0.1.5's MergeConfiguration), and mergelab's run options
# (where to write, seed, shard size), which either dialect may carry.
MERGEKIT_KEYS = (
    "merge_method",
    "base_model",
    "models",
    "slices",
    "modules",
    "parameters",
    "dtype",
    "out_dtype",
    "tokenizer_source",
    "tokenizer",
    "chat_template",
)
RUN_OPTION_KEYS = ("output", "out", "seed", "shard_size", "plugins")
MERGEKIT_DTYPES = ("float32", "float16", "bfloat16", "float64")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}


class MergekitConfigError(UserInputError):
    """A mergekit-dialect config that is invalid, or that uses something of mergekit's that
    mergelab does not support (the message names it)."""


def _fail(message: str) -> MergekitConfigError:
    return MergekitConfigError(f"mergekit config: {message}")


# ----------------------------------------------------------------------------------------------
# Parameter settings: scalars, gradients, filters (mergekit's ParameterSetting).


@dataclass(frozen=True)
class Conditional:
    """``{filter: self_attn, value: 0.5}``: ``value`` for tensors whose name contains ``filter``
    (no filter, or ``"*"``: every tensor)."""

    value: Any
    filter: str | None = None


def parse_setting(value: Any, where: str) -> Any:
    """A parameter value as written: a scalar, a gradient (list of scalars), a
    :class:`Conditional` or a list of them. Anything else is refused, naming ``where``."""
    if _is_scalar(value):
        return value
    if isinstance(value, dict):
        return _conditional(value, where)
    if isinstance(value, list):
        if all(_is_scalar(v) for v in value):
            return list(value)
        if all(isinstance(v, dict) for v in value):
            return [_conditional(v, f"{where}[{i}]") for i, v in enumerate(value)]
        raise _fail(
            f"{where}: a list must hold only values (a gradient) or only "
            f"{{filter, value}} entries, got {value!r}"
        )
    raise _fail(f"{where}: {value!r} is not a value, a gradient or a list of {{filter, value}}")


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _conditional(entry: dict, where: str) -> Conditional:
    extra = sorted(map(str, set(entry) - {"value", "filter"}))
    if extra:  # mergekit would ignore these silently
        raise _fail(f"{where}: unknown key(s) {extra}; an entry takes 'value' and 'filter'")
    if "value" not in entry:
        raise _fail(f"{where}: a {{filter, value}} entry needs 'value'")
    value = entry["value"]
    if not (_is_scalar(value) or (isinstance(value, list) and all(map(_is_scalar, value)))):
        raise _fail(f"{where}: 'value' must be a value or a gradient, got {value!r}")
    filt = entry.get("filter")
    if filt is not None and not isinstance(filt, str):
        raise _fail(f"{where}: 'filter' must be text (a substring of tensor names), got {filt!r}")
    return Conditional(value=value, filter=filt)


def evaluate_setting(tensor_name: str, setting: Any, t: float, validate: Callable) -> Any:
    """The value of a setting for one tensor at gradient position ``t`` (mergekit's rule).

    Numbers in a gradient are interpolated linearly between neighbouring entries; booleans and
    text pick the entry at ``int(t · (n − 1))``. ``None`` when no filter matches."""
    if isinstance(setting, Conditional):
        setting = [setting]
    if _is_scalar(setting):
        return validate(setting)
    if not setting:
        return None
    if all(_is_scalar(e) for e in setting):
        values = [validate(e) for e in setting]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return values[int(t * (len(values) - 1))]
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return validate((1 - frac) * values[i0] + frac * values[i1])
    for cond in setting:
        if (
            cond.filter is None
            or cond.filter == "*"
            or (tensor_name and cond.filter in tensor_name)
        ):
            return evaluate_setting(tensor_name, cond.value, t, validate)
    return None


# ----------------------------------------------------------------------------------------------
# mergekit's methods and how each maps to a mergelab method.

REQUIRED = object()  # a parameter without a default


@dataclass(frozen=True)
class MkParam:
    """One of a mergekit method's parameters: ``kind`` float | int | bool | optional_float;
    ``scope`` shared (one value) | input (one per input) | non_base (one per non-base input)."""

    name: str
    kind: str
    scope: str
    default: Any = REQUIRED

    def validate(self, value: Any, where: str) -> Any:
        if self.kind == "optional_float" and value is None:
            return None
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            text = str(value).strip().lower()
            if isinstance(value, str) and text in _BOOL_TEXT:
                return _BOOL_TEXT[text]
            raise _fail(f"{where}: {self.name} must be true or false, got {value!r}")
        if isinstance(value, bool):
            raise _fail(f"{where}: {self.name} must be a number, got {value!r}")
        try:
            number = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            raise _fail(f"{where}: {self.name} must be a number, got {value!r}") from None
        if self.kind == "int":
            if number != int(number):
                raise _fail(f"{where}: {self.name} must be an integer, got {value!r}")
            return int(number)
        return number


_BOOL_TEXT = {
    **dict.fromkeys(("true", "t", "yes", "y", "on", "1"), True),
    **dict.fromkeys(("false", "f", "no", "n", "off", "0"), False),
}

# (mergekit shared values, per-model lists over the experts) -> (mergelab params, per-model)
Translate = Callable[[dict[str, Any], dict[str, list[Any]]], tuple[dict, dict]]


@dataclass(frozen=True)
class MkMethod:
    """A mergekit method: its parameters and input contract, and the mergelab method (with
    fixed parameters) that computes the same thing. ``target=None``: refused with ``refusal``."""

    name: str
    target: str | None
    base: str = "ignored"  # required | optional | ignored (the base is then a plain input)
    params: tuple[MkParam, ...] = ()
    min_inputs: int = 1
    max_inputs: int | None = None
    min_non_base: int | None = None
    max_non_base: int | None = None
    float32_inside: bool = False  # computes in float32 and hands back the input dtype
    no_effect: frozenset[str] = frozenset()  # parameters mergekit accepts that change nothing
    translate: Translate | None = None  # None: same names, passed through
    fixed: dict[str, Any] = field(default_factory=dict)  # shown by --explain
    refusal: str | None = None

    def param(self, name: str) -> MkParam | None:
        return next((p for p in self.params if p.name == name), None)


def _gta_params(normalize: bool, rescale: bool, extra: tuple[MkParam, ...] = ()) -> tuple:
    return (
        MkParam("int8_mask", "bool", "shared", False),
        MkParam("normalize", "bool", "shared", normalize),
        MkParam("rescale", "bool", "shared", rescale),
        MkParam("lambda", "float", "shared", 1.0),
        MkParam("weight", "float", "non_base"),
        MkParam("density", "float", "non_base", 1.0),
        *extra,
    )


def _density(values: list[float]) -> list[float]:
    """mergekit keeps everything at density ≥ 1; mergelab's range is (0, 1]: same meaning."""
    return [min(d, 1.0) for d in values]


def _no_rescale(method: str, shared: dict[str, Any]) -> None:
    if shared["rescale"]:
        raise _fail(
            f"rescale: true with {method} (rescaling a magnitude-trimmed task vector to its "
            "L1 norm) is not supported by mergelab; remove it or set rescale: false"
        )


def _task_arithmetic(shared, lists):
    return {"lambda": shared["lambda"], "normalize": shared["normalize"]}, {
        "weight": lists["weight"]
    }


def _ties(shared, lists):
    _no_rescale("ties", shared)
    params = {
        "lambda": shared["lambda"],
        "trim_scope": "tensor",
        "majority_sign": "sum",
        "weighted_sign": True,
        "divide_by": "weight_sum" if shared["normalize"] else "none",
    }
    return params, {"weight": lists["weight"], "density": _density(lists["density"])}


def _dare_ties(shared, lists):
    params = {
        "lambda": shared["lambda"],
        "rescale": "l1" if shared["rescale"] else "none",
        "majority_sign": "sum",
        "weighted_sign": True,
        "divide_by": "weight_sum" if shared["normalize"] else "none",
    }
    return params, {"weight": lists["weight"], "density": _density(lists["density"])}


def _dare_linear(shared, lists):
    params = {
        "lambda": shared["lambda"],
        "rescale": "l1" if shared["rescale"] else "none",
        "normalize": shared["normalize"],
    }
    return params, {"weight": lists["weight"], "density": _density(lists["density"])}


def _breadcrumbs(shared, lists):
    _no_rescale("breadcrumbs", shared)
    params = {"lambda": shared["lambda"], "normalize": shared["normalize"]}
    per_model = {"weight": lists["weight"], "density": lists["density"], "gamma": lists["gamma"]}
    return params, per_model


def _della(shared, lists):
    params = {
        "lambda": shared["lambda"],
        "rescale": "l1" if shared["rescale"] else "none",
        "normalize": shared["normalize"],
    }
    per_model = {
        "weight": lists["weight"],
        "density": _density(lists["density"]),
        "epsilon": lists["epsilon"],
    }
    return params, per_model


def _slerp(shared, lists):
    return {"t": shared["t"], "extrapolate": True}, {}  # mergekit does not bound t


_FIXED_TIES = {"trim_scope": "tensor", "majority_sign": "sum", "weighted_sign": True}
_GAMMA = MkParam("gamma", "float", "non_base", 0.01)
_EPSILON = MkParam("epsilon", "float", "non_base", 0.15)

METHODS: dict[str, MkMethod] = {
    m.name: m
    for m in [
        MkMethod(
            "linear",
            "linear",
            params=(
                MkParam("weight", "float", "input"),
                MkParam("normalize", "bool", "shared", True),
            ),
            float32_inside=True,
        ),
        MkMethod(
            "slerp",
            "slerp",
            base="required",
            params=(MkParam("t", "float", "shared"),),
            min_inputs=2,
            max_inputs=2,
            float32_inside=True,
            translate=_slerp,
            fixed={"extrapolate": True},
        ),
        MkMethod(
            "task_arithmetic",
            "task_arithmetic",
            base="required",
            params=_gta_params(False, False),
            no_effect=frozenset({"int8_mask", "rescale", "density"}),
            translate=_task_arithmetic,
        ),
        MkMethod(
            "ties",
            "ties",
            base="required",
            params=_gta_params(True, False),
            no_effect=frozenset({"int8_mask"}),
            translate=_ties,
            fixed={**_FIXED_TIES, "divide_by": "weight_sum (normalize) | none"},
        ),
        MkMethod(
            "dare_ties",
            "dare_ties",
            base="required",
            params=_gta_params(False, True),
            no_effect=frozenset({"int8_mask"}),
            translate=_dare_ties,
            fixed={**_FIXED_TIES, "rescale": "l1 | none", "divide_by": "weight_sum | none"},
        ),
        MkMethod(
            "dare_linear",
            "dare_linear",
            base="required",
            params=_gta_params(False, True),
            no_effect=frozenset({"int8_mask"}),
            translate=_dare_linear,
            fixed={"rescale": "l1 | none"},
        ),
        MkMethod(
            "breadcrumbs",
            "breadcrumbs",
            base="required",
            params=_gta_params(False, False, (_GAMMA,)),
            no_effect=frozenset({"int8_mask"}),
            translate=_breadcrumbs,
        ),
        MkMethod(
            "breadcrumbs_ties",
            None,
            refusal="breadcrumbs_ties (Breadcrumbs' mask followed by TIES' sign election) has no "
            "mergelab method yet",
        ),
        MkMethod(
            "della",
            "della",
            base="required",
            params=_gta_params(True, True, (_EPSILON,)),
            no_effect=frozenset({"int8_mask"}),
            translate=_della,
            fixed={"rescale": "l1 | none"},
        ),
        MkMethod(
            "della_linear",
            "della_linear",
            base="required",
            params=_gta_params(False, True, (_EPSILON,)),
            no_effect=frozenset({"int8_mask"}),
            translate=_della,
            fixed={"rescale": "l1 | none"},
        ),
        MkMethod(
            "model_stock",
            "model_stock",
            base="required",
            params=(MkParam("filter_wise", "bool", "shared", False),),
            min_inputs=3,
        ),
        MkMethod(
            "passthrough",
            "passthrough",
            params=(MkParam("scale", "optional_float", "input", None),),
            max_inputs=1,
        ),
        MkMethod(
            "nuslerp",
            "nuslerp",
            base="optional",
            params=(
                MkParam("weight", "float", "non_base"),
                MkParam("nuslerp_row_wise", "bool", "shared", False),
                MkParam("nuslerp_flatten", "bool", "shared", True),
            ),
            min_non_base=2,
            max_non_base=2,
        ),
        MkMethod(
            "multislerp",
            "multislerp",
            base="optional",
            params=(
                MkParam("weight", "float", "non_base"),
                MkParam("normalize_weights", "bool", "shared", True),
                MkParam("eps", "float", "shared", 1e-8),
            ),
            min_non_base=1,
        ),
        MkMethod(
            "karcher",
            "karcher",
            params=(
                MkParam("max_iter", "int", "shared", 10),
                MkParam("tol", "float", "shared", 1e-5),
            ),
        ),
        MkMethod(
            "sce",
            "sce",
            base="required",
            params=(
                MkParam("int8_mask", "bool", "shared", False),
                MkParam("select_topk", "float", "shared", 1.0),
            ),
            no_effect=frozenset({"int8_mask"}),
        ),
        MkMethod(
            "nearswap",
            "nearswap",
            base="required",
            params=(MkParam("t", "float", "shared"),),
            min_inputs=2,
            max_inputs=2,
        ),
        MkMethod("arcee_fusion", "arcee_fusion", base="required", min_inputs=2, max_inputs=2),
        MkMethod(
            "ram",
            None,
            refusal="ram (reinforced agent merging) has no mergelab method yet",
        ),
        MkMethod(
            "ramplus_tl",
            None,
            refusal="ramplus_tl (RAM+ with task-layer rescaling) has no mergelab method yet",
        ),
    ]
}


def mergekit_method(name: str) -> tuple[MkMethod, MergeMethod]:
    """mergekit's method ``name`` and the mergelab method that computes it; refused (naming it)
    when mergelab has none."""
    spec = METHODS.get(name) or _plugin_method(name)
    if spec is None:
        raise _fail(
            f"merge_method {name!r} is not one of mergekit 0.1.5's methods "
            f"({', '.join(sorted(METHODS))})"
        )
    if spec.target is None:
        raise _fail(f"merge_method {name!r} is not supported: {spec.refusal}")
    try:
        return spec, get_merge_method(spec.target)
    except UnknownMergeMethodError:
        raise _fail(
            f"merge_method {name!r} is not supported: mergelab has no {spec.target!r} method "
            "registered (yet)"
        ) from None


def _plugin_method(name: str) -> MkMethod | None:
    """A method a plugin registered (:mod:`mergelab.plugins`), under mergekit's spelling: its
    number and true/false parameters are mergekit parameters of the same names (per-model ones
    per non-base model, the others shared); it computes what it computes in mergelab."""
    from .registry import merge_method_origins

    if merge_method_origins().get(name, "builtin") == "builtin":
        return None
    method = get_merge_method(name)
    kinds = {bool: "bool", int: "int", float: "float", type(None): "optional_float"}
    params = [
        MkParam(key, kinds[type(value)], "shared", value)
        for key, value in method.global_defaults.items()
        if type(value) in kinds
    ]
    params += [
        MkParam(key, "float", "non_base", method.per_model_defaults.get(key, REQUIRED))
        for key in method.per_model
    ]
    low, high = method.n_experts
    return MkMethod(
        name,
        name,
        base="required" if method.needs_base else "optional",
        params=tuple(params),
        min_non_base=low,
        max_non_base=high,
    )


# ----------------------------------------------------------------------------------------------
# The config.


@dataclass
class MkSource:
    """A model as one input of an output slice; ``layer_range`` None means all its layers."""

    model: str  # as written: its identity
    layer_range: tuple[int, int] | None = None
    params: dict[str, Any] | None = None


@dataclass
class MkSlice:
    sources: list[MkSource]
    base_model: str | None = None
    params: dict[str, Any] | None = None


@dataclass
class MergekitConfig:
    """A mergekit-dialect config, checked key by key (paths not yet resolved)."""

    merge_method: str
    base_model: str | None = None
    models: list[MkSource] | None = None
    slices: list[MkSlice] | None = None
    params: dict[str, Any] | None = None
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | None = None
    tokenizer: dict[str, Any] | None = None
    chat_template: str | None = None
    output: str | None = None
    seed: int = 0
    shard_size: int | str = "5GB"
    root: str = "."  # folder of the config file (relative paths are looked up there first)
    text: str | None = None  # the config as written, for the model card

    def referenced_models(self) -> list[str]:
        """Every model the config names, in the order it names them, base first."""
        seen: dict[str, None] = {}
        if self.base_model:
            seen[self.base_model] = None
        for source in self.models or []:
            seen[source.model] = None
        for s in self.slices or []:
            if s.base_model:
                seen[s.base_model] = None
            for source in s.sources:
                seen[source.model] = None
        return list(seen)


def _model_ref(value: Any, where: str) -> str:
    if isinstance(value, dict):
        raise _fail(
            f"{where}: a model given as a mapping ({sorted(map(str, value))}; LoRA, "
            "override_architecture) is not supported; give a path or a hub name"
        )
    if not isinstance(value, str) or not value.strip():
        raise _fail(f"{where}: a model must be a path or a hub name, got {value!r}")
    if "+" in value:
        raise _fail(
            f"{where}: {value!r} is mergekit's model+LoRA reference, which mergelab does not "
            "support; merge the adapter into its model first (mergelab merge --lora-output full)"
        )
    return value


def _params(value: Any, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _fail(f"{where} must be a mapping of parameter names to values, got {value!r}")
    return {str(k): parse_setting(v, f"{where}.{k}") for k, v in value.items()}


def _check_keys(entry: dict, allowed: set[str], where: str, hints: dict[str, str] | None = None):
    for key in entry:
        if key in allowed:
            continue
        hint = (hints or {}).get(key)
        raise _fail(f"{where}: {hint}" if hint else f"{where}: unknown key {key!r}")


def mergekit_config_from_dict(
    raw: dict[str, Any], root: str | os.PathLike = ".", text: str | None = None
) -> MergekitConfig:
    """Check a parsed mergekit-dialect config key by key; refuse what is not supported."""
    hints = {
        "modules": "'modules' (per-module merges of multi-module models) is not supported",
        "method": "'method' is mergelab's spelling; with merge_method, write mergekit's keys only",
        "base": "'base' is mergelab's spelling; mergekit's is 'base_model'",
        "params": "'params' is mergelab's spelling; mergekit's is 'parameters'",
        "vocab_padding": "'vocab_padding' is mergelab's; mergekit aligns vocabularies with "
        "tokenizer_source or tokenizer",
        "lora": "'lora' is mergelab's (LoRA adapter merges); it has no mergekit spelling",
    }
    _check_keys(raw, set(MERGEKIT_KEYS) | set(RUN_OPTION_KEYS), "top level", hints)
    if "modules" in raw:
        raise _fail(hints["modules"])
    if "output" in raw and "out" in raw:
        raise _fail("give 'output' or 'out', not both")
    method = raw.get("merge_method")
    if not isinstance(method, str) or not method:
        raise _fail(f"merge_method must be a method name, got {method!r}")
    models, slices = raw.get("models"), raw.get("slices")
    if (models is None) == (slices is None) or (not models and not slices):
        raise _fail("give exactly one of 'models' and 'slices', as a non-empty list")
    config = MergekitConfig(merge_method=method, root=str(root), text=text)
    if raw.get("base_model") is not None:
        config.base_model = _model_ref(raw["base_model"], "base_model")
    config.params = _params(raw.get("parameters"), "parameters")
    if models is not None:
        if not isinstance(models, list):
            raise _fail("'models' must be a list")
        config.models = []
        for i, entry in enumerate(models):
            where = f"models[{i}]"
            if not isinstance(entry, dict) or "model" not in entry:
                raise _fail(f"{where} must be a mapping with 'model' (and optional 'parameters')")
            _check_keys(entry, {"model", "parameters"}, where)
            config.models.append(
                MkSource(
                    _model_ref(entry["model"], f"{where}.model"),
                    params=_params(entry.get("parameters"), f"{where}.parameters"),
                )
            )
    else:
        if not isinstance(slices, list):
            raise _fail("'slices' must be a list")
        config.slices = [_slice(entry, f"slices[{i}]") for i, entry in enumerate(slices)]
    for key in ("dtype", "out_dtype"):
        if raw.get(key) is not None:
            setattr(config, key, _dtype_name(raw[key], key))
    if raw.get("tokenizer_source") is not None and raw.get("tokenizer") is not None:
        raise _fail("give tokenizer_source or tokenizer, not both (mergekit refuses this too)")
    if raw.get("tokenizer_source") is not None:
        source = raw["tokenizer_source"]
        if not isinstance(source, str):
            raise _fail(f"tokenizer_source must be base, union or a model, got {source!r}")
        config.tokenizer_source = source
    if raw.get("tokenizer") is not None:
        config.tokenizer = _tokenizer_block(raw["tokenizer"])
    if raw.get("chat_template") is not None:
        if not isinstance(raw["chat_template"], str):
            raise _fail("chat_template must be text ('auto' or a Jinja template)")
        config.chat_template = raw["chat_template"]
    output = raw.get("output", raw.get("out"))
    if output is not None:
        config.output = str(Path(root) / os.path.expanduser(str(output)))
    if raw.get("seed") is not None:
        config.seed = raw["seed"]
    if raw.get("shard_size") is not None:
        config.shard_size = raw["shard_size"]
    spec, _ = mergekit_method(method)  # refuse an unsupported method before any file is read
    _check_parameter_names(config, spec)
    return config


def _check_parameter_names(config: MergekitConfig, spec: MkMethod) -> None:
    """A parameter the method does not have is refused (mergekit would ignore it silently)."""
    scopes = [("parameters", config.params)]
    scopes += [(f"models[{i}].parameters", m.params) for i, m in enumerate(config.models or [])]
    for k, s in enumerate(config.slices or []):
        scopes.append((f"slices[{k}].parameters", s.params))
        scopes += [
            (f"slices[{k}].sources[{j}].parameters", x.params) for j, x in enumerate(s.sources)
        ]
    names = {p.name for p in spec.params}
    for where, params in scopes:
        for key in params or {}:
            if key not in names:
                raise _fail(
                    f"{where}: {key!r} is not a parameter of mergekit's {spec.name} (its "
                    f"parameters: {', '.join(sorted(names)) or 'none'}); mergekit would ignore "
                    "it silently"
                )


def _slice(entry: Any, where: str) -> MkSlice:
    if not isinstance(entry, dict) or "sources" not in entry:
        raise _fail(f"{where} must be a mapping with 'sources'")
    hints = {
        "residual_weight": "residual_weight is accepted but ignored by mergekit 0.1.5; mergelab "
        "refuses it rather than ignore it silently"
    }
    _check_keys(entry, {"sources", "base_model", "parameters"}, where, hints)
    sources = entry["sources"]
    if not isinstance(sources, list) or not sources:
        raise _fail(f"{where}.sources must be a non-empty list")
    parsed = []
    for j, src in enumerate(sources):
        w = f"{where}.sources[{j}]"
        if not isinstance(src, dict) or "model" not in src or "layer_range" not in src:
            raise _fail(f"{w} must be a mapping with 'model' and 'layer_range'")
        _check_keys(src, {"model", "layer_range", "parameters"}, w)
        lr = src["layer_range"]
        if (
            not isinstance(lr, list)
            or len(lr) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in lr)
            or not 0 <= lr[0] <= lr[1]
        ):
            raise _fail(f"{w}.layer_range must be [first, end] with 0 ≤ first ≤ end, got {lr!r}")
        parsed.append(
            MkSource(
                _model_ref(src["model"], f"{w}.model"),
                (lr[0], lr[1]),
                _params(src.get("parameters"), f"{w}.parameters"),
            )
        )
    base = (
        _model_ref(entry["base_model"], f"{where}.base_model") if entry.get("base_model") else None
    )
    return MkSlice(parsed, base, _params(entry.get("parameters"), f"{where}.parameters"))


def _dtype_name(value: Any, key: str) -> str:
    name = str(value).lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in MERGEKIT_DTYPES:
        raise _fail(f"{key}: {value!r} is not one of {', '.join(MERGEKIT_DTYPES)}")
    return name


def _tokenizer_block(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail("tokenizer must be a mapping {source, tokens, pad_to_multiple_of}")
    _check_keys(value, {"source", "tokens", "pad_to_multiple_of"}, "tokenizer")
    source = value.get("source", "union")  # mergekit's default for the tokenizer block
    if not isinstance(source, str):
        raise _fail(f"tokenizer.source must be base, union or a model, got {source!r}")
    pad = value.get("pad_to_multiple_of")
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or pad < 1):
        raise _fail(f"tokenizer.pad_to_multiple_of must be a positive integer, got {pad!r}")
    tokens = value.get("tokens") or {}
    if not isinstance(tokens, dict):
        raise _fail("tokenizer.tokens must map token text to {source, force}")
    for tok, cfg in tokens.items():
        w = f"tokenizer.tokens[{tok!r}]"
        if not isinstance(cfg, dict):
            raise _fail(f"{w} must be a mapping {{source, force}}")
        _check_keys(cfg, {"source", "force"}, w)
        if not isinstance(cfg.get("force", False), bool):
            raise _fail(f"{w}.force must be true or false")
        src = cfg.get("source")
        if isinstance(src, dict):
            _check_keys(src, {"kind", "model", "token", "token_id"}, f"{w}.source")
            kind = src.get("kind")
            if kind not in ("model_token", "zero"):
                raise _fail(f"{w}.source.kind must be model_token or zero, got {kind!r}")
            if kind == "model_token":
                if "model" not in src or ("token" in src) == ("token_id" in src):
                    raise _fail(f"{w}.source needs 'model' and one of 'token', 'token_id'")
                _model_ref(src["model"], f"{w}.source.model")
        elif src is not None:
            _model_ref(src, f"{w}.source")
    return {"source": source, "tokens": dict(tokens), "pad_to_multiple_of": pad}


# ----------------------------------------------------------------------------------------------
# Layers: which tensors belong to layer i, and which come before or after the layers.

LAYER_NAME = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h|blocks|layer|block)\.)(?P<index>\d+)\.")
EMBEDDING_NAME = re.compile(
    r"(^|\.)(embed_tokens|embed_in|wte|wpe|word_embeddings|tok_embeddings|embeddings)(\.|$)"
)
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass
class LayerLayout:
    """A model's tensors by role: ``pre`` (input embeddings), per-layer names as (index, rest)
    under ``prefix``, ``post`` (everything else: final norm, output head)."""

    prefix: str | None
    n_layers: int
    count_key: str | None
    pre: list[str]
    post: list[str]
    layer_rests: list[str]  # the names of layer 0 after "prefix0.", in storage order

    def layer_name(self, index: int, rest: str) -> str:
        return f"{self.prefix}{index}.{rest}"


def layer_layout(folder: CheckpointFolder) -> LayerLayout:
    """Infer the layer structure from tensor names (``model.layers.<i>.…``) and config.json."""
    names = sorted(
        folder.tensors, key=lambda n: (str(folder.tensors[n].file), folder.tensors[n].offset)
    )
    prefixes: dict[str, None] = {}
    by_index: dict[int, list[str]] = {}
    pre, post = [], []
    for name in names:
        m = LAYER_NAME.match(name)
        if m:
            prefixes[m["prefix"]] = None
            by_index.setdefault(int(m["index"]), []).append(name[m.end() :])
        elif EMBEDDING_NAME.search(name) and "embed_out" not in name:
            pre.append(name)
        else:
            post.append(name)
    if len(prefixes) > 1:
        raise _fail(
            f"{folder.path}: tensors form several layer stacks ({', '.join(prefixes)}); "
            "mergekit-dialect merges need one stack of layers"
        )
    count_key = next((k for k in LAYER_COUNT_KEYS if isinstance(folder.config.get(k), int)), None)
    n_layers = folder.config[count_key] if count_key else (max(by_index) + 1 if by_index else 0)
    if by_index and set(by_index) != set(range(n_layers)):
        raise _fail(
            f"{folder.path}: config says {n_layers} layers ({count_key}) but tensors hold layers "
            f"{min(by_index)}..{max(by_index)}"
        )
    return LayerLayout(
        prefix=next(iter(prefixes), None),
        n_layers=n_layers,
        count_key=count_key,
        pre=pre,
        post=post,
        layer_rests=by_index.get(0, []),
    )


# ----------------------------------------------------------------------------------------------
# Planning: one recipe per output tensor.


@dataclass
class ParameterGroup:
    """Consecutive output tensors that share inputs and parameters (what --explain prints)."""

    names: list[str]
    inputs: list[str]
    t: float
    mergekit_shared: dict[str, Any]
    mergekit_per_model: dict[str, dict[str, Any]]
    params: dict[str, Any]
    per_model: dict[str, list[float]]

    def key(self) -> tuple:
        return (
            tuple(self.inputs),
            repr(self.mergekit_shared),
            repr(self.mergekit_per_model),
            repr(self.params),
            repr(self.per_model),
        )


@dataclass
class MergekitPlan:
    """A planned mergekit-dialect merge: the engine's plan plus what --explain shows."""

    config: MergekitConfig
    spec: MkMethod
    method: MergeMethod
    plan: CheckpointMergePlan
    groups: list[ParameterGroup]
    paths: dict[str, Path]  # model reference as written -> folder
    hub: list[str]  # references resolved from the Hugging Face cache
    notes: list[str]

    def close(self) -> None:
        self.plan.close()

    def explain(self) -> list[str]:
        """The fully resolved parameters per group of tensors, as lines of text."""
        c, spec, plan = self.config, self.spec, self.plan
        fixed = ", ".join(f"{k}={v}" for k, v in spec.fixed.items())
        lines = [
            "dialect: mergekit (merge_method) - mergekit 0.1.5's semantics and defaults",
            f"method: {spec.name} -> mergelab {spec.target}" + (f" ({fixed})" if fixed else ""),
        ]
        if c.base_model:
            lines.append(f"base_model: {c.base_model} = {self.paths[c.base_model]}")
        for ref in c.referenced_models():
            if ref != c.base_model:
                lines.append(f"model: {ref} = {self.paths[ref]}")
        rounded = f" (result rounded to {_name(plan.round_to)})" if plan.round_to else ""
        lines.append(
            f"dtype: inputs {_name(plan.input_dtype) or 'as stored'}, compute "
            f"{_name(plan.compute_dtype)}{rounded}, output "
            + ", ".join(sorted({_name(t.dtype) for t in plan.tensors}))
        )
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"tensors: {len(plan.tensors)} in {len(self.groups)} groups")
        for g in self.groups:
            lines.append(_group_label(g.names))
            lines.append(f"  inputs: {', '.join(g.inputs)}; t = {g.t:g}")
            mk = [f"{k}={_show(v)}" for k, v in g.mergekit_shared.items()]
            mk += [
                f"{k}=[{', '.join(f'{m}: {_show(x)}' for m, x in per.items())}]"
                for k, per in g.mergekit_per_model.items()
            ]
            lines.append(f"  mergekit: {' '.join(mk) or '(no parameters)'}")
            ours = [f"{k}={_show(v)}" for k, v in {**g.params, **g.per_model}.items()]
            lines.append(f"  computed: {spec.target} {' '.join(ours) or '(no parameters)'}")
        return lines

    def record(self) -> dict[str, Any]:
        """Entries of mergelab_merge.json (and so of the model card) for this merge."""
        base = self.config.base_model
        others = [r for r in self.config.referenced_models() if r != base]
        return {
            "base": str(self.paths[base].resolve()) if base else None,
            "models": [str(self.paths[r].resolve()) for r in others],
            "as_given": {"base": base, "models": others},
            "dialect": "mergekit",
            "mergekit_method": self.spec.name,
            "fixed_params": {k: str(v) for k, v in self.spec.fixed.items()},
            "hub_models": self.hub,
            "input_dtype": _name(self.plan.input_dtype),
            "tensor_groups": [
                {
                    "tensors": _group_label(g.names),
                    "inputs": g.inputs,
                    "t": g.t,
                    "params": g.params,
                    "per_model": g.per_model,
                }
                for g in self.groups
            ],
        }


def _name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _group_label(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    m = LAYER_NAME.match(names[0])
    if m and all(n.startswith(m.group(0)) for n in names):
        rests = [n[m.end() :] for n in names]
        return f"{m.group(0)}{{{', '.join(rests)}}}"
    return f"{names[0]} ... {names[-1]} ({len(names)} tensors)"


@dataclass
class _Input:
    """One input of one output tensor: a model (as written), the tensor's name in it and the
    settings that apply to it, highest precedence first (its own, its slice's, the config's)."""

    ref: str
    name: str
    settings: list[dict[str, Any] | None]


@dataclass
class _OutSlice:
    """An output slice, normalised: its sources, their first layers, its layer count, base and
    settings (its own, then the config's)."""

    sources: list[MkSource]
    starts: list[int]
    n_layers: int
    base_model: str | None
    settings: list[dict[str, Any] | None]

    def inputs(self, name_in: Callable[[MkSource, int], str]) -> list[_Input]:
        return [
            _Input(src.model, name_in(src, start), [src.params, *self.settings])
            for src, start in zip(self.sources, self.starts)
        ]


def plan_mergekit_merge(
    config: MergekitConfig,
    locate: Callable[[str], Path],
    hub: list[str] | None = None,
) -> MergekitPlan:
    """Open every model, resolve every tensor's inputs and parameters, build the engine's plan.

    ``locate(ref)`` turns a model reference as written into a folder (see
    :func:`mergelab.merge.config.locate_model`); ``hub`` lists the references found in the
    Hugging Face cache (for the model card). Reads headers, configs and tokenizers only.
    """
    spec, method = mergekit_method(config.merge_method)
    refs = config.referenced_models()
    paths = {ref: locate(ref) for ref in refs}
    folders: dict[str, CheckpointFolder] = {}
    try:
        for ref in refs:
            label = "base_model" if ref == config.base_model else f"model {ref}"
            folders[ref] = CheckpointFolder(paths[ref], label)
        return _plan(config, spec, method, paths, folders, locate, hub if hub is not None else [])
    except BaseException:
        for folder in folders.values():
            folder.close()
        raise


def _plan(
    config: MergekitConfig,
    spec: MkMethod,
    method: MergeMethod,
    paths: dict[str, Path],
    folders: dict[str, CheckpointFolder],
    locate: Callable[[str], Path],
    hub: list[str],
) -> MergekitPlan:
    donor_ref = config.base_model or next(iter(folders))
    donor = folders[donor_ref]
    layouts = {ref: layer_layout(f) for ref, f in folders.items()}
    check_same_architecture(
        [_structure(f.config) for f in folders.values()],
        [f"{f.label} ({f.path})" for f in folders.values()],
        vocab_padding="truncate",  # vocabularies are aligned by the tokenizer rules, or refused
    )
    slices = _output_slices(config, layouts)
    _check_contract(spec, config, slices)
    tokenizer_plan, tokens = _tokenizer(config, paths, locate)
    input_dtype = _torch_dtype(config.dtype)
    out_dtype = _torch_dtype(config.out_dtype)

    # Output tensors in mergekit's order: before the layers, the layers, after the layers.
    items: list[tuple[str, list[_Input], float, _OutSlice]] = []
    same_name = lambda name: lambda src, start: name  # noqa: E731
    layout = layouts[donor_ref]
    for name in layout.pre:
        items.append((name, slices[0].inputs(same_name(name)), 0.0, slices[0]))
    out_index = 0
    for s in slices:
        for idx in range(s.n_layers):
            t = idx / (s.n_layers - 1) if s.n_layers > 1 else 1.0
            for rest in layout.layer_rests:

                def name_in(src: MkSource, start: int, rest: str = rest, idx: int = idx) -> str:
                    return layouts[src.model].layer_name(start + idx, rest)

                items.append((layout.layer_name(out_index, rest), s.inputs(name_in), t, s))
            out_index += 1
    post = list(layout.post)
    for head, _ in TIED_PAIRS:  # a head only tied models omit is written if any input stores it
        if head not in post and any(head in folders[x.model].tensors for x in slices[-1].sources):
            post.append(head)
    for name in post:
        items.append((name, slices[-1].inputs(same_name(name)), 0.0, slices[-1]))

    stored: set[torch.dtype] = set()
    outputs: list[tuple[OutputTensor, TensorRecipe]] = []
    groups: list[ParameterGroup] = []
    translated: dict[str, tuple[dict, dict]] = {}
    for out_name, inputs, t, out_slice in items:
        slice_base = out_slice.base_model or config.base_model
        base_ref = slice_base if spec.base != "ignored" else None
        base_in = next((i for i in inputs if i.ref == base_ref), None)
        experts_in = [i for i in inputs if i is not base_in]
        shared, per_input = _resolve(spec, out_name, inputs, base_ref, t, out_slice.settings)
        lists = {
            p.name: [per_input[i.ref][p.name] for i in experts_in]
            for p in spec.params
            if p.scope != "shared" and p.name not in spec.no_effect
        }
        key = repr((shared, lists))
        if key not in translated:
            translated[key] = _translate(spec, method, shared, lists, len(experts_in), out_name)
        params, per_model = translated[key]
        for i in inputs:
            if _missing(folders[i.ref], i.name):
                raise _fail(
                    f"model {i.ref} has no tensor {i.name!r} (needed for output {out_name!r}; "
                    f"it has {layouts[i.ref].n_layers} layers)"
                )
        infos = [folders[i.ref].info(i.name) for i in inputs]
        vocab = is_vocab_tensor(out_name)
        align = None
        shape = infos[0].shape
        if vocab and tokenizer_plan is not None:
            order = [i.ref for i in ([base_in] if base_in is not None else []) + experts_in]
            align = _aligner(order, tokenizer_plan, slice_base, tokens)
            shape = (tokenizer_plan.vocab_size, *shape[1:])
        elif any(x.shape != shape for x in infos):
            listing = ", ".join(f"{i.ref} {x.shape}" for i, x in zip(inputs, infos))
            hint = (
                "; models with different vocabularies need tokenizer_source (or a tokenizer: "
                "block), as in mergekit"
                if vocab
                else ""
            )
            raise _fail(f"tensor {out_name!r}: shapes differ ({listing}){hint}")
        floating = infos[0].dtype.is_floating_point
        if input_dtype is None and floating:
            stored.update(x.dtype for x in infos)
        out_dt = (out_dtype or input_dtype or infos[0].dtype) if floating else infos[0].dtype
        recipe = TensorRecipe(
            base=TensorSource(folders[base_in.ref], base_in.name) if base_in else None,
            experts=[TensorSource(folders[i.ref], i.name) for i in experts_in],
            params=params,
            per_model=per_model,
            align=align,
        )
        outputs.append((OutputTensor(out_name, tuple(shape), out_dt), recipe))
        labels = [f"base={base_in.ref}{_layer_note(base_in, out_name)}"] if base_in else []
        labels += [i.ref + _layer_note(i, out_name) for i in experts_in]
        group = ParameterGroup(
            [out_name],
            labels,
            t,
            {k: v for k, v in shared.items() if k not in spec.no_effect},
            {k: dict(zip([i.ref for i in experts_in], v)) for k, v in lists.items()},
            _display(params),
            per_model,
        )
        if groups and groups[-1].key() == group.key():
            groups[-1].names.append(out_name)
        else:
            groups.append(group)

    if tokenizer_plan is None:  # equal shapes, rows merged by id: every id must mean one token
        from mergelab.vocabulary import MERGEKIT_DIALECT_REMEDY, check_merge_tokenizers

        refs = config.referenced_models()
        check_merge_tokenizers([paths[r] for r in refs], refs, MERGEKIT_DIALECT_REMEDY)
    if input_dtype is None and len(stored) > 1:
        raise _fail(
            f"the models store tensors in several dtypes ({sorted(map(str, stored))}); set "
            "dtype to say which to compute in"
        )
    read_dtype = input_dtype or (stored.pop() if stored else torch.float32)
    if spec.float32_inside:
        compute = torch.float64 if read_dtype == torch.float64 else torch.float32
        round_to = read_dtype if compute != read_dtype else None
    else:
        compute, round_to = read_dtype, None
    plan = plan_recipe_merge(
        method,
        donor,
        outputs,
        compute_dtype=compute,
        input_dtype=input_dtype,
        round_to=round_to,
        seed=to_number(config.seed, "merge config: seed", integer=True),
    )
    updates: dict[str, Any] = {}
    if config.slices is not None and layout.count_key:
        updates[layout.count_key] = out_index
    if tokenizer_plan is not None:
        updates["vocab_size"] = tokenizer_plan.vocab_size
    plan.config_updates = updates
    plan.config_text = config.text
    plan.finish, plan.copied_files = _finisher(config, tokenizer_plan, paths, donor_ref)
    notes = []
    settings = [config.params, *(x.params for x in slices[0].sources)]
    settings += [s.settings[0] for s in slices] + [x.params for s in slices for x in s.sources]
    if "int8_mask" in spec.no_effect and any(p and "int8_mask" in p for p in settings):
        notes.append("int8_mask changes only mergekit's memory use, not the result")
    unused = sorted(
        {
            key
            for s in slices
            for x in s.sources
            if x.model == (s.base_model or config.base_model) and spec.base != "ignored"
            for key in x.params or {}
            if (p := spec.param(key)) is not None and p.scope == "non_base"
        }
    )
    if unused:
        notes.append(
            f"{', '.join(unused)} given to the base model is not used: {spec.name} applies it "
            "to the other models only (as mergekit does)"
        )
    if config.base_model and spec.base == "ignored":
        notes.append(
            f"{spec.name} has no base in mergekit: base_model {config.base_model} is one more input"
        )
    result = MergekitPlan(config, spec, method, plan, groups, paths, hub, notes)
    plan.record = result.record()
    return result


def _structure(config: dict[str, Any]) -> dict[str, Any]:
    """A config without the layer count (slices stack layers of models of any depth)."""
    return {k: v for k, v in config.items() if k not in LAYER_COUNT_KEYS}


def _missing(folder: CheckpointFolder, name: str) -> bool:
    try:
        folder.resolve_name(name)
        return False
    except KeyError:
        return True


def _layer_note(i: _Input, out_name: str) -> str:
    if i.name == out_name:
        return ""
    m = LAYER_NAME.match(i.name)
    return f" (layer {m['index']})" if m else f" ({i.name})"


def _display(params: dict[str, Any]) -> dict[str, Any]:
    return {("lambda" if k == "lambda_" else k): v for k, v in params.items()}


def _torch_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _output_slices(config: MergekitConfig, layouts: dict[str, LayerLayout]) -> list[_OutSlice]:
    """mergekit's normalisation: ``models:`` becomes one slice over every layer (the base added
    as the last source when it is not listed)."""
    if config.models is not None:
        sources = list(config.models)
        if config.base_model and all(s.model != config.base_model for s in sources):
            sources.append(MkSource(config.base_model))
        counts = {s.model: layouts[s.model].n_layers for s in sources}
        if len(set(counts.values())) > 1:
            listing = ", ".join(f"{m}: {n}" for m, n in counts.items())
            raise _fail(
                f"the models have different numbers of layers ({listing}); mergekit needs the "
                "same number in every input of a slice (use slices: to stack layer ranges)"
            )
        n = next(iter(counts.values()))
        return [_OutSlice(sources, [0] * len(sources), n, None, [None, config.params])]
    out = []
    for k, s in enumerate(config.slices or []):
        lengths = [src.layer_range[1] - src.layer_range[0] for src in s.sources]
        if len(set(lengths)) > 1:
            raise _fail(
                f"slices[{k}]: every source must contain the same number of layers, got "
                f"{lengths} (mergekit refuses this too)"
            )
        seen = set()
        for src in s.sources:
            if src.model in seen:
                raise _fail(f"slices[{k}]: model {src.model} is a source twice (mergekit refuses)")
            seen.add(src.model)
            end, have = src.layer_range[1], layouts[src.model].n_layers
            if end > have:
                raise _fail(
                    f"slices[{k}]: layer_range {list(src.layer_range)} of {src.model} goes past "
                    f"its {have} layers"
                )
        out.append(
            _OutSlice(
                list(s.sources),
                [src.layer_range[0] for src in s.sources],
                lengths[0],
                s.base_model,
                [s.params, config.params],
            )
        )
    return out


def _check_contract(spec: MkMethod, config: MergekitConfig, slices: list[_OutSlice]) -> None:
    """mergekit's input contract of the method, checked per slice before any tensor is read."""
    for k, s in enumerate(slices):
        where = f"slices[{k}]" if config.slices is not None else "models"
        models = [src.model for src in s.sources]
        base = None if spec.base == "ignored" else (s.base_model or config.base_model)
        has_base = base is not None and base in models
        if base is not None and not has_base:
            raise _fail(f"{where}: base_model {base} is not among the inputs (mergekit refuses)")
        if spec.base == "required" and not has_base:
            raise _fail(f"merge_method {spec.name} needs a base_model among the inputs ({where})")
        count, non_base = len(models), len(models) - int(has_base)
        for what, n, low, high in (
            ("inputs", count, spec.min_inputs, spec.max_inputs),
            ("non-base inputs", non_base, spec.min_non_base, spec.max_non_base),
        ):
            if (low is not None and n < low) or (high is not None and n > high):
                if low == high:
                    want = f"exactly {low}"
                elif high is None:
                    want = f"at least {low}"
                else:
                    want = f"at most {high}" if not low else f"{low} to {high}"
                raise _fail(f"merge_method {spec.name} takes {want} {what}, got {n} ({where})")


def _resolve(
    spec: MkMethod,
    out_name: str,
    inputs: list[_Input],
    base_ref: str | None,
    t: float,
    shared_settings: list[dict[str, Any] | None],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """mergekit's parameter resolution for one output tensor: shared values (seen with the
    output's name) and per-input values (seen with the input's name); a base gets no non-base
    parameters."""
    shared = {
        p.name: _resolve_one(p, shared_settings, out_name, t, f"tensor {out_name}")
        for p in spec.params
        if p.scope == "shared"
    }
    per_input: dict[str, dict[str, Any]] = {}
    for i in inputs:
        per_input[i.ref] = {
            p.name: _resolve_one(p, i.settings, i.name, t, f"model {i.ref}, tensor {i.name}")
            for p in spec.params
            if p.scope == "input" or (p.scope == "non_base" and i.ref != base_ref)
        }
    return shared, per_input


def _resolve_one(p: MkParam, settings, tensor_name: str, t: float, where: str) -> Any:
    for scope in settings:
        if scope is not None and p.name in scope:
            value = evaluate_setting(tensor_name, scope[p.name], t, lambda v: p.validate(v, where))
            if value is not None:
                return value
    if p.default is REQUIRED:
        raise _fail(f"missing required parameter {p.name} for {where}")
    return p.default


def _translate(
    spec: MkMethod,
    method: MergeMethod,
    shared: dict[str, Any],
    lists: dict[str, list[Any]],
    n_experts: int,
    out_name: str,
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """mergekit's values for one tensor -> mergelab's resolved (params, per-model lists)."""
    if spec.translate is not None:
        params, per_model = spec.translate(shared, lists)
    else:
        params = {k: v for k, v in shared.items() if k not in spec.no_effect and v is not None}
        per_model = {k: v for k, v in lists.items() if not all(x is None for x in v)}
        known = set(method.global_defaults) | set(method.per_model) | {"lambda"}
        for key in [*params, *per_model]:
            if key not in known:
                raise _fail(
                    f"parameter {key!r} of mergekit's {spec.name} has no counterpart in "
                    f"mergelab's {method.name!r} (its parameters: "
                    f"{sorted(set(method.global_defaults) | set(method.per_model))})"
                )
        for key in list(params):  # a per-model parameter given once in mergekit's spelling
            if key in method.per_model:
                per_model[key] = [params.pop(key)] * n_experts
    try:
        return method.resolve(n_experts, params, per_model)
    except ValueError as exc:
        raise _fail(f"tensor {out_name}: {exc}") from None


def _tokenizer(config: MergekitConfig, paths: dict[str, Path], locate: Callable[[str], Path]):
    """The output tokenizer (or None) and the per-token row sources of a tokenizer block."""
    from .tokenizer import TokenEmbedding, build_tokenizer

    block = config.tokenizer
    source = block["source"] if block is not None else config.tokenizer_source
    if source is None:
        return None, {}
    base = config.base_model or config.referenced_models()[0]
    kind, source_path = source, None
    if source not in ("base", "union"):
        ref = source.removeprefix("model:")  # older mergekit spelled a model source model:<path>
        kind, source_path = "model", paths.get(ref) or locate(ref)
    tokens: dict[str, TokenEmbedding] = {}
    for tok, cfg in ((block or {}).get("tokens") or {}).items():
        src, force = cfg.get("source"), bool(cfg.get("force", False))
        if src is None:
            tokens[tok] = TokenEmbedding(force=force)
        elif isinstance(src, str):
            tokens[tok] = TokenEmbedding("model", model=src, force=force)
        elif src["kind"] == "zero":
            tokens[tok] = TokenEmbedding("zero", force=force)
        else:
            tokens[tok] = TokenEmbedding(
                "model_token",
                model=src["model"],
                token=src.get("token"),
                token_id=src.get("token_id"),
                force=force,
            )
        if tokens[tok].model is not None and tokens[tok].model not in paths:
            raise _fail(f"tokenizer.tokens[{tok!r}]: model {tokens[tok].model} is not an input")
    plan = build_tokenizer(
        base,
        {ref: paths[ref] for ref in config.referenced_models()},
        kind,
        source_path=source_path,
        add_tokens=list(tokens),
        pad_to_multiple_of=(block or {}).get("pad_to_multiple_of"),
    )
    return plan, {k: v for k, v in tokens.items() if v.kind is not None or v.force}


def _aligner(order: list[str], tokenizer_plan, base: str | None, tokens):
    from .tokenizer import align_vocabulary

    def align(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        aligned = align_vocabulary(
            dict(zip(order, tensors)), tokenizer_plan, base=base, tokens=tokens
        )
        return [aligned[ref] for ref in order]

    return align


def _finisher(config: MergekitConfig, tokenizer_plan, paths: dict[str, Path], donor_ref: str):
    """What the output gets besides tensors and config: a rebuilt tokenizer (a tokenizer source,
    or a chat template set on the donor's tokenizer), else the donor's tokenizer files."""
    from .tokenizer import chat_template_refusal, load_tokenizer, set_chat_template

    if tokenizer_plan is None and not config.chat_template:
        return None, COPIED_FILES
    text = config.chat_template
    if text and text != "auto" and (len(text) < 20 or "{" not in text):
        raise _fail(chat_template_refusal(text))
    models = [paths[r] for r in config.referenced_models()]

    def finish(folder: Path) -> None:
        tokenizer = tokenizer_plan.tokenizer if tokenizer_plan else load_tokenizer(paths[donor_ref])
        set_chat_template(tokenizer, config.chat_template, models)
        tokenizer.save_pretrained(str(folder))

    return finish, tuple(f for f in COPIED_FILES if f not in TOKENIZER_FILES)


__all__ = [
    "METHODS",
    "MergekitConfig",
    "MergekitConfigError",
    "MergekitPlan",
    "evaluate_setting",
    "mergekit_config_from_dict",
    "plan_mergekit_merge",
]
