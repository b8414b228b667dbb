"""Checks that inputs can be merged; each error names the model, the tensor and the problem.

The building blocks work on names, shapes and config dicts, so the in-memory engine and the
streamed checkpoint engine (which sees shapes in safetensors headers before loading any data)
apply the same rules.

Vocabulary padding rule (``vocab_padding``): models fine-tuned from one base sometimes differ
only in how many embedding rows they carry (added tokens, padding to a multiple of 64).

* ``"error"`` (default): any shape mismatch is an error.
* ``"truncate"``: for embedding / output-head tensors (names matching :data:`VOCAB_TENSOR_PATTERN`)
  whose shapes differ only in the first (vocabulary) axis, merge the rows every model has
  (rows ``[0, min_rows)``) and keep the reference model's (the base's, else expert 0's) remaining
  rows unchanged; rows only an expert has are dropped. The output keeps the reference's shape,
  and the configs' ``vocab_size`` may then differ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from mergelab.errors import UserInputError

VocabPadding = Literal["error", "truncate"]
VOCAB_PADDING_RULES: tuple[str, ...] = ("error", "truncate")

# Tensors whose first axis is the vocabulary: input embeddings and output heads of common
# architectures (Llama/Qwen/Mistral, GPT-2, GPT-NeoX, BERT, T5, Meta's original Llama).
VOCAB_TENSOR_PATTERN = re.compile(
    r"(^|\.)(embed_tokens|embed_in|embed_out|wte|word_embeddings|tok_embeddings|lm_head|shared)"
    r"\.(weight|bias)$|^output\.weight$"
)

# Config entries that must agree for two checkpoints to be the same architecture.
STRUCTURAL_CONFIG_KEYS: tuple[str, ...] = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "tie_word_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "d_model",
    "num_layers",
)


class MergeInputError(UserInputError):
    """Inputs that cannot be merged (mismatched tensors, shapes, dtypes, NaN/Inf, unreadable
    files). A ``ValueError``; the ``mergelab`` command exits 2 with its message."""


def _check_rule(vocab_padding: str) -> None:
    if vocab_padding not in VOCAB_PADDING_RULES:
        raise ValueError(
            f"vocab_padding={vocab_padding!r}; use one of {', '.join(VOCAB_PADDING_RULES)}"
        )


def is_vocab_tensor(name: str) -> bool:
    """Whether ``name`` is an embedding / output-head tensor whose first axis is the vocabulary."""
    return VOCAB_TENSOR_PATTERN.search(name) is not None


def check_keys(
    reference_keys: Sequence[str],
    other_keys: Sequence[Sequence[str]],
    labels: Sequence[str],
    *,
    reference_label: str = "base",
) -> None:
    """Every model must hold exactly the reference's tensors (names); lists the differences."""
    ref = set(reference_keys)
    for label, keys in zip(labels, other_keys):
        keys = set(keys)
        missing, extra = sorted(ref - keys), sorted(keys - ref)
        if missing or extra:
            raise MergeInputError(
                f"{label} does not match the {reference_label}: "
                f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"extra tensors {extra[:5]}{'...' if len(extra) > 5 else ''} "
                "(different architectures?)"
            )


def check_same_dtype(name: str, dtypes: Sequence[torch.dtype], labels: Sequence[str]) -> None:
    """One tensor must have one dtype in every model (reference first), whatever the engine.

    The rule is strict on purpose: a bf16 expert merged into an fp32 base would silently be
    stored in fp32 (or the reverse lose precision), and which model's dtype wins would depend on
    which model is the reference. Convert the models to one dtype first.
    """
    for label, dtype in zip(labels[1:], dtypes[1:]):
        if dtype != dtypes[0]:
            raise MergeInputError(
                f"tensor {name!r} is {dtype} in {label} but {dtypes[0]} in {labels[0]}; "
                "convert the models to one dtype first"
            )


def common_vocab_rows(
    name: str,
    shapes: Sequence[Sequence[int]],
    labels: Sequence[str],
    vocab_padding: VocabPadding = "error",
) -> int | None:
    """Check one tensor's shapes (reference first); rows to merge under the padding rule.

    Returns ``None`` when all shapes are equal, or the number of leading vocabulary rows shared by
    every model when ``vocab_padding="truncate"`` applies; raises :class:`MergeInputError`
    otherwise.
    """
    _check_rule(vocab_padding)
    shapes = [tuple(s) for s in shapes]
    if all(s == shapes[0] for s in shapes):
        return None
    only_rows_differ = all(len(s) == len(shapes[0]) and s[1:] == shapes[0][1:] for s in shapes)
    listing = ", ".join(f"{label} {s}" for label, s in zip(labels, shapes))
    if only_rows_differ and is_vocab_tensor(name):
        if vocab_padding == "truncate":
            return min(s[0] for s in shapes)
        raise MergeInputError(
            f"tensor {name!r}: vocabulary sizes differ ({listing}); if only the padding of the "
            "vocabulary differs, pass vocab_padding='truncate' to merge the shared rows and keep "
            f"the {labels[0]}'s extra rows"
        )
    raise MergeInputError(f"tensor {name!r}: shapes differ ({listing})")


def check_finite_tensor(name: str, tensor: torch.Tensor, label: str) -> None:
    """NaN or Inf anywhere in a floating tensor is an error (it would spread through the merge)."""
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise MergeInputError(
            f"tensor {name!r} in {label} contains NaN or Inf ({bad} of {tensor.numel()} entries)"
        )


def check_same_architecture(
    configs: Sequence[Mapping[str, Any] | None],
    labels: Sequence[str],
    *,
    vocab_padding: VocabPadding = "error",
) -> None:
    """Model configs (dicts, reference first) must agree on :data:`STRUCTURAL_CONFIG_KEYS`.

    Keys missing or ``None`` in either config are not compared. ``vocab_size`` may differ only
    under ``vocab_padding="truncate"``.
    """
    _check_rule(vocab_padding)
    keys = STRUCTURAL_CONFIG_KEYS + (("vocab_size",) if vocab_padding == "error" else ())
    reference = configs[0]
    if reference is None:
        return
    for label, config in zip(labels[1:], configs[1:]):
        if config is None:
            continue
        for key in keys:
            a, b = reference.get(key), config.get(key)
            if a is not None and b is not None and a != b:
                hint = (
                    "; if only the vocabulary padding differs, pass vocab_padding='truncate'"
                    if key == "vocab_size"
                    else ""
                )
                raise MergeInputError(
                    f"different architectures: {key} is {a!r} in the {labels[0]} but {b!r} in "
                    f"{label}{hint}"
                )


def check_tensors_compatible(
    reference: Mapping[str, torch.Tensor],
    others: list[Mapping[str, torch.Tensor]],
    *,
    base_label: str = "base",
    check_finite: bool = True,
    vocab_padding: VocabPadding = "error",
) -> dict[str, int]:
    """Check in-memory state dicts against the reference (names, dtypes, shapes, NaN/Inf: the
    rules of the checkpoint engine); returns ``{name: rows}`` for the tensors merged on their
    first ``rows`` rows under ``vocab_padding="truncate"``."""
    labels = [base_label] + [f"expert {i}" for i in range(len(others))]
    check_keys(list(reference), [list(sd) for sd in others], labels[1:], reference_label=base_label)
    rows: dict[str, int] = {}
    for name, ref in reference.items():
        check_same_dtype(name, [ref.dtype] + [sd[name].dtype for sd in others], labels)
        shapes = [ref.shape] + [sd[name].shape for sd in others]
        common = common_vocab_rows(name, shapes, labels, vocab_padding)
        if common is not None:
            rows[name] = common
    if check_finite:
        for label, sd in zip(labels, [reference, *others]):
            for name, t in sd.items():
                check_finite_tensor(name, t, label)
    return rows
