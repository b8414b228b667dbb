"""Merging in memory: state dicts and ``torch.nn.Module``s (what the studies use on tiny models)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from .registry import MergeMethod, TensorContext, get_merge_method
from .validation import check_tensors_compatible


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
) -> dict[str, torch.Tensor]:
    """Merge ``experts`` (and ``base``) tensor by tensor with a registered method.

    ``weights`` is shorthand for ``per_model_params={"weight": weights}``. Every tensor is merged
    in ``dtype`` (float32 by default) and stored back in the base's (or first expert's) dtype.
    Non-floating tensors (e.g. integer buffers) are copied from the base unchanged.
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
    check_tensors_compatible(
        reference, experts, base_label="base" if base is not None else "expert 0"
    )

    def cast(name: str):
        b = base[name].to(dtype) if base is not None else None
        return b, [e[name].to(dtype) for e in experts]

    stats: dict[str, Any] = {}
    if m.prepare is not None and (m.needs_prepare is None or m.needs_prepare(resolved)):
        floating = [k for k, v in reference.items() if v.is_floating_point()]
        stats = m.prepare(resolved, ((k, *cast(k)) for k in floating))

    out: dict[str, torch.Tensor] = {}
    for name, ref in reference.items():
        if not ref.is_floating_point():
            out[name] = ref.clone()
            continue
        b, es = cast(name)
        ctx = TensorContext(name=name, seed=seed, stats=stats)
        merged = m.fn(b, es, ctx=ctx, **resolved, **lists)
        out[name] = merged.to(ref.dtype)
    return out


def merge_models(
    method: str | MergeMethod,
    base: torch.nn.Module | None,
    experts: list[torch.nn.Module],
    **kwargs: Any,
) -> torch.nn.Module:
    """Merge modules of one architecture; returns a new module (the inputs are not modified)."""
    template = base if base is not None else experts[0]
    merged_sd = merge_state_dicts(
        method,
        base.state_dict() if base is not None else None,
        [e.state_dict() for e in experts],
        **kwargs,
    )
    merged = copy.deepcopy(template)
    merged.load_state_dict(merged_sd)
    return merged.eval()
