"""The output tokenizer of a merge, and embedding rows aligned to it (mergekit's tokenizer rules).

Models fine-tuned from one base often carry different vocabularies (added chat tokens, a
larger padded vocabulary). mergekit (0.1.5) merges them by first choosing an output tokenizer,
then giving every model an embedding (and output head) indexed by the output vocabulary, and only
then merging. mergelab follows the same rules, step by step:

1. **The output tokenizer** (``source``):

   * ``"base"`` — the base model's tokenizer (the first model's when there is no base), with
     tokens whose id is ≥ the model's ``vocab_size`` stripped (BPE tokenizers only; others with
     such tokens are refused, as mergekit does);
   * a model folder — that model's tokenizer, as it is;
   * ``"union"`` — the base tokenizer plus every token of the other models that it lacks (ids
     below each model's ``vocab_size``), appended as added tokens in model order; added tokens
     (special tokens and the like) are taken from the first model that has them.

   Tokens listed in ``add_tokens`` (the keys of mergekit's ``tokenizer.tokens``) are appended if
   missing.

2. **Permutations**: for each model, output token id → that model's id of the same token string,
   or −1 when the model lacks it.

3. **Rows** (:func:`align_vocabulary`, applied to every vocabulary tensor — input embedding,
   output head — in the compute's input dtype, before the merge): a token every model has keeps
   each model's own row. A token some model lacks gets, in that model's tensor, a default row:
   the one model that has it donates its row; else the base's row if the base is among the
   inputs and has it; else the mean over the models that have it (a token nobody has gets a zero
   row). ``tokens`` overrides the source per token (``source``: a model, a ``model_token`` of a
   model, or ``zero``; ``force`` replaces the row even in models that have the token). With
   ``pad_to_multiple_of`` the vocabulary is padded and every padding row is the mean of the
   real rows.

The output's ``vocab_size`` becomes the output tokenizer's vocabulary size (padded), and the
tokenizer is saved with ``save_pretrained`` (so its files are those transformers writes).

Where mergekit's result depends on an arbitrary order (Python's set order of the models, the
hash order of a vocabulary), mergelab uses the order in which models appear in the config and the
order of token ids; so the ids of tokens a union adds may differ from a mergekit run's, while
every token keeps the same row.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mergelab.errors import UserInputError

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEmbedding:
    """Where the row of one token comes from (mergekit's ``tokenizer.tokens.<token>``).

    ``kind``: ``"model"`` (the same token's row in ``model``), ``"model_token"`` (the row of
    ``token``/``token_id`` in ``model``) or ``"zero"``; ``kind=None`` keeps the default rule.
    ``force`` replaces the row in every model, also in those that have the token.
    """

    kind: str | None = None
    model: str | None = None
    token: str | None = None
    token_id: int | None = None
    force: bool = False


@dataclass
class TokenizerPlan:
    """The output tokenizer and, per model (keyed as in the config), output id → model id."""

    tokenizer: Any  # a transformers tokenizer
    permutations: dict[str, dict[int, int]]
    original_vocabs: dict[str, dict[str, int]]
    pad_to_multiple_of: int | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokenizer.get_vocab())

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding: the vocabulary, padded to ``pad_to_multiple_of``."""
        n, m = self.n_tokens, self.pad_to_multiple_of
        return n + (m - n % m) % m if m else n


def load_tokenizer(path: str | Path, **kwargs: Any) -> Any:
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot load the tokenizer of {path}: {exc}") from None


def model_vocab_size(path: str | Path) -> int | None:
    """``vocab_size`` from a model folder's config.json (None when it has none)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = config.get("vocab_size")
    return int(value) if isinstance(value, int) else None


def stripped_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model without the tokens whose id is ≥ the model's ``vocab_size``."""
    import tokenizers

    tokenizer = load_tokenizer(path, use_fast=True)
    vocab = tokenizer.get_vocab()
    vocab_size = model_vocab_size(path) or len(vocab)
    unused = {tok for tok, idx in vocab.items() if idx >= vocab_size}
    if not unused:
        return tokenizer
    if not tokenizer.is_fast:
        raise UserInputError(
            f"the tokenizer of {path} has tokens beyond the model's vocab_size {vocab_size} and "
            "no fast version, so they cannot be stripped (mergekit refuses this too)"
        )
    data = json.loads(tokenizer._tokenizer.to_str())
    if data["model"]["type"] != "BPE":
        raise UserInputError(
            f"the tokenizer of {path} has tokens beyond the model's vocab_size {vocab_size}; "
            f"only BPE tokenizers can be stripped, this one is {data['model']['type']} "
            "(mergekit refuses this too)"
        )
    data["added_tokens"] = [e for e in data["added_tokens"] if e["id"] < vocab_size]
    for tok in unused:
        data["model"]["vocab"].pop(tok, None)

    def keep(merge: Any) -> bool:
        parts = merge.split(" ") if isinstance(merge, str) else list(merge)
        return not any(p in unused for p in parts)

    data["model"]["merges"] = [m for m in data["model"]["merges"] if keep(m)]
    tokenizer._tokenizer = tokenizers.Tokenizer.from_str(json.dumps(data))
    return tokenizer


def union_tokenizer(base_tokenizer: Any, tokenizers: Mapping[str, tuple[Any, int | None]]) -> Any:
    """The base tokenizer plus every other model's tokens it lacks (see the module docstring).

    ``tokenizers``: key -> (tokenizer, the model's vocab_size), base first.
    """
    import transformers

    out_vocab: dict[str, int] = {}
    out_added: dict[str, Any] = {}
    for tokenizer, vocab_size in tokenizers.values():
        vocab_size = vocab_size or tokenizer.vocab_size
        added = tokenizer.added_tokens_decoder
        added_text = {info.content for info in added.values()}
        # in id order: mergekit walks get_vocab()'s hash order, which changes from run to run
        for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
            if idx >= vocab_size or tok in added_text:
                continue
            out_vocab.setdefault(tok, len(out_vocab))
        for idx, info in added.items():
            if idx < vocab_size and info.content not in out_added:
                out_added[info.content] = info
    with tempfile.TemporaryDirectory() as folder:  # a copy, so the base tokenizer is not changed
        base_tokenizer.save_pretrained(folder)
        result = transformers.AutoTokenizer.from_pretrained(folder, use_fast=True)
    base_vocab = base_tokenizer.get_vocab()
    for tok in out_vocab:
        if tok not in out_added and tok not in base_vocab:
            result.add_tokens(tok)
    for info in out_added.values():
        result.add_tokens(info)
    return result


def build_tokenizer(
    base: str,
    models: Mapping[str, str | Path],
    source: str,
    *,
    source_path: str | Path | None = None,
    add_tokens: Sequence[str] = (),
    pad_to_multiple_of: int | None = None,
) -> TokenizerPlan:
    """The output tokenizer and the permutations (module docstring).

    ``models``: key -> model folder for every model of the merge, in config order (``base`` is
    one of the keys); ``source``: ``"base"``, ``"union"`` or ``"model"`` (then ``source_path``
    is the folder whose tokenizer is used).
    """
    base_tokenizer = stripped_tokenizer(models[base])
    loaded: dict[str, Any] = {base: base_tokenizer}
    for key, path in models.items():
        if key != base:
            loaded[key] = load_tokenizer(path)
    if source == "model":
        out = load_tokenizer(source_path)
    elif source == "base":
        out = base_tokenizer
    elif source == "union":
        out = union_tokenizer(
            base_tokenizer, {k: (tok, model_vocab_size(models[k])) for k, tok in loaded.items()}
        )
    else:
        raise UserInputError(f"unknown tokenizer source {source!r}; use base, union or a model")
    existing = set(out.get_vocab())
    for tok in add_tokens:
        if tok not in existing:
            out.add_tokens(tok)
            existing.add(tok)
    vocab_out = out.get_vocab()
    permutations: dict[str, dict[int, int]] = {}
    for key, path in models.items():
        model_vocab = loaded[key].get_vocab()
        vocab_size = model_vocab_size(path) or len(model_vocab)
        p: dict[int, int] = {}
        for tok, new_id in vocab_out.items():
            old = model_vocab.get(tok)
            if old is None:
                p[new_id] = -1
            elif old < vocab_size:
                p[new_id] = old
            # a token whose id is beyond the model's rows (padding) maps nowhere, as in mergekit
        permutations[key] = p
    return TokenizerPlan(
        tokenizer=out,
        permutations=permutations,
        original_vocabs={k: tok.get_vocab() for k, tok in loaded.items()},
        pad_to_multiple_of=pad_to_multiple_of,
    )


def _embedding_sources(
    plan: TokenizerPlan,
    models: list[str],
    base: str | None,
    tokens: dict[str, TokenEmbedding],
) -> tuple[dict[str, TokenEmbedding], set[str]]:
    """Per token that some model lacks: its row's source; and the tokens whose row is a mean."""
    configs = dict(tokens)
    to_average: set[str] = set()
    for tok, tok_id in plan.tokenizer.get_vocab().items():
        if tok in configs:
            continue
        has = [plan.permutations[m].get(tok_id, -1) >= 0 for m in models]
        present = sum(has)
        if present == 1:
            configs[tok] = TokenEmbedding(kind="model", model=models[has.index(True)])
        elif present == 0:
            configs[tok] = TokenEmbedding(kind="zero")
            LOG.warning("token %r is in no model: zero row", tok)
        elif base in models and plan.permutations[base].get(tok_id, -1) >= 0:
            configs[tok] = TokenEmbedding(kind="model", model=base)
        else:
            to_average.add(tok)
    return configs, to_average


def align_vocabulary(
    tensors: Mapping[str, torch.Tensor],
    plan: TokenizerPlan,
    *,
    base: str | None,
    tokens: Mapping[str, TokenEmbedding] | None = None,
    axis: int = 0,
) -> dict[str, torch.Tensor]:
    """Each model's vocabulary tensor re-indexed by the output vocabulary (module docstring).

    ``tensors``: key -> that model's tensor (vocabulary along ``axis``), all one dtype.
    """
    models = list(tensors)
    views = {m: t.movedim(axis, 0) for m, t in tensors.items()}
    vocab = plan.tokenizer.get_vocab()
    n_rows = plan.vocab_size
    first = views[models[0]]
    token_shape = first.shape[1:]
    dtype = first.dtype
    for t in views.values():
        dtype = torch.promote_types(dtype, t.dtype)
    configs, to_average = _embedding_sources(plan, models, base, dict(tokens or {}))

    def missing_somewhere(tok: str, tok_id: int) -> bool:
        cfg = configs.get(tok)
        forced = cfg is not None and cfg.force
        return forced or any(plan.permutations[m].get(tok_id, -1) < 0 for m in models)

    defaults: dict[str, torch.Tensor] = {}
    for tok, tok_id in vocab.items():
        if not missing_somewhere(tok, tok_id):
            continue
        if tok in to_average:
            row = torch.zeros(token_shape, dtype=dtype)
            count = 0
            for m in models:
                old = plan.permutations[m].get(tok_id, -1)
                if old >= 0:
                    row = row + views[m][old]
                    count += 1
            defaults[tok] = row / count
        elif tok in configs:
            defaults[tok] = _default_row(plan, views, tok, tok_id, configs[tok])

    out: dict[str, torch.Tensor] = {}
    for m in models:
        p = plan.permutations[m]
        new = torch.zeros((n_rows, *token_shape), dtype=dtype)
        for tok, tok_id in vocab.items():
            cfg = configs.get(tok)
            forced = cfg is not None and cfg.force
            old = p.get(tok_id, -1)
            if old >= 0 and not forced:
                new[tok_id] = views[m][old]
            elif tok in defaults:
                new[tok_id] = defaults[tok]
            else:
                LOG.error("no row for token %r in model %s", tok, m)
        if n_rows > len(vocab):  # padding rows: the mean of the real rows
            new[len(vocab) :] = torch.mean(new[: len(vocab)], dim=0)
        out[m] = new.movedim(0, axis)
    return out


def _default_row(
    plan: TokenizerPlan,
    views: Mapping[str, torch.Tensor],
    tok: str,
    tok_id: int,
    cfg: TokenEmbedding,
) -> torch.Tensor:
    if cfg.kind == "zero":
        first = next(iter(views.values()))
        return first.new_zeros(first.shape[1:])
    model = cfg.model
    if model not in views:
        raise UserInputError(
            f"token {tok!r} takes its row from model {model}, which is not an input of this tensor"
        )
    if cfg.kind == "model_token":
        src_id = cfg.token_id
        if src_id is None:
            if cfg.token not in plan.original_vocabs[model]:
                raise UserInputError(f"token {cfg.token!r} is not in the vocabulary of {model}")
            src_id = plan.original_vocabs[model][cfg.token]
        if not 0 <= src_id < views[model].shape[0]:
            raise UserInputError(f"token id {src_id} is out of range for {model}")
        return views[model][src_id]
    old = plan.permutations[model].get(tok_id, -1)
    if old < 0:
        raise UserInputError(f"token {tok!r} is not in the vocabulary of {model}")
    return views[model][old]


def set_chat_template(tokenizer: Any, template: str | None, models: Sequence[str | Path]) -> None:
    """mergekit's ``chat_template``: ``"auto"`` (the template most input models share), or the
    template text itself. mergekit's bundled templates by name (chatml, llama3, ...) are not
    shipped with mergelab: give the text instead."""
    if not template:
        return
    if template == "auto":
        found = []
        for path in models:
            try:
                chosen = load_tokenizer(path).chat_template
            except UserInputError:
                continue
            if isinstance(chosen, dict):
                chosen = chosen.get("default")
            if chosen:
                found.append(chosen.strip())
        if not found:
            return
        template = max(found, key=found.count)  # the first of the most common, as Counter does
    elif len(template) < 20 or "{" not in template:
        raise UserInputError(chat_template_refusal(template))
    tokenizer.chat_template = template


def chat_template_refusal(template: str) -> str:
    if len(template) < 256 and "\n" not in template and "{" not in template:
        return (
            f"chat_template {template!r}: mergekit's bundled templates by name are not shipped "
            "with mergelab; put the template text (Jinja) in chat_template, or use 'auto'"
        )
    return f"chat_template {template[:40]!r}...: not a Jinja chat template (no '{{')"
