"""One character-level tokenizer builder for every tiny model in mergelab (tests, toy studies,
the mini LLM study), built offline with the ``tokenizers`` library — nothing from a hub.

The result is a regular ``PreTrainedTokenizerFast`` (``save_pretrained``/``from_pretrained``
work), so every component treats it like any Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def char_tokenizer(
    characters: str | Sequence[str],
    special_tokens: Mapping[str, str],
    *,
    padding_side: str = "left",
) -> PreTrainedTokenizerFast:
    """One token per character; ids are the special tokens in the given order, then ``characters``.

    ``special_tokens`` maps a role to its token, e.g. ``{"pad_token": "<pad>", "eos_token":
    "<eos>"}``; an ``unk_token`` entry makes unknown characters map to it, otherwise encoding an
    unknown character raises. No special token is inserted implicitly when encoding, and
    ``decode(encode(s)) == s`` for any string over the alphabet (newlines included).
    """
    chars = list(characters)
    if len(set(chars)) != len(chars):
        raise ValueError("characters repeat")
    tokens = list(special_tokens.values()) + chars
    if len(set(tokens)) != len(tokens):
        raise ValueError("a special token is also one of the characters")
    vocab = {token: i for i, token in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special_tokens.get("unk_token")))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a word
    core.decoder = decoders.Fuse()  # join the characters back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=core, padding_side=padding_side, **dict(special_tokens)
    )
