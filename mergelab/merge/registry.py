"""One registry of merge methods: a method is one decorated function over one parameter tensor.

    @merge_method("my_average", per_model=("weight",))
    def my_average(base, experts, *, weight, ctx):
        return sum(w * t for w, t in zip(weight, experts)) / sum(weight)

The function receives

* ``base`` — the base model's tensor (``None`` when the method declares ``needs_base=False`` and
  no base was given), already cast to the compute dtype;
* ``experts`` — a list of the expert tensors, same shape and dtype;
* one keyword per per-model parameter (named in ``per_model``), as a list with one float per
  expert;
* its global parameters as keyword-only arguments; their defaults are read from the signature;
* ``ctx`` — a :class:`TensorContext` (tensor name, a per-tensor seeded generator, statistics
  computed in a first pass for methods that need whole-model statistics).

and returns the merged tensor. Where the tensors come from (state dicts in memory, streamed
safetensors shards, LoRA products) and which dtype the output is stored in are decided by the
engines in :mod:`mergelab.merge.state_dict`, :mod:`mergelab.merge.checkpoint` and
:mod:`mergelab.merge.lora`, never by the method. The input tensors may be the caller's own
parameters: a method must not modify them in place (it may modify what it allocates).

Parameters are checked when they are resolved, before any tensor is touched: a global parameter
annotated ``Literal["a", "b"]`` against those choices, a number parameter for being a finite
number (a numeric string such as ``"0.5"`` from a config file is read as that number), every
number against its :class:`Interval` in ``ranges``, and all of them together by an optional
``check(params)`` hook for rules that involve several parameters.

Whole-model statistics (e.g. TIES' global top-k threshold) come from an optional first pass:
``prepare(params, make_iter) -> dict`` where ``params`` holds the resolved global parameters and
the per-model lists (exactly the keywords the method function receives) and ``make_iter()``
returns a FRESH iterable of ``(name, base, experts)`` (compute dtype, as the method would get
them) on every call, so a prepare hook may take several passes without the engine ever holding
the model. The result reaches the method as ``ctx.stats``.

Faster equivalents come from elsewhere: :func:`register_fast_path` (the accelerator,
:mod:`mergelab.merge.accelerator`, registers its compiled loops there) gives a method a function
that returns the same bits, or ``None`` where it does not apply; the method itself never knows.

For engine writers, per model: ``globals_, lists = method.resolve(n, params, per_model_params)``
and ``params = {**globals_, **lists}``; ``stats = method.compute_stats(params, make_iter)``
(``{}`` if not needed); then per tensor
``method.apply(base, experts, TensorContext(name, seed, stats), params)``, which runs the fast
path where one is registered and applies, else the method, and checks the result (shape, dtype,
NaN/Inf) the same way for every engine. An engine that streams tensors in their stored dtype
(``fast_path(name).stored_dtype``) sets ``ctx.dtype`` and ``ctx.out``; see
:class:`TensorContext`.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import numbers
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .validation import MergeInputError

TensorTriples = Iterable[tuple[str, torch.Tensor, list[torch.Tensor]]]
# A first-pass hook: (resolved params, make_iter) -> statistics dict; make_iter() is a fresh pass.
PrepareFn = Callable[[dict[str, Any], Callable[[], TensorTriples]], dict]


class UnknownMergeMethodError(KeyError, ValueError):
    """A merge method name that is not registered."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


@dataclass(frozen=True)
class Interval:
    """Allowed values of a number parameter, e.g. ``Interval(0, 1, low_open=True)`` is (0, 1]."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"{left}{self.low:g}, {self.high:g}{right}"


def to_number(value: Any, name: str, *, integer: bool = False) -> float | int:
    """``value`` as a finite float (an int when ``integer``); a numeric string (``"0.5"``, as a
    YAML or TOML file may give it) is read as that number. ``name`` is named in every error."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool):  # bool is an int in Python, but `weight: true` is a mistake
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if integer and isinstance(value, numbers.Integral):
        return int(value)
    try:  # numbers, numeric strings, numpy scalars, one-element tensors
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {kind}, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if integer:
        if number != int(number):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(number)
    return number


def _shown(key: str) -> str:
    """The name a user writes: ``lambda`` for the Python keyword-safe ``lambda_``."""
    return "lambda" if key == "lambda_" else key


def result_finite(merged: torch.Tensor, ctx: TensorContext) -> bool:
    """No NaN/Inf in a method's result: what a fast path saw of it (``ctx.checks``), else a
    check (a sum is finite whenever the entries are, unless it overflows: only then the exact,
    element-wise check)."""
    if ctx.checks is not None and ctx.checks.covers_result(merged):
        return ctx.checks.result_finite
    return bool(torch.isfinite(merged.sum())) or bool(torch.isfinite(merged).all())


@dataclass
class TensorContext:
    """What a method may know about the tensor it merges, besides the values."""

    name: str = ""
    seed: int = 0
    # Whole-model statistics from the method's ``prepare`` pass (e.g. global top-k thresholds).
    stats: dict[str, Any] = field(default_factory=dict)
    # Set by an engine that hands a fast path (``FastPath.stored_dtype``) the inputs in their
    # stored dtype: ``dtype`` is the compute dtype, and ``out``, if set, the buffer (the inputs'
    # shape, its own dtype) the result is written into. Methods never see them: where the fast
    # path declines, :meth:`MergeMethod.apply` casts the inputs and copies the result.
    dtype: torch.dtype | None = None
    out: torch.Tensor | None = None
    # Set by a fast path that read every input entry and wrote every result entry: whether it met
    # NaN/Inf (``inputs_finite``, ``result_finite``, ``covers_inputs(tensors)``,
    # ``covers_result(tensor)``), so the engines skip their own passes over the same memory.
    checks: Any = None

    @property
    def tensor_seed(self) -> int:
        """A 63-bit seed from (seed, tensor name): reproducible and different per tensor."""
        digest = hashlib.sha256(f"{self.seed}:{self.name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A torch generator seeded with :attr:`tensor_seed` (DELLA's and Arcee Fusion's draws;
        DARE's masks use the same seed with :func:`mergelab.merge.methods.steps.dare_keep_block`)."""
        g = torch.Generator(device=device)
        g.manual_seed(self.tensor_seed)
        return g


@dataclass(frozen=True)
class MergeMethod:
    name: str
    fn: Callable[..., torch.Tensor]
    per_model: tuple[str, ...]
    per_model_defaults: dict[str, float]
    global_defaults: dict[str, Any]
    needs_base: bool
    doc: str
    # Optional whole-model first pass, run only when ``needs_prepare(params)`` is true.
    prepare: PrepareFn | None = None
    needs_prepare: Callable[[dict[str, Any]], bool] | None = None
    # Allowed values of global parameters annotated ``Literal[...]``.
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # Allowed values of number parameters (global or per-model), e.g. {"density": (0, 1]}.
    ranges: dict[str, Interval] = field(default_factory=dict)
    # Rules over several parameters: check(resolved params and per-model lists) raises ValueError.
    check: Callable[[dict[str, Any]], None] | None = None
    # How many models besides the base the method takes: (at least, at most or None for any).
    n_experts: tuple[int, int | None] = (1, None)

    def resolve(
        self,
        n_experts: int,
        params: dict[str, Any] | None = None,
        per_model_params: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], dict[str, list[float]]]:
        """Fill defaults and validate names and values; returns (global params, per-model lists).

        A per-model parameter may be given once in ``params`` (a number, or a numeric string, is
        broadcast to every expert, e.g. ``density=0.2``) or as one value per expert; the config
        spelling ``lambda`` is accepted for ``lambda_``. Errors name the parameter (and the model,
        counted from 0, for a per-model value).
        """
        self._check_count(n_experts)
        params = dict(params or {})
        per_model_params = dict(per_model_params or {})
        for key in list(params):
            if key in self.per_model:
                per_model_params.setdefault(key, params.pop(key))
        if "lambda" in params:  # config files may say lambda; Python can't
            if "lambda_" in params:
                raise ValueError(f"merge method {self.name!r}: give lambda or lambda_, not both")
            params["lambda_"] = params.pop("lambda")
        unknown = set(params) - set(self.global_defaults)
        if unknown:
            raise ValueError(
                f"merge method {self.name!r} has no parameter(s) {sorted(unknown)}; "
                f"global parameters: {sorted(self.global_defaults)}, per-model: {list(self.per_model)}"
            )
        unknown = set(per_model_params) - set(self.per_model)
        if unknown:
            raise ValueError(
                f"merge method {self.name!r} has no per-model parameter(s) {sorted(unknown)}; "
                f"per-model parameters: {list(self.per_model)}"
            )
        resolved = dict(self.global_defaults)
        for key, value in params.items():
            resolved[key] = self._global_value(key, value)
        for key, allowed in self.choices.items():
            if resolved[key] not in allowed:
                raise ValueError(
                    f"merge method {self.name!r}: {_shown(key)}={resolved[key]!r} is not one of "
                    f"{', '.join(repr(a) for a in allowed)}"
                )
        lists: dict[str, list[float]] = {}
        for key in self.per_model:
            value = per_model_params.get(key, self.per_model_defaults.get(key))
            if value is None:
                raise ValueError(f"merge method {self.name!r} needs per-model parameter {key!r}")
            lists[key] = self._per_model_values(key, value, n_experts)
        if self.check is not None:
            self.check({**resolved, **lists})
        return resolved, lists

    def _check_count(self, n_experts: int) -> None:
        low, high = self.n_experts
        if low <= n_experts and (high is None or n_experts <= high):
            return
        count = f"exactly {low}" if low == high else f"{low} to {high}" if high else f"{low}+"
        models = "model" if low == high == 1 else "models"
        besides = "the base" if self.needs_base else "any base"
        raise ValueError(
            f"merge method {self.name!r} takes {count} {models} besides {besides}, got {n_experts}"
        )

    def _global_value(self, key: str, value: Any) -> Any:
        """A global parameter must have its default's kind: bool, number or string (None:
        anything); a number may be given as a numeric string."""
        default = self.global_defaults[key]
        name = f"merge method {self.name!r}: {_shown(key)}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} should be true or false like its default")
            return value
        if isinstance(default, (int, float)):
            number = to_number(value, name, integer=isinstance(default, int))
            self._check_range(key, number, name)
            return number
        if isinstance(default, str) and not isinstance(value, str):
            raise ValueError(f"{name}={value!r} should be a string like its default {default!r}")
        return value

    def _per_model_values(self, key: str, value: Any, n_experts: int) -> list[float]:
        """One finite number per expert, from one value (broadcast) or a list of them."""
        name = f"merge method {self.name!r}: {key}"
        scalar = isinstance(value, (str, bytes, numbers.Number)) or getattr(value, "ndim", 1) == 0
        if isinstance(value, Mapping):
            raise ValueError(f"{name} must be a number or a list of numbers, got {value!r}")
        if scalar:
            number = to_number(value, name)
            self._check_range(key, number, name)
            return [number] * n_experts
        try:
            values = list(value)
        except TypeError:
            raise ValueError(
                f"{name} must be a number or a list of numbers, got {value!r}"
            ) from None
        if len(values) != n_experts:
            raise ValueError(f"{name} has {len(values)} values for {n_experts} experts")
        out = []
        for i, v in enumerate(values):
            label = f"{name} of model {i}"
            number = to_number(v, label)
            self._check_range(key, number, label)
            out.append(number)
        return out

    def _check_range(self, key: str, number: float, name: str) -> None:
        interval = self.ranges.get(key)
        if interval is not None and number not in interval:
            raise ValueError(f"{name} must lie in {interval}, got {number:g}")

    def has_first_pass(self, params: dict[str, Any]) -> bool:
        """Whether merging with ``params`` (resolved globals and per-model lists in one dict)
        starts with a whole-model statistics pass (``prepare``)."""
        return self.prepare is not None and (
            self.needs_prepare is None or self.needs_prepare(params)
        )

    def compute_stats(
        self,
        params: dict[str, Any],
        make_iter: Callable[[], TensorTriples],
        *,
        stored_iter: Callable[..., TensorTriples] | None = None,
        dtype: torch.dtype | None = None,
    ) -> dict[str, Any]:
        """Run the whole-model first pass if this method needs one for ``params``; else ``{}``.

        ``params``: resolved global parameters and per-model lists merged into one dict.
        ``make_iter()`` yields the tensors in the compute dtype. An engine that can also stream
        them in their stored dtype passes ``stored_iter`` (and the compute ``dtype``): a fast
        path's ``prepare`` then gets those (the same statistics, sooner).
        """
        if not self.has_first_pass(params):
            return {}
        fast = fast_path(self.name)
        if fast is not None and fast.prepare is not None:
            if stored_iter is not None:
                return fast.prepare(params, stored_iter, dtype)
            return fast.prepare(params, make_iter, None)
        return self.prepare(params, make_iter)

    def apply(
        self,
        base: torch.Tensor | None,
        experts: list[torch.Tensor],
        ctx: TensorContext,
        params: Mapping[str, Any],
        *,
        check_finite: bool = True,
    ) -> torch.Tensor:
        """Merge one tensor — what every engine calls. ``params``: resolved global parameters and
        per-model lists in one dict (from :meth:`resolve`); ``ctx.stats`` from
        :meth:`compute_stats`. Runs the method's fast path where one is registered and applies
        to these tensors, else the method. The result is checked by :meth:`check_result`; an
        engine that checks finiteness itself while copying the result (the streaming one) passes
        ``check_finite=False`` and raises :meth:`nonfinite_error`."""
        fast = fast_path(self.name)
        merged = fast.merge(base, experts, ctx, params) if fast is not None else None
        if merged is None:
            merged = self._reference(base, experts, ctx, params)
        self.check_result(merged, experts[0], ctx, check_finite=check_finite)
        return merged

    def _reference(
        self,
        base: torch.Tensor | None,
        experts: list[torch.Tensor],
        ctx: TensorContext,
        params: Mapping[str, Any],
    ) -> torch.Tensor:
        """The method itself, on whole tensors in the compute dtype: inputs an engine streamed in
        their stored dtype for a fast path (``ctx.dtype``) are cast first, and the result is
        copied into ``ctx.out`` when that is set."""
        if ctx.dtype is not None:
            base = base.to(ctx.dtype) if base is not None else None
            experts = [e.to(ctx.dtype) for e in experts]
        merged = self.fn(base, experts, ctx=ctx, **params)
        if ctx.out is None or not isinstance(merged, torch.Tensor):
            return merged
        if merged.shape != ctx.out.shape:
            return merged  # check_result names the wrong shape
        return ctx.out.copy_(merged)

    def check_result(
        self,
        merged: Any,
        like: torch.Tensor,
        ctx: TensorContext,
        *,
        check_finite: bool = True,
    ) -> None:
        """The one set of checks on a method's result: a tensor of the inputs' shape, in the
        compute dtype (``ctx.out``'s, when the method was given an output buffer, which it must
        have written into), and (``check_finite``) without NaN or Inf."""
        where = f"merge method {self.name!r} returned"
        if not isinstance(merged, torch.Tensor):
            raise TypeError(f"{where} {type(merged).__name__} for tensor {ctx.name!r}")
        if merged.shape != like.shape:
            raise TypeError(
                f"{where} {tuple(merged.shape)} for tensor {ctx.name!r}, "
                f"expected shape {tuple(like.shape)}"
            )
        if ctx.out is not None and merged.data_ptr() != ctx.out.data_ptr():
            raise TypeError(f"merge method {self.name!r} did not write into ctx.out")
        dtype = ctx.out.dtype if ctx.out is not None else (ctx.dtype or like.dtype)
        if merged.dtype != dtype:
            raise TypeError(f"{where} {merged.dtype} for tensor {ctx.name!r}, expected {dtype}")
        if check_finite and not result_finite(merged, ctx):
            raise self.nonfinite_error(ctx.name)

    def nonfinite_error(self, tensor_name: str) -> MergeInputError:
        return MergeInputError(
            f"merge method {self.name!r} produced NaN or Inf in tensor {tensor_name!r}"
        )

    def __call__(
        self,
        base: torch.Tensor | None,
        experts: list[torch.Tensor],
        *,
        ctx: TensorContext | None = None,
        **params: Any,
    ) -> torch.Tensor:
        """Merge one tensor with user-level parameters, e.g. ``ties(b, [e1, e2], density=0.2)``.

        Parameters are resolved as in :meth:`resolve`. Without ``ctx.stats`` a method that needs
        whole-model statistics computes them from this one tensor (it is the whole "model").
        """
        ctx = ctx or TensorContext()
        globals_, lists = self.resolve(len(experts), params)
        resolved = {**globals_, **lists}
        if not ctx.stats:
            ctx.stats = self.compute_stats(resolved, lambda: [(ctx.name, base, list(experts))])
        return self.apply(base, experts, ctx, resolved)


_REGISTRY: dict[str, MergeMethod] = {}
_ORIGINS: dict[str, str] = {}  # name -> where it was registered from (mergelab.plugins.origin_of)


def _literal_choices(fn: Callable[..., Any], names: list[str]) -> dict[str, tuple[Any, ...]]:
    """Choices of the parameters annotated ``Literal[...]`` (directly or via an alias)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations (e.g. local names): skip the check
        return {}
    return {
        name: typing.get_args(hints[name])
        for name in names
        if name in hints and typing.get_origin(hints[name]) is Literal
    }


def merge_method(
    name: str | None = None,
    *,
    per_model: tuple[str, ...] = ("weight",),
    per_model_defaults: dict[str, float] | None = None,
    ranges: dict[str, Interval | tuple[float, float]] | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
    needs_base: bool = True,
    prepare: PrepareFn | None = None,
    needs_prepare: Callable[[dict[str, Any]], bool] | None = None,
    n_experts: tuple[int, int | None] = (1, None),
    replace: bool = False,
) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Register ``fn`` as a merge method. See the module docstring for the function's contract.

    ``per_model_defaults`` gives defaults for per-model parameters (``weight`` defaults to 1.0);
    ``ranges`` the allowed values of number parameters, global or per-model (an
    :class:`Interval`, or ``(low, high)`` for a closed one); ``check(params)`` a rule over several
    resolved parameters that raises ``ValueError``; ``prepare``/``needs_prepare`` a whole-model
    first pass (module docstring); ``n_experts`` how many models besides the base it takes
    (at least, at most or None), checked with the parameters. The decorated function is returned
    unchanged.
    """
    defaults = {"weight": 1.0, **(per_model_defaults or {})}

    def decorate(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        method_name = name or fn.__name__
        from mergelab.plugins import origin_of

        origin = origin_of(fn.__module__)
        if method_name in _REGISTRY and not replace:
            raise ValueError(
                f"merge method {method_name!r} ({origin}) is already registered "
                f"({_ORIGINS.get(method_name, 'unknown')})"
            )
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        if len(params) < 2 or "ctx" not in sig.parameters:
            raise TypeError(f"{fn.__name__}: a merge method takes (base, experts, *, ..., ctx)")
        global_defaults = {}
        for p in params[2:]:
            if p.name == "ctx" or p.name in per_model:
                continue
            if p.kind is not inspect.Parameter.KEYWORD_ONLY:
                raise TypeError(f"{fn.__name__}: parameter {p.name!r} must be keyword-only")
            if p.default is inspect.Parameter.empty:
                raise TypeError(f"{fn.__name__}: global parameter {p.name!r} needs a default")
            global_defaults[p.name] = p.default
        for key in per_model:
            if key not in sig.parameters:
                raise TypeError(
                    f"{fn.__name__}: per-model parameter {key!r} is not in the signature"
                )
        for key in ranges or {}:
            if key not in per_model and key not in global_defaults:
                raise TypeError(f"{fn.__name__}: range given for unknown parameter {key!r}")
        _REGISTRY[method_name] = MergeMethod(
            name=method_name,
            fn=fn,
            per_model=tuple(per_model),
            per_model_defaults={k: v for k, v in defaults.items() if k in per_model},
            global_defaults=global_defaults,
            needs_base=needs_base,
            doc=inspect.getdoc(fn) or "",
            prepare=prepare,
            needs_prepare=needs_prepare,
            choices=_literal_choices(fn, list(global_defaults)),
            ranges={
                key: r if isinstance(r, Interval) else Interval(*r)
                for key, r in (ranges or {}).items()
            },
            check=check,
            n_experts=n_experts,
        )
        _ORIGINS[method_name] = origin
        return fn

    return decorate


def get_merge_method(name: str) -> MergeMethod:
    from mergelab.plugins import describe_registered, load_entry_points

    load_entry_points()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownMergeMethodError(
            f"unknown merge method {name!r}; registered: "
            f"{describe_registered(merge_method_origins())}"
        ) from None


def list_merge_methods(*, entry_points: bool = True) -> list[str]:
    """Registered method names, sorted; ``entry_points=False``: without importing installed
    plugins first (for help texts, which must not fail or wait on other packages)."""
    if entry_points:
        from mergelab.plugins import load_entry_points

        load_entry_points()
    return sorted(_REGISTRY)


def merge_method_origins() -> dict[str, str]:
    """Every registered method's name → where it came from (``builtin``, ``file …``, ``module
    …``, ``entry point …``; see :mod:`mergelab.plugins`)."""
    return {name: _ORIGINS.get(name, "unknown") for name in list_merge_methods()}


def unregister_merge_method(name: str) -> None:
    _REGISTRY.pop(name, None)
    _ORIGINS.pop(name, None)
    _FAST_PATHS.pop(name, None)


# --- fast paths -----------------------------------------------------------------------------------

# (base, experts, ctx, resolved params) -> the merged tensor, or None where the fast path does
# not apply to these tensors (the method then runs).
FastMergeFn = Callable[
    [torch.Tensor | None, list[torch.Tensor], TensorContext, dict[str, Any]], torch.Tensor | None
]


@dataclass(frozen=True)
class FastPath:
    """A faster equivalent of one registered method: the same bits, proven by tests.

    ``merge`` replaces the method per tensor (``None``: not for these tensors). With
    ``stored_dtype`` it takes the inputs in their stored dtype, ``ctx.dtype`` the compute dtype,
    and writes into ``ctx.out`` when set. ``prepare(params, make_iter, dtype)`` replaces the
    method's whole-model ``prepare`` (``make_iter`` yields stored-dtype tensors when ``dtype`` is
    given). ``ahead(base, experts, ctx, params)`` returns per-tensor entries for ``ctx.stats`` an
    engine may compute before the merge, e.g. while the previous tensor merges (``merge`` must
    give the same result without them). ``active()`` says whether it runs at all (the
    accelerator's one switch).
    """

    merge: FastMergeFn
    stored_dtype: bool = False
    prepare: Callable[..., dict] | None = None
    ahead: Callable[..., dict] | None = None
    active: Callable[[], bool] = lambda: True


_FAST_PATHS: dict[str, FastPath] = {}


def register_fast_path(
    method: str,
    merge: FastMergeFn,
    *,
    stored_dtype: bool = False,
    prepare: Callable[..., dict] | None = None,
    ahead: Callable[..., dict] | None = None,
    active: Callable[[], bool] = lambda: True,
) -> None:
    """Use ``merge`` (and the other parts of a :class:`FastPath`) for the registered method
    ``method`` wherever ``active()``."""
    get_merge_method(method)  # an unknown name is an error here, not a silent no-op
    _FAST_PATHS[method] = FastPath(merge, stored_dtype, prepare, ahead, active)


def fast_path(method: str) -> FastPath | None:
    """The active fast path of ``method``, or ``None``."""
    fast = _FAST_PATHS.get(method)
    return fast if fast is not None and fast.active() else None
