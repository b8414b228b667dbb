"""Merging PEFT LoRA adapters of one base model, in ΔW space.

A LoRA adapter changes a linear layer's weight ``W`` (shape ``[out, in]``) by
``ΔW = B @ A * scaling`` with ``A: [r, in]``, ``B: [out, r]`` and ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rsLoRA). Merging ``A`` and ``B`` separately is not a merge of the
adapters (``(B1 + B2)(A1 + A2) ≠ B1A1 + B2A2``), so every registered method is applied to the
products: each adapter's ``ΔW_i`` is its *task vector* and the base tensor is zero, i.e. the
method sees ``θ_b = 0`` and ``θ_i = ΔW_i``. A module one adapter does not touch has ``ΔW_i = 0``.

Two outputs:

* ``"full"`` — a model folder: the base checkpoint streamed tensor by tensor with the merged ΔW
  added (in float32, stored in the base's dtype), loadable with ``AutoModelForCausalLM``;
* ``"adapter"`` — a new PEFT adapter. Where the method is linear in the ΔW's (``linear``,
  ``task_arithmetic``: merged ΔW = Σ c_i ΔW_i) it is exact by concatenation, as PEFT's ``cat``:
  ``A = [A_1; A_2; ...]``, ``B = [c_1 s_1 B_1, c_2 s_2 B_2, ...]``, rank ``Σ r_i``, scaling 1.
  Otherwise (or when a smaller ``rank`` is asked for) each merged ΔW is truncated to ``rank``
  singular values (``B = U_k S_k``, ``A = V_kᵀ``) and the relative Frobenius error
  ``‖ΔW − B A‖_F / ‖ΔW‖_F`` of every module is reported.

Adapters are read by :mod:`mergelab.lora` (plain LoRA on linear layers; DoRA, LoRA on
embeddings, biases or ``modules_to_save`` are refused there, saying what was found).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mergelab.lora import ADAPTER_WEIGHTS_NAMES, PEFT_PREFIX, LoraAdapter
from mergelab.outputs import atomic_output_dir, check_output_path

from ..progress import progress_bar
from .checkpoint import (
    DEFAULT_SHARD_SIZE,
    MERGE_RECORD_NAME,
    CheckpointFolder,
    OutputTensor,
    copy_model_files,
    parse_size,
    set_config_dtype,
    write_sharded,
)
from .registry import MergeMethod, TensorContext, get_merge_method
from .validation import MergeInputError

# Methods whose merged ΔW is Σ c_i ΔW_i (with c_i from their parameters): an exact `cat` exists.
LINEAR_IN_DELTA = frozenset({"linear", "task_arithmetic"})


@dataclass
class LoraMergeResult:
    output: Path
    kind: str  # "full" | "adapter"
    rank: int | None = None  # adapter output only
    exact: bool = True  # adapter output: concatenation (exact) or SVD truncation
    # module -> ‖ΔW − BA‖_F / ‖ΔW‖_F of the SVD truncation (empty when exact)
    truncation_error: dict[str, float] = field(default_factory=dict)

    @property
    def max_truncation_error(self) -> float:
        return max(self.truncation_error.values(), default=0.0)


class LoraDeltaMerge:
    """The merged ΔW of every module, computed on demand (one module at a time)."""

    def __init__(
        self,
        method: MergeMethod,
        adapters: list[LoraAdapter],
        params: dict[str, Any],
        per_model: dict[str, list[float]],
        dtype: torch.dtype,
        seed: int,
    ):
        self.method, self.adapters, self.params, self.per_model = (
            method,
            adapters,
            params,
            per_model,
        )
        self.dtype, self.seed = dtype, seed
        self.shapes: dict[str, tuple[int, int]] = {}
        for adapter in adapters:
            for module, lora in adapter.modules.items():
                shape = lora.delta_shape
                if self.shapes.setdefault(module, shape) != shape:
                    raise MergeInputError(
                        f"adapter {adapter.path}: module {module} has ΔW shape {shape}, "
                        f"another adapter has {self.shapes[module]}"
                    )
        self.modules = sorted(self.shapes)
        self.stats: dict[str, Any] = {}

    def prepare(self) -> None:
        """The method's whole-model first pass (e.g. a global top-k threshold), if it has one."""
        self.stats = self.method.compute_stats(self._resolved, self.iter_inputs)

    @property
    def _resolved(self) -> dict[str, Any]:
        return {**self.params, **self.per_model}

    def task_vectors(self, module: str) -> list[torch.Tensor]:
        shape = self.shapes[module]
        return [
            a.modules[module].delta(self.dtype)
            if module in a.modules
            else torch.zeros(shape, dtype=self.dtype)
            for a in self.adapters
        ]

    def iter_inputs(self) -> Iterator[tuple[str, torch.Tensor, list[torch.Tensor]]]:
        for module in self.modules:
            deltas = self.task_vectors(module)
            yield f"{module}.weight", torch.zeros_like(deltas[0]), deltas

    def merged_delta(self, module: str) -> torch.Tensor:
        """Merged ΔW of ``module`` (the method applied with base 0), in the compute dtype."""
        deltas = self.task_vectors(module)
        ctx = TensorContext(name=f"{module}.weight", seed=self.seed, stats=self.stats)
        return self.method.apply(torch.zeros_like(deltas[0]), deltas, ctx, self._resolved)

    def linear_coefficients(self) -> list[float]:
        """c_i with merged ΔW = Σ c_i ΔW_i, read off the method itself (unit task vectors)."""
        n = len(self.adapters)
        coefficients = []
        for i in range(n):
            units = [torch.full((1,), float(i == j), dtype=torch.float64) for j in range(n)]
            ctx = TensorContext(name="coefficient-probe", seed=self.seed, stats=self.stats)
            value = self.method.apply(
                torch.zeros(1, dtype=torch.float64), units, ctx, self._resolved
            )
            coefficients.append(float(value[0]))
        return coefficients


def merge_lora_adapters(
    method: str | MergeMethod,
    adapters: Sequence[str | os.PathLike],
    *,
    output: str | os.PathLike,
    base: str | os.PathLike | None = None,
    output_kind: str = "full",
    rank: int | None = None,
    params: dict[str, Any] | None = None,
    per_model_params: dict[str, Any] | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    force: bool = False,
    progress: bool = True,
) -> LoraMergeResult:
    """Merge LoRA adapters of one base with a registered method (applied to the ΔW's).

    ``output_kind="full"`` needs ``base`` (the checkpoint folder the adapters were trained on) and
    writes a merged model; ``"adapter"`` writes a PEFT adapter — exact concatenation for methods
    linear in ΔW unless ``rank`` < Σ r_i, SVD truncation to ``rank`` (default Σ r_i) otherwise.
    """
    m = get_merge_method(method) if isinstance(method, str) else method
    if output_kind not in ("full", "adapter"):
        raise ValueError(f"output_kind must be 'full' or 'adapter', not {output_kind!r}")
    if output_kind == "full" and base is None:
        raise MergeInputError("a full merged model needs the base checkpoint (--base)")
    inputs = [p for p in [base, *adapters] if p is not None]
    check_output_path(output, force=force, inputs=inputs)
    plan = plan_lora_merge(
        m,
        adapters,
        base=base,
        params=params,
        per_model_params=per_model_params,
        weights=weights,
        dtype=dtype,
        seed=seed,
    )
    plan.merge.prepare()
    if output_kind == "full":
        return _write_full(plan, output, inputs, shard_size, force, progress)
    return _write_adapter(plan, output, inputs, rank, force, progress)


@dataclass
class LoraMergePlan:
    merge: LoraDeltaMerge
    base: CheckpointFolder | None

    def describe(self) -> dict[str, Any]:
        merge = self.merge
        return {
            "method": merge.method.name,
            "params": merge.params,
            "per_model_params": merge.per_model,
            "adapters": [str(a.path.resolve()) for a in merge.adapters],
            "ranks": [a.max_rank for a in merge.adapters],
            "base": str(self.base.path.resolve()) if self.base is not None else None,
            "as_given": {  # the paths as typed (relative ones to the merge's working folder)
                "adapters": [str(a.path) for a in merge.adapters],
                "base": str(self.base.path) if self.base is not None else None,
            },
            "compute_dtype": str(merge.dtype).removeprefix("torch."),
            "seed": merge.seed,
            "n_modules": len(merge.modules),
        }


def plan_lora_merge(
    method: str | MergeMethod,
    adapters: Sequence[str | os.PathLike],
    *,
    base: str | os.PathLike | None = None,
    params: dict[str, Any] | None = None,
    per_model_params: dict[str, Any] | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LoraMergePlan:
    """Load and validate adapters (and the base's headers); nothing is written."""
    m = get_merge_method(method) if isinstance(method, str) else method
    if not adapters:
        raise MergeInputError("LoRA merge needs at least one adapter")
    per_model_params = dict(per_model_params or {})
    if weights is not None:
        per_model_params["weight"] = list(weights)
    resolved, lists = m.resolve(len(adapters), params, per_model_params)
    loaded = [LoraAdapter.from_pretrained(p, label=f"adapter {i}") for i, p in enumerate(adapters)]
    merge = LoraDeltaMerge(m, loaded, resolved, lists, dtype, seed)  # checks ΔW shapes agree
    folder = CheckpointFolder(base, "base") if base is not None else None
    if folder is not None:
        for module, shape in merge.shapes.items():
            name = f"{module}.weight"
            if name not in folder.tensors:
                raise MergeInputError(
                    f"the adapters adapt {module}, which the base {folder.path} does not have "
                    f"(no tensor {name!r})"
                )
            if folder.tensors[name].shape != shape:
                raise MergeInputError(
                    f"ΔW of {module} is {shape} but the base's {name} is "
                    f"{folder.tensors[name].shape}"
                )
    return LoraMergePlan(merge, folder)


def _write_full(
    plan: LoraMergePlan,
    output: str | os.PathLike,
    inputs: list,
    shard_size: int | str,
    force: bool,
    progress: bool,
) -> LoraMergeResult:
    folder = plan.base
    assert folder is not None
    adapted = {f"{module}.weight": module for module in plan.merge.modules}
    order = sorted(
        folder.tensors, key=lambda n: (str(folder.tensors[n].file), folder.tensors[n].offset)
    )
    tensors = [OutputTensor(n, folder.tensors[n].shape, folder.tensors[n].dtype) for n in order]

    def produce(t: OutputTensor, phase: int | None) -> torch.Tensor:  # fresh tensors: not placed
        weight = folder.read(t.name)
        if t.name not in adapted:
            return weight
        merged = weight.to(torch.float32) + plan.merge.merged_delta(adapted[t.name]).float()
        return merged.to(t.dtype)

    try:
        with atomic_output_dir(output, force=force, inputs=inputs, kind="merge") as tmp:
            write_sharded(
                tmp,
                tensors,
                produce,
                shard_size=parse_size(shard_size),
                progress=progress,
                description=f"merging LoRA ({plan.merge.method.name})",
            )
            copy_model_files(folder.path, tmp)
            set_config_dtype(tmp, tensors)
            record = {**plan.describe(), "output": "full"}
            (tmp / MERGE_RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    finally:
        folder.close()
    return LoraMergeResult(Path(output), "full")


def svd_truncate(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Best rank-``rank`` factors of ``delta`` [out, in]: (B [out, k], A [k, in], relative
    Frobenius error ‖delta − B A‖_F / ‖delta‖_F). ``k = rank``; columns beyond the matrix rank are
    zero."""
    U, S, Vh = torch.linalg.svd(delta.double(), full_matrices=False)
    k = min(rank, S.shape[0])
    total = float(S.square().sum())
    error = math.sqrt(float(S[k:].square().sum()) / total) if total > 0 else 0.0
    B = torch.zeros(delta.shape[0], rank, dtype=torch.float64)
    A = torch.zeros(rank, delta.shape[1], dtype=torch.float64)
    B[:, :k] = U[:, :k] * S[:k]
    A[:k] = Vh[:k]
    return B, A, error


def _write_adapter(
    plan: LoraMergePlan,
    output: str | os.PathLike,
    inputs: list,
    rank: int | None,
    force: bool,
    progress: bool,
) -> LoraMergeResult:
    merge = plan.merge
    block_ranks = [a.max_rank for a in merge.adapters]
    total_rank = sum(block_ranks)
    exact = merge.method.name in LINEAR_IN_DELTA and (rank is None or rank >= total_rank)
    out_rank = total_rank if exact else (rank or total_rank)
    store_dtype = next(iter(merge.adapters[0].modules.values())).A.dtype
    tensors: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    coefficients = merge.linear_coefficients() if exact else None
    for module in progress_bar(merge.modules, desc="merging LoRA", unit="module", enabled=progress):
        out_features, in_features = merge.shapes[module]
        fan_in_fan_out = any(
            a.modules[module].fan_in_fan_out for a in merge.adapters if module in a.modules
        )
        if fan_in_fan_out:  # PEFT's A/B describe the transposed weight
            out_features, in_features = in_features, out_features
        if exact:
            # cat: A stacks the adapters' A's, B their B's times c_i·s_i (zero blocks where an
            # adapter skips this module or has a smaller rank here).
            A = torch.zeros(out_rank, in_features, dtype=torch.float64)
            B = torch.zeros(out_features, out_rank, dtype=torch.float64)
            start = 0
            for adapter, c, block in zip(merge.adapters, coefficients, block_ranks):
                lora = adapter.modules.get(module)
                if lora is not None:
                    A[start : start + lora.rank] = lora.A.double()
                    B[:, start : start + lora.rank] = lora.B.double() * (c * lora.scaling)
                start += block
        else:
            delta = merge.merged_delta(module)
            B, A, errors[module] = svd_truncate(delta.T if fan_in_fan_out else delta, out_rank)
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = A.to(store_dtype).contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = B.to(store_dtype).contiguous()
    from peft import LoraConfig

    config = replace(
        LoraConfig.from_pretrained(str(merge.adapters[0].path)),
        r=out_rank,
        lora_alpha=out_rank,  # scaling 1: c_i·s_i (or the singular values) live in B
        use_rslora=False,
        target_modules=set(merge.modules),
        rank_pattern={},
        alpha_pattern={},
    )
    kind = "lora-adapter"
    with atomic_output_dir(output, force=force, inputs=inputs, kind=kind) as tmp:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS_NAMES[0]), metadata={"format": "pt"})
        record = {
            **plan.describe(),
            "output": "adapter",
            "rank": out_rank,
            "exact": exact,
            "coefficients": coefficients,
            "truncation_error": errors,
        }
        (tmp / MERGE_RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    if plan.base is not None:
        plan.base.close()
    return LoraMergeResult(Path(output), "adapter", out_rank, exact, errors)
