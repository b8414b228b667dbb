"""Training recipes of the toy study, on :mod:`mergelab.tiny`'s GPT-2 builder and training loop.

Every model is trained on ``(input_ids, labels)`` with ``labels[:, t]`` the token the logits at
``t`` predict (``-100`` = no loss), so one loop serves the aligned and the generative protocol.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from mergelab.tiny import running_loss, tiny_gpt2, train
from mergelab.toy.tasks import IGNORE

__all__ = ["TrainConfig", "finetune_full", "finetune_lora", "tiny_gpt2", "train_model"]


@dataclass
class TrainConfig:
    """The authors' settings are ``epochs=5, batch_size=1, lr=3e-4`` (AdamW, no schedule)."""

    epochs: int = 5
    batch_size: int = 1
    lr: float = 3e-4
    weight_decay: float = 0.0
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _batches(n: int, cfg: TrainConfig) -> Iterator[torch.Tensor]:
    """Row indices of each batch: a fresh random order every epoch, drawn from ``cfg.seed``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, cfg.batch_size):
            yield order[i : i + cfg.batch_size]


def train_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: TrainConfig,
) -> dict:
    """Train in place (AdamW) on cross-entropy of ``logits[:, t]`` vs ``labels[:, t]``.

    ``input_ids`` and ``labels`` are ``[N, T]``, right-padded. A causal model never lets a padded
    tail change earlier positions; the mask is passed anyway. Returns ``{"final_loss", "steps"}``
    (the loss an exponential moving average) and leaves the model in eval mode.
    """
    pad_id = model.config.pad_token_id

    def loss_fn(m, idx):
        batch = input_ids[idx]
        logits = m(input_ids=batch, attention_mask=(batch != pad_id).long()).logits  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), labels[idx].flatten(), ignore_index=IGNORE)

    losses = train(
        model, _batches(input_ids.shape[0], cfg), loss_fn, lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    return {"final_loss": running_loss(losses), "steps": len(losses)}


def finetune_full(base: torch.nn.Module, input_ids, labels, cfg: TrainConfig) -> torch.nn.Module:
    """A copy of ``base`` fine-tuned on all parameters (shared initialisation → task vectors)."""
    model = copy.deepcopy(base)
    train_model(model, input_ids, labels, cfg)
    return model


LORA_TARGETS = ("c_attn", "c_proj", "c_fc")


def finetune_lora(
    base: torch.nn.Module, input_ids, labels, cfg: TrainConfig, *, rank: int = 8, alpha: int = 16
) -> torch.nn.Module:
    """LoRA fine-tune of a copy of ``base`` (peft; attention and MLP projections of every block).

    Returns the adapter merged into a plain model (``merge_and_unload``), so the expert's task
    vector is exactly ``B A`` per projection and every weight merge treats it like a full one.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(LORA_TARGETS),
        fan_in_fan_out=True,  # GPT-2's Conv1D stores weights as [in, out]
        init_lora_weights=True,
    )
    torch.manual_seed(cfg.seed)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    train_model(peft_model, input_ids, labels, cfg)
    return peft_model.merge_and_unload().eval()
