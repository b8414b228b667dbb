"""A character-level tokenizer for the mini scale, built offline with the ``tokenizers`` library.

One token per printable ASCII character plus ``<pad>`` (id 0), ``<eos>`` (id 1) and ``<unk>`` (id 2);
it is a regular ``PreTrainedTokenizerFast`` (``save_pretrained`` / ``from_pretrained`` work), so
every mergelab component treats it like any Hugging Face tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARACTERS = sorted(set(string.printable) - set("\x0b\x0c\r"))


def char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a word
    tok.decoder = decoders.Fuse()  # join characters back without separators
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",  # decoder-only generation pads on the left
    )
