"""Training for the mini-scale study, nanoGPT-sized: pretrain a small LM, fine-tune experts.

* :func:`new_mini_model` — a ~1M-parameter Llama (:func:`mergelab.tiny.tiny_llama`) for a tokenizer.
* :func:`pretrain` — next-token loss on a packed stream of documents separated by EOS.
* :func:`finetune` — supervised fine-tuning on (prompt, target) items, loss on the target and the
  final EOS only; full fine-tuning, or LoRA when ``lora`` is given (returns a PEFT model).

Both run :func:`mergelab.tiny.train` (AdamW, linear warmup then cosine decay, gradient clipping at
1), seeded and with progress bars; batches go to the device of the model's parameters.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from mergelab.tiny import tiny_llama, train, warmup_cosine_lr

# The study's model: hidden 128, 4 layers, 4 heads, MLP 384, tied embeddings (~1M parameters).
MINI_SIZES = dict(
    hidden_size=128, num_layers=4, num_heads=4, intermediate_size=384, max_positions=256
)


def new_mini_model(tokenizer, *, seed: int = 0, **sizes):
    """A randomly initialised mini Llama for ``tokenizer`` (``sizes`` override :data:`MINI_SIZES`),
    in train mode."""
    model = tiny_llama(tokenizer, seed=seed, tie_word_embeddings=True, **{**MINI_SIZES, **sizes})
    return model.train()


def _train_stream(model, batches, *, steps: int, lr: float, desc: str) -> list[float]:
    """The study's loop: AdamW (betas 0.9/0.98), warmup over 5% of the steps, clip at 1."""
    device = next(model.parameters()).device

    def loss_fn(model, batch):
        input_ids, attention_mask, labels = (t.to(device) for t in batch)
        return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    schedule = warmup_cosine_lr(lr, steps, warmup=max(1, steps // 20))
    return train(
        model,
        batches,
        loss_fn,
        lr=lr,
        steps=steps,
        betas=(0.9, 0.98),
        lr_schedule=schedule,
        clip_grad_norm=1.0,
        progress=desc,
    )


def pretrain(
    model,
    tokenizer,
    documents: Sequence[str],
    *,
    steps: int,
    batch_size: int = 32,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train ``model`` in place on random windows of the EOS-separated documents; returns losses."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    stream = torch.tensor(ids, dtype=torch.long)
    if len(stream) <= seq_len + 1:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than one window ({seq_len})")
    gen = torch.Generator().manual_seed(seed)

    def batches():
        while True:
            starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
            x = torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
            yield x, torch.ones_like(x), x

    torch.manual_seed(seed)
    return _train_stream(model, batches(), steps=steps, lr=lr, desc="pretrain")


def sft_batch(tokenizer, items: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) ``[batch, seq]``; labels are −100 on the
    prompt and padding so that only ``target`` + EOS is learned."""
    rows = []
    for it in items:
        p = tokenizer(it["prompt"], add_special_tokens=False)["input_ids"]
        t = tokenizer(it["target"], add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        rows.append((p + t, [-100] * len(p) + t))
    width = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        input_ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return input_ids, mask, labels


def finetune(
    model,
    tokenizer,
    items: Sequence[dict],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    lora: dict | None = None,
    desc: str = "finetune",
    replay_documents: Sequence[str] = (),
    replay_fraction: float = 0.0,
):
    """Fine-tune on (prompt, target) items. Full fine-tuning trains ``model`` in place and returns
    it; with ``lora`` (kwargs for ``peft.LoraConfig``) a PEFT model wrapping ``model`` is trained
    and returned (``model``'s own weights are left unchanged). Returns ``(model, losses)``.

    ``replay_fraction`` of each batch is drawn from ``replay_documents`` (pretraining text, loss on
    every token): replay keeps the expert close to the base away from its skill, which is what
    the factorisation assumption of logit composition asks for."""
    if not items:
        raise ValueError("finetune needs at least one item")
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    rng = random.Random(seed)

    n_replay = round(replay_fraction * batch_size) if replay_documents else 0
    replay = [{"prompt": "", "target": d} for d in replay_documents]

    def batches():
        while True:
            rows = [rng.choice(items) for _ in range(batch_size - n_replay)]
            yield sft_batch(tokenizer, rows + [rng.choice(replay) for _ in range(n_replay)])

    torch.manual_seed(seed)
    losses = _train_stream(model, batches(), steps=steps, lr=lr, desc=desc)
    return model, losses
