"""Tiny, offline stand-ins for tests, benchmarks and toy studies: a character-level tokenizer and
randomly initialised GPT-2 / Llama causal LMs built from a config (nothing from a model hub)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

DEFAULT_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;=+-*/()?!\n"


def char_tokenizer(alphabet: str | Sequence[str] = DEFAULT_ALPHABET):
    """A ``PreTrainedTokenizerFast`` with one token per character and ``<pad> <bos> <eos>``.

    Ids: 0 = ``<pad>``, 1 = ``<bos>``, 2 = ``<eos>``, then the alphabet in order. No BOS is
    added when encoding (like GPT-2's tokenizer); a character outside the alphabet is an error.
    """
    from mergelab.char_tokenizer import char_tokenizer as build

    return build(
        list(dict.fromkeys(alphabet)),
        {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"},
        padding_side="right",
    )


def tiny_causal_lm(
    vocab_size: int,
    *,
    architecture: str = "gpt2",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    eos_token_id: int = 2,
    initializer_range: float = 0.02,
    **config_overrides,
):
    """A randomly initialised causal LM in eval mode (``architecture``: "gpt2" or "llama").

    A larger ``initializer_range`` (e.g. 0.3) gives peaked next-token distributions, which makes
    greedy decoding less tie-prone in tests. ``config_overrides`` go to the config as they are
    (e.g. ``num_key_value_heads=1, intermediate_size=48`` for a grouped-query Llama).
    """
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=vocab_size,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        initializer_range=initializer_range,
    )
    if architecture == "gpt2":
        config_class, model_class = GPT2Config, GPT2LMHeadModel
        sizes = dict(
            n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=max_positions
        )
    elif architecture == "llama":
        config_class, model_class = LlamaConfig, LlamaForCausalLM
        sizes = dict(
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_positions,
        )
    else:
        raise ValueError(f"unknown architecture {architecture!r}; use 'gpt2' or 'llama'")
    torch.manual_seed(seed)
    model = model_class(config_class(**{**common, **sizes, **config_overrides}))
    model.config.architectures = [type(model).__name__]
    return model.eval()
