"""A character-level tokenizer for the mini scale, built offline with the ``tokenizers`` library.

One token per printable ASCII character plus ``<pad>`` (id 0), ``<eos>`` (id 1) and ``<unk>`` (id 2);
it is a regular ``PreTrainedTokenizerFast`` (``save_pretrained`` / ``from_pretrained`` work), so
every mergelab component treats it like any Hugging Face tokenizer.
"""

from __future__ import annotations

import string

from transformers import PreTrainedTokenizerFast

from mergelab.char_tokenizer import char_tokenizer as build_char_tokenizer

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>"}
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))


def char_tokenizer() -> PreTrainedTokenizerFast:
    # Decoder-only generation pads on the left.
    return build_char_tokenizer(CHARACTERS, SPECIAL_TOKENS, padding_side="left")
