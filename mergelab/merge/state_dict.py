"""Merging in memory: state dicts and ``torch.nn.Module``s (what the studies use on tiny models)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .registry import MergeMethod, TensorContext, get_merge_method
from .validation import (
    MergeInputError,
    VocabPadding,
    check_same_architecture,
    check_tensors_compatible,
)


def merge_state_dicts(
    method: str | MergeMethod,
    base: Mapping[str, torch.Tensor] | None,
    experts: list[Mapping[str, torch.Tensor]],
    *,
    params: dict[str, Any] | None = None,
    per_model_params: dict[str, Any] | None = None,
    weights: list[float] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    vocab_padding: VocabPadding = "error",
) -> dict[str, torch.Tensor]:
    """Merge ``experts`` (and ``base``) tensor by tensor with a registered method.

    ``weights`` is shorthand for ``per_model_params={"weight": weights}``. Every tensor is merged
    in ``dtype`` (float32 by default) and stored back in the base's (or first expert's) dtype.
    Non-floating tensors (e.g. integer buffers) are copied from the base unchanged. Methods that
    need whole-model statistics (TIES with ``trim_scope="model"``) get them from a first pass over
    the same tensors. ``vocab_padding``: see :mod:`mergelab.merge.validation`. ``seed`` seeds the
    per-tensor generators of random methods (DARE). The inputs are never modified.

    The inputs are checked as ``mergelab merge`` checks checkpoints (same rules, from
    :mod:`mergelab.merge.validation`): the same tensor names, one dtype per tensor across all
    models (convert first: ``model.to(torch.bfloat16)``), equal shapes, no NaN/Inf.
    """
    m = get_merge_method(method) if isinstance(method, str) else method
    if not experts:
        raise ValueError("merge needs at least one expert")
    if m.needs_base and base is None:
        raise ValueError(f"merge method {m.name!r} needs a base model")
    per_model_params = dict(per_model_params or {})
    if weights is not None:
        per_model_params["weight"] = list(weights)
    resolved, lists = m.resolve(len(experts), params, per_model_params)
    reference = base if base is not None else experts[0]
    rows = check_tensors_compatible(
        reference,
        experts,
        base_label="base" if base is not None else "expert 0",
        vocab_padding=vocab_padding,
    )
    # Tied tensors (e.g. input embedding = output head) are one parameter: merge it once, so a
    # random method cannot give the two names different values and global statistics count it once.
    first_name: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    alias_of: dict[str, str] = {}
    for name, t in reference.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in first_name:
            alias_of[name] = first_name[key]
        else:
            first_name[key] = name
    floating = [k for k, v in reference.items() if v.is_floating_point() and k not in alias_of]

    def load(name: str) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The tensor in every model, sliced to the shared vocabulary rows, in the compute dtype."""
        r = rows.get(name)
        tensors = [sd[name] if r is None else sd[name][:r] for sd in experts]
        b = None
        if base is not None:
            b = (base[name] if r is None else base[name][:r]).to(dtype)
        return b, [t.to(dtype) for t in tensors]

    def make_iter() -> Iterator[tuple[str, torch.Tensor | None, list[torch.Tensor]]]:
        return ((name, *load(name)) for name in floating)

    resolved = {**resolved, **lists}
    stats = m.compute_stats(resolved, make_iter)

    out: dict[str, torch.Tensor] = {}
    for name, ref in reference.items():
        if name in alias_of:
            out[name] = out[alias_of[name]]
            continue
        if not ref.is_floating_point():
            out[name] = ref.clone()
            continue
        b, es = load(name)
        merged = m.apply(b, es, TensorContext(name=name, seed=seed, stats=stats), resolved)
        if name in rows:  # merged the shared vocabulary rows; the rest stay the reference's
            full = ref.clone()
            full[: rows[name]] = merged.to(ref.dtype)
            out[name] = full
            continue
        merged = merged.to(ref.dtype)
        if any(merged.data_ptr() == t.data_ptr() for t in [ref, *(sd[name] for sd in experts)]):
            merged = merged.clone()  # never hand back (an alias of) an input tensor
        out[name] = merged
    return out


def _config_dict(module: torch.nn.Module) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else None


def merge_models(
    method: str | MergeMethod,
    base: torch.nn.Module | None,
    experts: list[torch.nn.Module],
    **kwargs: Any,
) -> torch.nn.Module:
    """Merge modules of one architecture; returns a new module in eval mode (inputs unchanged).

    Keyword arguments are those of :func:`merge_state_dicts`. Models of different classes or
    with different structural config entries (hidden size, layers, ...) are refused.
    """
    template = base if base is not None else experts[0]
    others = experts if base is not None else experts[1:]
    reference_label = "base" if base is not None else "expert 0"
    labels = [f"expert {i + (base is None)}" for i in range(len(others))]
    for label, module in zip(labels, others):
        if type(module) is not type(template):
            raise MergeInputError(
                f"different architectures: {label} is a {type(module).__name__} but the "
                f"{reference_label} is a {type(template).__name__}"
            )
    check_same_architecture(
        [_config_dict(template)] + [_config_dict(m) for m in others],
        [reference_label, *labels],
        vocab_padding=kwargs.get("vocab_padding", "error"),
    )
    merged_sd = merge_state_dicts(
        method,
        base.state_dict() if base is not None else None,
        [e.state_dict() for e in experts],
        **kwargs,
    )
    merged = copy.deepcopy(template)
    merged.load_state_dict(merged_sd)
    return merged.eval()
