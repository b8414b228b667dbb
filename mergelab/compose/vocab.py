"""Vocabulary rules for composing models: one tokenizer, log-probs over exactly its tokens.

Composition multiplies distributions token by token, so every component must mean the same thing
by token id ``j``. We therefore require identical tokenizers (same vocabulary, same special
tokens). Output layers may still differ in size: checkpoints often pad the embedding matrix to a
multiple of 64 or 128. That is allowed only because the tokenizers are identical, and it is
resolved by truncating every model's logits to the tokenizer's ``len(tokenizer)`` entries before
the log-softmax (ids the tokenizer can never produce get no probability). A model with *fewer*
logits than the tokenizer has tokens is an error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mergelab.vocabulary import SPECIAL_ATTRIBUTES, TOKENIZER_FILES, tokenizer_difference


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Number of token ids the tokenizer can produce (added tokens included)."""
    return len(tokenizer)


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """A JSON-able identity of a tokenizer: size, specials and a hash of the vocabulary."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha1(
        json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    ).hexdigest()
    return {
        "name_or_path": getattr(tokenizer, "name_or_path", ""),
        "vocab_size": len(tokenizer),
        "vocab_sha1": digest,
        "special_tokens": {a: getattr(tokenizer, a, None) for a in SPECIAL_ATTRIBUTES},
    }


def check_shipped_tokenizers(tokenizer: Any, name: str, folders: Sequence[str]) -> None:
    """Every model folder in ``folders`` that ships a tokenizer must ship ``tokenizer`` (read
    from ``name``): ``ValueError`` naming the first difference. Folders without one are skipped."""
    from pathlib import Path

    from transformers import AutoTokenizer

    shipped = [str(f) for f in folders if any((Path(f) / n).is_file() for n in TOKENIZER_FILES)]
    if shipped:
        others = [AutoTokenizer.from_pretrained(f, local_files_only=True) for f in shipped]
        check_same_tokenizer([tokenizer, *others], [name, *shipped])


def check_same_tokenizer(tokenizers: Sequence[Any], names: Sequence[str] | None = None) -> None:
    """Raise ``ValueError`` naming the first difference between ``tokenizers[0]`` and the rest
    (:func:`mergelab.vocabulary.tokenizer_difference`, the check merges use too)."""
    names = list(names) if names is not None else [f"model {i}" for i in range(len(tokenizers))]
    for name, tok in zip(names[1:], tokenizers[1:]):
        diff = tokenizer_difference(tokenizers[0], tok, names[0], name)
        if diff is not None:
            raise ValueError(f"{diff}; composition needs one shared tokenizer")


def model_output_size(model: nn.Module) -> int | None:
    """Number of logits the model emits per position, if it can be read without running it."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        head = get()
        if head is not None and getattr(head, "weight", None) is not None:
            return int(head.weight.shape[0])
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if size is not None else None


def check_model_vocab(model: nn.Module, vocab_size: int, name: str = "model") -> None:
    size = model_output_size(model)
    if size is not None and size < vocab_size:
        raise ValueError(
            f"{name} emits {size} logits but the tokenizer has {vocab_size} tokens; "
            "the model and tokenizer do not belong together"
        )


def truncate_logits(logits: torch.Tensor, vocab_size: int, name: str = "model") -> torch.Tensor:
    """``logits[..., :vocab_size]``; see the module docstring for why truncation is allowed."""
    if logits.shape[-1] < vocab_size:
        raise ValueError(
            f"{name} emitted {logits.shape[-1]} logits but the tokenizer has {vocab_size} tokens"
        )
    return logits[..., :vocab_size]


def model_identity(model: nn.Module) -> dict[str, Any]:
    """JSON-able identity of a model: class, config name and a checksum of its parameters."""
    config = getattr(model, "config", None)
    digest = hashlib.sha1()
    n_params = 0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            n_params += p.numel()
            flat = p.detach().reshape(-1).double()
            # sum, and a position-weighted sum so that permutations change the checksum.
            weights = torch.linspace(
                1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device
            )
            digest.update(
                f"{pname}:{flat.sum().item():.10e}:{(flat * weights).sum().item():.10e}".encode()
            )
    return {
        "class": type(model).__name__,
        "name_or_path": getattr(config, "_name_or_path", "") if config is not None else "",
        "n_parameters": n_params,
        "parameter_checksum": digest.hexdigest()[:16],
    }
