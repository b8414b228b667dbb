"""The mini scale's character tokenizer: printable ASCII, ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2.

Built by :func:`mergelab.tiny.char_tokenizer`; a regular ``PreTrainedTokenizerFast``
(``save_pretrained`` / ``from_pretrained`` work), so every mergelab component treats it like any
Hugging Face tokenizer.
"""

from __future__ import annotations

import string

from mergelab import tiny

CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))


def mini_tokenizer():
    """The study's tokenizer; left padding, as decoder-only batched generation wants."""
    return tiny.char_tokenizer(CHARACTERS, bos=None, unk="<unk>", padding_side="left")
