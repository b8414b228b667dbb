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
    # the benchmarks of the 2-vs-3 study (None: every test set and the third skill's)
    termination_benchmarks: tuple[str, ...] | None = None
    # Does lengthening outputs restore accuracy? The 2- and 3-expert compositions once more with
    # EOS ruled out until the shortest reference solution's length (in tokens) of each
    # benchmark: no correct answer is cut off, and every output is at least that long.
    min_length_test: bool = True
    lora_composition_row: bool = True  # the LoRA composition as a main-table row
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
    # The LoRA loss flattens within a few dozen steps on a pretrained LM; the cost is generation.
    # Test sets of 150 items: the exact McNemar test then detects a 15-point difference between
    # two candidates with 80% power when up to 40% of the pairs are discordant (the committed
    # n = 40 runs had 15-50% for composition vs task arithmetic and vs the experts;
    # docs/llm_power.md, mergelab.eval.stats.mcnemar_power). HumanEval: the first 100 problems
    # (every candidate scores 0-8% there, so few pairs are discordant). The 2-vs-3 study runs on
    # 30 items of each synthetic set (HumanEval left out; 90 pairs over 3 seeds), and the LoRA
    # composition row, which is the same function as the composition (identical outcomes at
    # n = 40, seeds 0 and 1), is left out: a seed needs about 2.5 CPU-hours as it is.
    "smollm2": {
        "n_test": 150,
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
        "termination_items": 30,
        "termination_benchmarks": ("math", "code", "mixed", "count"),
        "lora_composition_row": False,
        "humaneval_items": 100,
        "n_fresh": 100,
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
