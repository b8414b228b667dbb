"""Tiny models for tests, the demo and the studies: one character tokenizer, GPT-2 and Llama
builders, and one short training loop — all offline (nothing from a model hub), nanoGPT-sized.

* :func:`char_tokenizer` — one token per character; ids ``<pad>`` = 0, ``<eos>`` = 1, then the
  optional ``bos`` / ``sep`` / ``unk`` tokens (in that order, those that are given) from id 2,
  then the characters in order.
* :func:`tiny_gpt2`, :func:`tiny_llama` — randomly initialised causal LMs built from a config,
  seeded; :func:`tiny_causal_lm` picks one of the two by name (tests parametrise over it).
* :func:`train` — AdamW/Adam over a stream of batches with an optional learning-rate schedule,
  gradient clipping, a parameter subset and a progress bar; :func:`warmup_cosine_lr` is the
  schedule the mini LLM study uses.

Same arguments and seed give bit-identical tokenizers, models and training runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

DEFAULT_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;=+-*/()?!\n"
PAD_ID, EOS_ID = 0, 1  # every tiny tokenizer and model in mergelab


def char_tokenizer(
    characters: str | Sequence[str] = DEFAULT_ALPHABET,
    *,
    pad: str = "<pad>",
    eos: str = "<eos>",
    bos: str | None = "<bos>",
    sep: str | None = None,
    unk: str | None = None,
    padding_side: str = "right",
):
    """A ``PreTrainedTokenizerFast`` with one token per character.

    Ids: ``pad`` = 0, ``eos`` = 1, then ``bos``, ``sep``, ``unk`` (those not ``None``, in that
    order) from 2, then ``characters`` in order (a repeated character is kept once). No special
    token is inserted when encoding, and ``decode(encode(s)) == s`` for any string over the
    alphabet (newlines included). A character outside the alphabet maps to ``unk`` when there is
    one; otherwise encoding it raises. Decoder-only batched generation wants
    ``padding_side="left"``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    roles = {"pad_token": pad, "eos_token": eos, "bos_token": bos, "sep_token": sep}
    roles["unk_token"] = unk
    special = {role: token for role, token in roles.items() if token is not None}
    chars = list(dict.fromkeys(characters))
    tokens = list(special.values()) + chars
    if len(set(tokens)) != len(tokens):
        raise ValueError("a special token repeats or is also one of the characters")
    vocab = {token: i for i, token in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # every character is a word
    core.decoder = decoders.Fuse()  # join the characters back without separators
    return PreTrainedTokenizerFast(tokenizer_object=core, padding_side=padding_side, **special)


def _special_ids(vocab: int | Any, pad_token_id, eos_token_id, bos_token_id) -> dict:
    """Vocabulary size and special ids: from a tokenizer, or the tiny scheme for a size."""
    if isinstance(vocab, int):
        ids = {"pad_token_id": pad_token_id, "eos_token_id": eos_token_id}
        ids["bos_token_id"] = eos_token_id if bos_token_id is None else bos_token_id
        return {"vocab_size": vocab, **ids}
    eos = vocab.eos_token_id
    bos = vocab.bos_token_id if vocab.bos_token_id is not None else eos
    return {
        "vocab_size": len(vocab),
        "pad_token_id": vocab.pad_token_id,
        "eos_token_id": eos,
        "bos_token_id": bos,
    }


def _build(architecture: str, vocab, ids: tuple, seed: int, **config_fields):
    """Seed, then build ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` from its config, in eval mode."""
    import transformers

    config_class, model_class = {
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[architecture]
    config = config_class(**_special_ids(vocab, *ids), **config_fields)
    torch.manual_seed(seed)
    model = model_class(config)
    model.config.architectures = [model_class.__name__]
    return model.eval()


def tiny_gpt2(
    vocab: int | Any,
    *,
    n_positions: int = 160,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
    initializer_range: float = 0.02,
    pad_token_id: int | None = PAD_ID,
    eos_token_id: int = EOS_ID,
    bos_token_id: int | None = None,
    **config_overrides,
):
    """A randomly initialised ``GPT2LMHeadModel`` in eval mode (defaults: the toy studies' model,
    2 layers, 2 heads, width 64, about 110k parameters).

    ``vocab`` is a vocabulary size (special ids then default to pad 0, eos 1, bos = eos) or a
    tokenizer (size and special ids from it). ``n_positions`` only sizes the position table;
    dropout 0 makes training deterministic given the seed. A larger ``initializer_range`` (e.g.
    0.3) gives peaked next-token distributions, so greedy decoding is less tie-prone in tests.
    """
    return _build(
        "gpt2",
        vocab,
        (pad_token_id, eos_token_id, bos_token_id),
        seed,
        n_positions=n_positions,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        initializer_range=initializer_range,
        **config_overrides,
    )


def tiny_llama(
    vocab: int | Any,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    max_positions: int = 256,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    initializer_range: float = 0.02,
    pad_token_id: int | None = PAD_ID,
    eos_token_id: int = EOS_ID,
    bos_token_id: int | None = None,
    **config_overrides,
):
    """A randomly initialised ``LlamaForCausalLM`` in eval mode.

    ``vocab`` as in :func:`tiny_gpt2`. ``num_key_value_heads`` defaults to ``num_heads`` (no
    grouped-query attention) and ``intermediate_size`` to ``2 * hidden_size``. The mini LLM study
    uses ``hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384,
    tie_word_embeddings=True`` (about 1M parameters).
    """
    return _build(
        "llama",
        vocab,
        (pad_token_id, eos_token_id, bos_token_id),
        seed,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads if num_key_value_heads is None else num_key_value_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        **config_overrides,
    )


def tiny_causal_lm(
    vocab: int | Any,
    *,
    architecture: str = "gpt2",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    max_positions: int = 256,
    seed: int = 0,
    **kwargs,
):
    """:func:`tiny_gpt2` or :func:`tiny_llama` (``architecture``) under common size names —
    hidden 32, 2 layers, 2 heads, 256 positions by default; other keywords go to the builder."""
    if architecture == "gpt2":
        return tiny_gpt2(
            vocab,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_positions=max_positions,
            seed=seed,
            **kwargs,
        )
    if architecture == "llama":
        return tiny_llama(
            vocab,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            max_positions=max_positions,
            seed=seed,
            **kwargs,
        )
    raise ValueError(f"unknown architecture {architecture!r}; use 'gpt2' or 'llama'")


def warmup_cosine_lr(lr: float, steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps, then cosine decay from ``lr`` to ``0.1 * lr``."""

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    return lr_at


def train(
    model: torch.nn.Module,
    batches: Iterable,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    *,
    lr: float,
    steps: int | None = None,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    lr_schedule: Callable[[int], float] | None = None,
    clip_grad_norm: float | None = None,
    params: Iterable[torch.nn.Parameter] | None = None,
    progress: str | None = None,
) -> list[float]:
    """Train ``model`` in place; returns the loss of every step and leaves it in eval mode.

    Each step takes the next item of ``batches`` and minimises ``loss_fn(model, batch)`` (a scalar
    tensor); training stops after ``steps`` steps or when ``batches`` ends (``steps=None``).
    ``optimizer`` is "adamw" (with ``weight_decay``) or "adam"; ``lr_schedule(step)`` sets the
    learning rate before each step; ``clip_grad_norm`` clips the global gradient norm;
    ``params`` restricts training to a subset (default: every parameter that requires grad);
    ``progress`` is the label of a progress bar (none when ``None``).
    """
    params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    elif optimizer == "adam":
        if weight_decay:
            raise ValueError("weight_decay needs optimizer='adamw' (decoupled decay)")
        opt = torch.optim.Adam(params, lr=lr, betas=betas)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; use 'adamw' or 'adam'")
    iterator = iter(batches)
    bar = None
    if progress is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress, leave=False, mininterval=2.0)
    model.train()
    losses: list[float] = []
    try:
        while steps is None or len(losses) < steps:
            try:
                batch = next(iterator)
            except StopIteration:
                if steps is not None:
                    raise ValueError(
                        f"batches ran out after {len(losses)} of {steps} steps"
                    ) from None
                break
            if lr_schedule is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_schedule(len(losses))
            loss = loss_fn(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
            opt.step()
            losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                if len(losses) % 20 == 1:
                    bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        if bar is not None:
            bar.close()
    model.eval()
    return losses


def running_loss(losses: Sequence[float]) -> float | None:
    """Exponential moving average of ``losses`` (weight 0.02 on each new loss); ``None`` if empty."""
    running = None
    for loss in losses:
        running = loss if running is None else 0.98 * running + 0.02 * loss
    return running
