"""Tiny GPT-2 models and a short training loop (nanoGPT-style: one screen, no trainer framework)."""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from .tasks import IGNORE


def tiny_gpt2(
    vocab_size: int,
    *,
    n_positions: int = 160,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    dropout: float = 0.0,
    seed: int = 0,
) -> GPT2LMHeadModel:
    """The authors' toy architecture: GPT-2, 2 layers, 2 heads, width 64 (about 110k params).

    ``n_positions`` only sizes the learned position table; 160 lets the generative protocol
    (``x [SEP] y [EOS]``) reach input length 64 at test time. Dropout 0 by default (the tiny
    tasks need no regularisation and 0 makes training deterministic given the seed).
    """
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


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


def train_model(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    cfg: TrainConfig,
    *,
    params: list[torch.nn.Parameter] | None = None,
) -> dict:
    """Train in place with AdamW on cross-entropy of ``logits[:, t]`` vs ``labels[:, t]``.

    ``input_ids`` and ``labels`` are ``[N, T]`` (labels already aligned to the logits, ``-100``
    = ignored; see :mod:`.tasks`). Right padding needs no attention mask: a causal model never
    lets a padded tail influence earlier positions (a mask is passed anyway). Returns ``{"final_loss", "steps", "seconds"}``
    and leaves the model in eval mode.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    params = params if params is not None else [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    pad_id = model.config.pad_token_id
    model.train()
    t0, steps, running = time.perf_counter(), 0, None
    for _ in range(cfg.epochs):
        order = torch.randperm(input_ids.shape[0], generator=gen)
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i : i + cfg.batch_size]
            batch = input_ids[idx]
            mask = (batch != pad_id).long()  # pad never occurs inside a toy sequence
            logits = model(input_ids=batch, attention_mask=mask).logits  # [B, T, V]
            loss = F.cross_entropy(logits.flatten(0, 1), labels[idx].flatten(), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
            running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
    model.eval()
    return {"final_loss": running, "steps": steps, "seconds": time.perf_counter() - t0}


def finetune_full(
    base: torch.nn.Module, input_ids, labels, cfg: TrainConfig
) -> tuple[torch.nn.Module, dict]:
    """Copy of ``base`` fine-tuned on all parameters (shared initialisation → task vectors)."""
    model = copy.deepcopy(base)
    log = train_model(model, input_ids, labels, cfg)
    return model, log


LORA_TARGETS = ("c_attn", "c_proj", "c_fc")


def finetune_lora(
    base: torch.nn.Module, input_ids, labels, cfg: TrainConfig, *, rank: int = 8, alpha: int = 16
) -> tuple[torch.nn.Module, dict]:
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
    log = train_model(peft_model, input_ids, labels, cfg)
    log["trainable_params"] = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return peft_model.merge_and_unload().eval(), log
