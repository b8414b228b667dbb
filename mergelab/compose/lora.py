"""The LoRA fast path: base and k LoRA experts in one batched forward per decoding step.

When every expert is a LoRA adapter of the same base, expert i's layer output is
``W x + s_i·B_i A_i x``. Stacking the batch ``k + 1`` times — rows ``[0, B)`` for the base, rows
``[iB, (i+1)B)`` for adapter i — one forward of the base model computes every component, with one
copy of the base weights and one KV cache for the ``(k+1)·B`` rows. The low-rank terms are added
by forward hooks on the adapted layers (installed only while the runner is decoding, so the
user's model is untouched otherwise): per layer, two batched matmuls over contiguous row blocks,
no per-row gathering. This is the same computation as PEFT's mixed-adapter batches
(``adapter_names=`` in ``forward``) without its per-adapter index bookkeeping.

Adapters are read by :mod:`mergelab.lora` (plain LoRA and rsLoRA on ``nn.Linear`` and
transformers ``Conv1D`` layers; anything else is refused there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mergelab.lora import LoraAdapter

from .runners import (
    ComponentRunner,
    ModelCall,
    eval_mode,
    has_sliding_window,
    new_cache,
)
from .vocab import model_identity


class LoraRunner(ComponentRunner):
    """Component runner for base + LoRA experts: one forward of a ``(k+1)·B`` batch per step."""

    def __init__(
        self,
        base_model: nn.Module,
        adapters: Sequence[LoraAdapter],
        names: Sequence[str],
        vocab_size: int,
    ):
        if not adapters:
            raise ValueError("the LoRA fast path needs at least one adapter")
        self.names = ("base", *names)
        base_model = eval_mode(base_model)
        self.models = {"base": base_model}
        self.adapters = dict(zip(names, adapters))
        self.call = ModelCall(base_model, "base", vocab_size)
        self.k = len(adapters)
        self.forward_passes = 0
        self._targets = self._stack(base_model, list(adapters))
        self._handles: list[Any] = []
        self._caches: list[Any] = []
        self._ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def _stack(self, base_model: nn.Module, adapters: list[LoraAdapter]) -> list[tuple]:
        """Per adapted module: ``A [k, in, r_max]`` and ``s·B`` as ``[k, r_max, out]``.

        Ranks are padded with zeros to the largest, and an adapter that skips a module gets
        zeros there, which leaves the sum exact.
        """
        modules = dict(base_model.named_modules())
        targets = sorted({m for a in adapters for m in a.modules})
        out = []
        for module_name in targets:
            module = modules.get(module_name)
            if module is None:
                raise ValueError(f"adapter module {module_name!r} not found in the base model")
            if hasattr(module, "lora_A") or hasattr(module, "base_layer"):
                raise ValueError(
                    f"{module_name} is already a PEFT layer: pass the plain base model "
                    "(e.g. peft_model.unload() or a fresh copy)"
                )
            weight = getattr(module, "weight", None)
            if weight is None or weight.dim() != 2:
                raise ValueError(f"{module_name} ({type(module).__name__}) is not a linear layer")
            loras = [a.modules[module_name] for a in adapters if module_name in a.modules]
            in_features, out_features = loras[0].A.shape[1], loras[0].B.shape[0]
            r_max = max(lora.rank for lora in loras)
            a_stack = weight.new_zeros((self.k, in_features, r_max))
            b_stack = weight.new_zeros((self.k, r_max, out_features))
            for i, adapter in enumerate(adapters):
                if module_name not in adapter.modules:
                    continue
                lora = adapter.modules[module_name]
                a, b, scaling = lora.A, lora.B, lora.scaling
                if lora.delta_shape != tuple(weight.shape):  # made for another base
                    raise ValueError(
                        f"LoRA adapter {adapter.name} does not fit the base model: its "
                        f"{module_name} changes a {list(lora.delta_shape)} weight, the base's is "
                        f"{list(weight.shape)}; was the adapter made for another base?"
                    )
                if a.shape[1] != in_features or b.shape[0] != out_features:
                    raise ValueError(
                        f"{adapter.name}: {module_name} LoRA shapes {a.shape}, {b.shape}"
                    )
                r = a.shape[0]
                a_stack[i, :, :r] = a.t().to(weight)
                b_stack[i, :r, :] = (b.t() * scaling).to(weight)
            out.append((module, a_stack, b_stack))
        return out

    def describe_models(self) -> dict[str, Any]:
        d: dict[str, Any] = {"base": model_identity(self.models["base"])}
        for n, a in self.adapters.items():
            d[n] = {"lora_adapter": a.name, "n_modules": len(a.modules), "checksum": a.checksum()}
        return d

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Hooks and decoding state live until the outermost session ends (sessions nest; the
        hooks are installed once, or every adapter delta would be added twice)."""
        outermost = not self._handles
        if outermost:
            self._handles = [
                module.register_forward_hook(_lora_hook(self.k, a, b))
                for module, a, b in self._targets
            ]
        try:
            yield
        finally:
            if outermost:
                for h in self._handles:
                    h.remove()
                self._handles = []
                self._reset()

    def _repeat(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat(self.k + 1, *([1] * (t.dim() - 1)))

    def _split(self, lp: torch.Tensor) -> list[torch.Tensor]:
        return list(lp.chunk(self.k + 1, dim=0))

    def _reset(self) -> None:
        self._caches, self._ids, self._positions = [], None, None

    @torch.no_grad()
    def extend(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        last_only: bool = False,
    ) -> list[torch.Tensor]:
        """Append ``input_ids [B, T]`` for base and adapters in one forward of ``(k+1)·B`` rows;
        per component logits ``[B, T, V]`` (``[B, 1, V]`` if ``last_only``)."""
        ids, positions = self._repeat(input_ids), self._repeat(position_ids)
        mask = self._repeat(attention_mask)
        if self._append(ids, positions):
            self._caches = [new_cache(self.call.model) if self.call.may_cache else None]
        logits, self._caches[0] = self._forward(
            self.call, ids, mask, positions, self._caches[0], last_only
        )
        return self._split(logits)

    def has_sliding_window(self) -> bool:
        return self.call.may_cache and has_sliding_window(self.call.model)

    def merged_model(self, weights: Sequence[float]) -> nn.Module:
        """A copy of the base with ``Σ_i weights[i]·ΔW_i`` added to every adapted layer.

        With the composition's weights this is the task-arithmetic merge of the adapters
        (the merged adapter, folded into the base) as one plain model: the cheap draft of
        speculative composition. ``ΔW_i = s_i·B_i A_i`` in the layer's stored layout.
        """
        import copy

        if len(weights) != self.k:
            raise ValueError(f"{len(weights)} weights for {self.k} adapters")
        names = {id(m): n for n, m in self.models["base"].named_modules()}
        merged = copy.deepcopy(self.models["base"])
        modules = dict(merged.named_modules())
        w = torch.tensor([float(x) for x in weights])
        with torch.no_grad():
            for module, a_stack, b_stack in self._targets:
                # x @ A_i @ B_i is adapter i's output delta: its [in, out] matrix is A_i @ B_i.
                delta = torch.einsum("k,kir,kro->io", w.to(a_stack), a_stack, b_stack)
                target = modules[names[id(module)]]
                if isinstance(target, nn.Linear):  # weight [out, in]
                    delta = delta.t()
                elif type(target).__name__ != "Conv1D":  # transformers' Conv1D: [in, out]
                    raise ValueError(f"cannot fold a LoRA delta into {type(target).__name__}")
                target.weight.add_(delta.to(target.weight.dtype))
        return merged.eval()

    @torch.no_grad()
    def teacher_forced(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> list[torch.Tensor]:
        logits, _ = self.call(
            self._repeat(input_ids),
            self._repeat(attention_mask),
            self._repeat(position_ids),
            None,
            last_only=False,
        )
        self.forward_passes += 1
        return self._split(logits)


def _lora_hook(k: int, a_stack: torch.Tensor, b_stack: torch.Tensor):
    """Forward hook adding ``s_i·B_i A_i x`` to row block i + 1 of the layer's output."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        group = x.shape[0] // (k + 1)
        expert_rows = x[group:].reshape(k, -1, x.shape[-1])  # [k, group·T, in]
        delta = torch.bmm(torch.bmm(expert_rows, a_stack), b_stack)  # [k, group·T, out]
        target = output[group:]
        target.add_(delta.view(target.shape))
        return output

    return hook


def check_adapters_fit(base_folder: str | Path, adapters: Sequence[str | Path]) -> None:
    """Before any model is loaded: every module an adapter changes has, in the base checkpoint,
    a weight of the shape the adapter's ΔW has (``ValueError`` naming adapter, module and both
    shapes). Shapes come from the base's safetensors headers; a module whose weight is not found
    there by name (another checkpoint layout) is checked by :class:`LoraRunner` once loaded."""
    from safetensors import safe_open

    from mergelab.lora import as_lora_adapter

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(base_folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    for folder in adapters:
        adapter = as_lora_adapter(folder)
        for module_name, lora in adapter.modules.items():
            weight = f"{module_name}.weight"
            # a checkpoint may store a module without its model's prefix (GPT-2's transformer.)
            keys = [k for k in shapes if k == weight or weight.endswith("." + k)]
            if keys and shapes[keys[0]] != lora.delta_shape:
                raise ValueError(
                    f"LoRA adapter {folder} does not fit the base {base_folder}: its "
                    f"{module_name} changes a {list(lora.delta_shape)} weight, the base's is "
                    f"{list(shapes[keys[0]])}; was the adapter made for another base?"
                )
