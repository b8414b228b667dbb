"""Do two tokenizers mean the same token by each id? One check for composing and for merging.

Composition multiplies distributions id by id, and a merge averages embedding and output-head
rows id by id; both are silently wrong when two models' tokenizers map an id to different tokens,
even when their vocabularies have the same size. :func:`tokenizer_difference` names the first
difference; each caller says what to do about it:

* composition (:func:`mergelab.compose.vocab.check_same_tokenizer`) needs one tokenizer: the
  same vocabulary and the same special tokens;
* a merge (:func:`check_merge_tokenizers`) needs the ids both tokenizers have to mean the same
  tokens (one vocabulary may extend the other, as added tokens do: ``vocab_padding`` and the
  embedding shapes decide those rows); otherwise mergekit's ``tokenizer_source`` must say how to
  align the vocabularies.

Folders are compared by their tokenizer files first (byte for byte, without loading anything), so
a merge of models that ship the same files pays nothing for the check.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "pad_token")

# The files a saved tokenizer consists of (transformers' and sentencepiece's).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def tokenizer_difference(
    ref: Any,
    tok: Any,
    ref_name: str,
    name: str,
    *,
    extension_ok: bool = False,
    specials: bool = True,
) -> str | None:
    """The first way ``tok`` (named ``name``) differs from ``ref``, or None when they agree.

    ``extension_ok``: one vocabulary may have ids the other lacks, as long as every id both have
    is the same token. ``specials``: also compare bos/eos/unk/pad.
    """
    if tok is ref:
        return None
    ref_vocab, vocab = ref.get_vocab(), tok.get_vocab()
    if not extension_ok and len(tok) != len(ref):
        return f"tokenizer of {name} has {len(tok)} tokens, {ref_name}'s has {len(ref)}"
    if vocab != ref_vocab:
        ref_ids = {i: t for t, i in ref_vocab.items()}
        ids = {i: t for t, i in vocab.items()}
        shared = ref_ids.keys() & ids.keys() if extension_ok else ref_ids.keys() | ids.keys()
        diff = sorted(i for i in shared if ref_ids.get(i) != ids.get(i))
        if diff:
            shown = ", ".join(f"id {i}: {ref_ids.get(i)!r} vs {ids.get(i)!r}" for i in diff[:3])
            return (
                f"tokenizer of {name} maps tokens differently from {ref_name}'s ({len(diff)} "
                f"id(s), e.g. {shown})"
            )
    if specials:
        for attr in SPECIAL_ATTRIBUTES:
            a, b = getattr(ref, attr, None), getattr(tok, attr, None)
            if a != b:
                return f"{attr} differs: {ref_name} has {a!r}, {name} has {b!r}"
    return None


def tokenizer_files(folder: str | os.PathLike) -> dict[str, bytes]:
    """The tokenizer files of a model folder, by name (empty: the folder ships no tokenizer)."""
    found = {}
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file():
            found[name] = path.read_bytes()
    return found


# What a user of mergelab's dialect can do about tokenizers that differ.
MERGELAB_DIALECT_REMEDY = (
    "align the vocabularies with tokenizer_source (base, union or a model) in a mergekit-dialect "
    "config (merge_method: ...), or merge models that share a tokenizer"
)
MERGEKIT_DIALECT_REMEDY = (
    "set tokenizer_source (base, union or a model) or a tokenizer: block to align the "
    "vocabularies, as in mergekit"
)


def check_merge_tokenizers(
    folders: Sequence[str | os.PathLike],
    labels: Sequence[str],
    remedy: str = MERGELAB_DIALECT_REMEDY,
) -> None:
    """Refuse (``UserInputError``, ending with ``remedy``) to merge models whose tokenizers give
    an id two meanings.

    Folders that ship no tokenizer are skipped (nothing to compare); folders whose tokenizer
    files are byte-identical to the first one's are not loaded.
    """
    from mergelab.errors import UserInputError

    shipped = [(f, label, tokenizer_files(f)) for f, label in zip(folders, labels)]
    shipped = [s for s in shipped if s[2]]
    if len(shipped) < 2 or all(s[2] == shipped[0][2] for s in shipped[1:]):
        return
    from mergelab.merge.tokenizer import load_tokenizer

    ref_folder, ref_label, ref_files = shipped[0]
    ref = load_tokenizer(ref_folder, local_files_only=True)
    for folder, label, files in shipped[1:]:
        if files == ref_files:
            continue
        other = load_tokenizer(folder, local_files_only=True)
        diff = tokenizer_difference(ref, other, ref_label, label, extension_ok=True, specials=False)
        if diff is not None:
            raise UserInputError(
                f"{diff}: a merge combines embedding rows by id, so the result would be wrong; "
                f"{remedy}"
            )
