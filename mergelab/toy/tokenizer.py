"""A character tokenizer built offline with the ``tokenizers`` library (no hub access).

Every character is one token. Ids: ``[PAD]=0, [EOS]=1, [SEP]=2``, then space, then ``A``–``Z``
(the authors' 27-symbol alphabet), then any ``extra_chars`` (span markers for the sequential-skill
task). Decoding is exact: ``decode(encode(s)) == s`` for any string over the alphabet.
"""

from __future__ import annotations

import string

from transformers import PreTrainedTokenizerFast

from mergelab.tiny import char_tokenizer

LETTERS = string.ascii_uppercase
ALPHABET = " " + LETTERS  # the authors' 27 symbols


def build_char_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """Return a ``PreTrainedTokenizerFast`` over space + A–Z + ``extra_chars`` (one token each).

    Vocab size is ``3 + 27 + len(extra_chars)``. ``add_special_tokens`` adds nothing (no BOS/EOS
    is inserted implicitly); the tasks place SEP and EOS themselves.
    """
    chars = ALPHABET + extra_chars
    if len(set(chars)) != len(chars):
        raise ValueError(f"extra_chars {extra_chars!r} repeat a character of the alphabet")
    if any(len(c.encode()) != 1 or c in "[]" for c in extra_chars):
        # "[" would let a string like "[SEP]" read as the special token.
        raise ValueError(
            f"extra_chars must be single ASCII characters other than [ ], got {extra_chars!r}"
        )
    return char_tokenizer(
        chars, pad="[PAD]", eos="[EOS]", bos=None, sep="[SEP]", padding_side="right"
    )


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Ids of ``text``, one per character; raises on a character outside the alphabet."""
    vocab = tokenizer.get_vocab()
    bad = sorted({c for c in text if c not in vocab})
    if bad:
        raise ValueError(f"characters {bad} are not in the toy alphabet")
    return tokenizer(text, add_special_tokens=False)["input_ids"]
