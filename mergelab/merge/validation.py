"""Checks that inputs can be merged; each error names the model, the tensor and the problem."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class MergeInputError(ValueError):
    """Inputs that cannot be merged (mismatched tensors, shapes, NaN/Inf, unreadable files)."""


def check_tensors_compatible(
    reference: Mapping[str, torch.Tensor],
    others: list[Mapping[str, torch.Tensor]],
    *,
    base_label: str = "base",
    check_finite: bool = True,
) -> None:
    ref_keys = set(reference)
    for i, sd in enumerate(others):
        keys = set(sd)
        missing, extra = sorted(ref_keys - keys), sorted(keys - ref_keys)
        if missing or extra:
            raise MergeInputError(
                f"expert {i} does not match the {base_label}: "
                f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"extra tensors {extra[:5]}{'...' if len(extra) > 5 else ''}"
            )
        for name, ref in reference.items():
            if sd[name].shape != ref.shape:
                raise MergeInputError(
                    f"tensor {name!r}: shape {tuple(sd[name].shape)} in expert {i} "
                    f"but {tuple(ref.shape)} in the {base_label}"
                )
    if check_finite:
        for label, sd in [(base_label, reference)] + [
            (f"expert {i}", s) for i, s in enumerate(others)
        ]:
            for name, t in sd.items():
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise MergeInputError(f"tensor {name!r} in {label} contains NaN or Inf")
