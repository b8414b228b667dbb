"""Everything that decides the LLM study's numbers (saved in results.json), per scale."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from mergelab.compose import EOS_POLICIES

SCALES = ("mini", "smollm2", "paper")


@dataclass
class StudyConfig:
    """The study's settings; ``scale_config`` fills in each scale's defaults."""

    scale: str = "mini"
    seed: int = 0
    # synthetic data (mini, smollm2)
    n_train: int = 4000
    n_validation: int = 20
    n_test: int = 60
    pretrain_docs: int = 20000
    # mini model and training
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 256
    pretrain_steps: int = 800
    pretrain_lr: float = 3e-3
    expert_steps: int = 400
    expert_lr: float = 1e-3
    batch_size: int = 32
    expert_replay: float = 0.0  # share of each fine-tuning batch that is pretraining text
    lora: bool = True
    lora_rank: int = 8
    lora_steps: int = 250
    lora_lr: float = 3e-3
    # decoding and evaluation
    max_new_tokens: int = 64
    gen_batch_size: int = 30
    bootstrap_samples: int = 2000
    sandbox_workers: int = 2
    limit: int | None = None  # test items per benchmark (None: all)
    # candidates
    composition_weights: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0)
    task_arithmetic_lambdas: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)
    # TIES and DARE-TIES: λ (and TIES density) chosen on validation like task arithmetic; the
    # grids hold the papers' defaults (TIES k = 20%, λ = 1) and a milder setting.
    ties_lambdas: tuple[float, ...] = (0.5, 0.7, 1.0)
    ties_densities: tuple[float, ...] = (0.2, 0.5)
    dare_lambdas: tuple[float, ...] = (0.5, 0.7, 1.0)
    dare_density: float = 0.5  # DARE keep rate (drop p = 0.5; p = 0.9 wrecks experts this small)
    # extra experiments
    three_experts: bool = True
    eos_policies: tuple[str, ...] = EOS_POLICIES
    termination_items: int | None = None  # test items per benchmark in the 2-vs-3 study (None: all)
    # Remedies for premature termination with 3 experts, chosen on validation: expert weights
    # (w = 1/(k−1) = 0.5 keeps the base's exponent 1 − Σw at −0.5 instead of −2) × EOS policy.
    remedy_weights: tuple[float, ...] = (0.5, 0.75, 1.0)
    diagnostics: bool = True
    fresh_mixed: bool = True  # the held-out mixed variant, evaluated once on test
    n_fresh: int = 60
    # smollm2 / paper: local files
    gguf_path: str | None = None
    humaneval_items: int | None = None  # smollm2: first N HumanEval problems (None: all 164)
    humaneval_max_new_tokens: int = 128
    base_path: str | None = None
    math_path: str | None = None
    code_path: str | None = None
    third_path: str | None = None
    gsm8k: str | None = None
    math_data: str | None = None
    humaneval_plus: str | None = None
    mbpp_plus: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # where models train and decode: "auto" = cuda if available, else cpu

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Each scale's departures from the defaults.
SCALE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mini": {},
    # Sized to run in about an hour on a 2-core CPU (one torch thread): the LoRA loss flattens
    # within a few dozen steps on a pretrained LM, and the per-candidate cost is generation, so
    # the test sets and the 2-vs-3 study are smaller than at mini scale.
    "smollm2": {
        "n_test": 40,
        "lora_steps": 40,
        "lora_lr": 1e-3,
        "batch_size": 8,
        "gen_batch_size": 20,
        "composition_weights": (0.5, 1.0, 1.5),
        "task_arithmetic_lambdas": (0.5, 1.0),
        "ties_lambdas": (0.5, 1.0),
        "ties_densities": (0.2,),
        "dare_lambdas": (0.5, 1.0),
        "eos_policies": ("plain", "base", "most_confident"),
        "remedy_weights": (0.5, 1.0),
        "termination_items": 20,
        "humaneval_items": 40,
        "n_fresh": 40,
    },
    # The paper's decoding: greedy, 512 new tokens; validation = first items of each file.
    "paper": {
        "max_new_tokens": 512,
        "gen_batch_size": 16,
        "n_validation": 50,
        "lora": False,
        "three_experts": False,
        "fresh_mixed": False,
        "dtype": "bfloat16",
        "bootstrap_samples": 10_000,
    },
}


def scale_config(scale: str, **overrides: Any) -> StudyConfig:
    """The defaults of each scale, then ``overrides``."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {SCALES}")
    fields = {f.name for f in dataclasses.fields(StudyConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown StudyConfig fields {unknown}; known: {sorted(fields)}")
    return StudyConfig(**{"scale": scale, **SCALE_DEFAULTS[scale], **overrides})


def parse_value(text: str) -> Any:
    """A ``--set key=value`` value: JSON when it parses (lists become tuples), else the text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return tuple(value) if isinstance(value, list) else value


def study_device(cfg: StudyConfig) -> torch.device:
    """The torch device of the study: ``cfg.device``, with "auto" = CUDA when present."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} requested but CUDA is not available")
    return device
