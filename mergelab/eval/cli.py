"""mergelab eval: evaluate a candidate, compare two results, check a benchmark's data.

    mergelab eval run --model merged/ --benchmark humaneval --limit 20 --out results/he-merged
    mergelab eval run --model base/ --benchmark gsm8k --data gsm8k_test.jsonl --n-shots 8
    mergelab eval run --spec compose.yaml --benchmark humaneval+ --sample --temperature 0.8 \
        --top-p 0.95 --n-samples 10 --pass-k 1 --pass-k 10 --evalplus-samples samples.jsonl
    mergelab eval compare results/he-merged results/he-base
    mergelab eval canonical --benchmark humaneval+ --data HumanEvalPlus.jsonl.gz

``run`` evaluates a local transformers folder (``--model``) or any candidate a spec file names
(``--spec``: one model, a composition of a base and experts, or a merge made in memory; the format
is in :mod:`mergelab.eval.spec`, the same file ``lm_eval --model mergelab`` takes), offline.
Decoding is greedy unless ``--sample``; ``--n-samples`` completions per item give pass@k for
every ``--pass-k``. ``canonical`` runs every item's reference solution through the tests in the
sandbox: a check of the data file and of the sandbox on this machine (all should pass).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mergelab.compose.cli import positive_int
from mergelab.eval.scoring_math import MATH_CHECKERS
from mergelab.plugins import add_plugin_argument, load_from_args


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval",
        help="evaluate candidates on math and code benchmarks",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="eval_command", required=True)

    run = sub.add_parser("run", help="evaluate a saved model, a composition or a merge")
    which = run.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="local transformers model folder")
    which.add_argument(
        "--spec", help="candidate spec file (model, composition or merge; see mergelab.eval.spec)"
    )
    run.add_argument("--tokenizer", help="tokenizer folder (default: the model's / base's)")
    run.add_argument("--name", help="row label (default: the folder name or the formula)")
    run.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the spec's, else cpu)")
    run.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights' dtype (default: the spec's, else as transformers loads the checkpoint)",
    )
    _benchmark_args(run)
    run.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=512,
        help="most tokens generated per answer (default 512)",
    )
    run.add_argument(
        "--batch-size", type=positive_int, default=8, help="prompts decoded together (default 8)"
    )
    run.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    run.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    run.add_argument("--top-p", type=float, help="nucleus sampling: keep this much mass")
    run.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    run.add_argument(
        "--n-samples", type=positive_int, default=1, help="completions per item (needs --sample)"
    )
    run.add_argument(
        "--pass-k",
        type=positive_int,
        action="append",
        help="k of pass@k for code, each <= --n-samples (repeat; default 1)",
    )
    run.add_argument("--n-shots", type=int, help="few-shot examples (default: the protocol's)")
    run.add_argument(
        "--chat-template",
        choices=["never", "auto", "always"],
        default="never",
        help="wrap prompts in the tokenizer's chat template: never (default), when it has one "
        "(auto), or always",
    )
    run.add_argument("--strict", action="store_true", help="GSM8K: strict '####' extraction")
    run.add_argument(
        "--math-checker",
        choices=list(MATH_CHECKERS),
        default="hybrid",
        help="MATH answers: math-verify plus MATH's string normalisation (hybrid, default), "
        "math-verify alone, or mergelab's own checker (docs/evaluators.md)",
    )
    run.add_argument("--timeout", type=float, default=10.0, help="seconds per test program")
    run.add_argument(
        "--workers", type=positive_int, help="parallel test programs (default: all cores)"
    )
    run.add_argument(
        "--isolation",
        choices=["namespaces", "weak"],
        default="namespaces",
        help="sandbox for generated code: 'namespaces' (default) is refused where the kernel "
        "has none; 'weak' = resource limits and a socket guard only, programs run as you",
    )
    run.add_argument(
        "--cache-dir",
        default="results/eval_cache",
        help="generations cached here, keyed on candidate and settings (default "
        "results/eval_cache)",
    )
    run.add_argument(
        "--out", "-o", dest="output", help="results folder (summary.json, items.jsonl)"
    )
    run.add_argument(
        "--evalplus-samples",
        help="code benchmarks: also write the samples as EvalPlus's samples.jsonl here",
    )
    run.add_argument(
        "--force", action="store_true", help="replace an existing --out that mergelab wrote"
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed (sample j of an item uses seed + j) and bootstrap seed",
    )
    run.set_defaults(func=_run)
    _sandbox_args(run)

    cmp = sub.add_parser("compare", help="paired comparison of two results folders")
    cmp.add_argument("result_a", help="results folder of the first candidate")
    cmp.add_argument("result_b", help="results folder of the second candidate")
    cmp.add_argument("--metric", help="default: the primary metric of result_a")
    cmp.add_argument(
        "--n-boot", type=int, default=10_000, help="bootstrap resamples (default 10000)"
    )
    cmp.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    cmp.set_defaults(func=_compare)

    canon = sub.add_parser("canonical", help="run reference solutions through the sandbox")
    _benchmark_args(canon)
    canon.add_argument(
        "--workers", type=positive_int, help="parallel test programs (default: all cores)"
    )
    canon.add_argument(
        "--timeout", type=float, default=10.0, help="seconds per test program (default 10)"
    )
    canon.add_argument(
        "--isolation",
        choices=["namespaces", "weak"],
        default="namespaces",
        help="sandbox for generated code: 'namespaces' (default) is refused where the kernel "
        "has none; 'weak' = resource limits and a socket guard only, programs run as you",
    )
    _sandbox_args(canon)
    canon.set_defaults(func=_canonical)
    return p


def _sandbox_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-limit",
        choices=["job", "cgroup", "polled", "process"],
        default="job",
        help="generated code's memory limit: 'job' (default) = all of a job's processes together, "
        "a cgroup per job where one can be made, else polled; 'cgroup' or 'polled' to choose; "
        "'process' = each process alone (docs/sandbox.md)",
    )
    p.add_argument(
        "--package",
        action="append",
        dest="packages",
        metavar="NAME",
        help="an installed package test programs may import, e.g. numpy (repeat; default none)",
    )


def _benchmark_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--benchmark",
        required=True,
        help="humaneval, humaneval+, mbpp, mbpp+, gsm8k, math, or a task from a --plugin",
    )
    p.add_argument("--data", help="local data file (or MATH folder); HumanEval is bundled")
    p.add_argument("--limit", type=positive_int, help="only the first N items (default: all)")
    p.add_argument(
        "--field",
        action="append",
        metavar="KEY=TEMPLATE",
        help="your own file (--benchmark exact_match, normalized_match, regex, multiple_choice, "
        "code_tests): "
        "how a record becomes an item, e.g. --field 'prompt={x}>' --field 'target={y}' "
        "(repeatable; docs/compare.md, 'Your own data')",
    )
    p.add_argument("--dataset-split", help="the split of a Hugging Face datasets folder")
    add_plugin_argument(p)


def _load_options(args: argparse.Namespace) -> dict:
    """The generic tasks' loader options from --field KEY=TEMPLATE and --dataset-split."""
    import json

    options: dict = {}
    for entry in args.field or ():
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise ValueError(f"--field {entry!r}: expected KEY=TEMPLATE, e.g. 'prompt={{x}}>'")
        if value.startswith("["):  # a list of templates (choices)
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--field {entry!r}: not a JSON list ({exc.msg})") from None
        options.setdefault("fields", {})[key] = value
    if args.dataset_split:
        options["split"] = args.dataset_split
    return options


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from mergelab.candidate import GenerationSettings
    from mergelab.eval.harness import EvalSettings, evaluate, export_evalplus_samples
    from mergelab.eval.prompts import PromptConfig
    from mergelab.eval.sandbox import SandboxLimits
    from mergelab.eval.spec import build_candidate, parse_candidate_spec
    from mergelab.eval.tasks import get_task, load_benchmark
    from mergelab.outputs import check_output_file, check_output_path

    load_from_args(args)
    if args.model is not None and not Path(args.model).is_dir():
        raise FileNotFoundError(f"model folder {args.model} not found")
    spec = parse_candidate_spec(args.spec if args.spec else {"model": args.model})
    if args.tokenizer is not None:
        spec = dataclasses.replace(spec, tokenizer=str(Path(args.tokenizer).resolve()))
    if args.name:
        spec = dataclasses.replace(spec, name=args.name)
    for folder in spec.inputs():
        if not Path(folder).exists():
            raise FileNotFoundError(f"{folder} not found")
    # Every setting is checked before any model is loaded or any item generated.
    sampling_flags = [
        ("--temperature", args.temperature != 1.0),
        ("--top-p", args.top_p is not None),
        ("--top-k", args.top_k is not None),
    ]
    given = [flag for flag, is_set in sampling_flags if is_set]
    if given and not args.sample:
        raise ValueError(f"{', '.join(given)} only apply when sampling: add --sample")
    settings = EvalSettings(
        generation=GenerationSettings(
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            do_sample=args.sample,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed if args.sample else None,  # greedy runs keep their cache keys
        ),
        prompt=PromptConfig(n_shots=args.n_shots, chat_template=args.chat_template),
        n_samples=args.n_samples,
        pass_k=tuple(args.pass_k or (1,)),
        gsm8k_extraction="strict" if args.strict else "flexible",
        math_checker=args.math_checker,
        sandbox=SandboxLimits(timeout_s=args.timeout),
        isolation=args.isolation,
        memory_limit=args.memory_limit,
        packages=tuple(args.packages or ()),
        workers=args.workers,
        seed=args.seed,
    )
    inputs = [*spec.inputs(), args.data, args.cache_dir]
    if args.output:
        check_output_path(args.output, force=args.force, inputs=inputs)
    if args.evalplus_samples:
        check_output_file(args.evalplus_samples, force=args.force, inputs=inputs)
    bench = load_benchmark(args.benchmark, args.data, options=_load_options(args))
    if args.evalplus_samples and get_task(bench.task).kind != "code":
        raise ValueError(f"--evalplus-samples: {bench.name} is not a code benchmark")
    torch.manual_seed(args.seed)
    candidate = build_candidate(spec, device=args.device, dtype=args.dtype)
    result = evaluate(
        candidate,
        bench,
        settings,
        cache_dir=args.cache_dir,
        limit=args.limit,
        output_dir=args.output,
        force=args.force,
    )
    _print_metrics(result.summary)
    print(f"results: {result.output_dir}")
    if args.evalplus_samples:
        path = export_evalplus_samples(result.items, args.evalplus_samples, force=args.force)
        print(f"EvalPlus samples: {path}")
    return 0


def _print_metrics(summary: dict) -> None:
    for name, m in summary["metrics"].items():
        print(
            f"{summary['benchmark']['name']} {name}: {100 * m['mean']:.1f} "
            f"[{100 * m['low']:.1f}, {100 * m['high']:.1f}] ({100 * m['confidence']:.0f}% CI, "
            f"n={m['n']})"
        )


def _load_items(folder: str) -> tuple[dict, list[dict]]:
    path = Path(folder)
    summary_file, items_file = path / "summary.json", path / "items.jsonl"
    if not summary_file.exists() or not items_file.exists():
        raise FileNotFoundError(f"{path} has no summary.json + items.jsonl (an evaluate() output)")
    summary = json.loads(summary_file.read_text())
    items = [json.loads(line) for line in items_file.read_text().splitlines() if line.strip()]
    return summary, items


def _compare(args: argparse.Namespace) -> int:
    from mergelab.eval.stats import compare

    sa, ia = _load_items(args.result_a)
    sb, ib = _load_items(args.result_b)
    metric = args.metric or sa["primary_metric"]
    out = compare(ia, ib, metric=metric, n_boot=args.n_boot, seed=args.seed)
    pb = out["paired_bootstrap"]
    print(
        f"{metric} on {out['n_shared']} shared items: a = {100 * out['mean_a']:.1f}, "
        f"b = {100 * out['mean_b']:.1f}"
    )
    print(
        f"a - b = {100 * pb['mean_diff']:+.1f} [{100 * pb['low']:+.1f}, {100 * pb['high']:+.1f}] "
        f"(paired bootstrap {100 * pb['confidence']:.0f}% CI, p = {pb['p_value']:.3g})"
    )
    if "mcnemar" in out:
        m = out["mcnemar"]
        print(f"McNemar exact: a-only {m['a_only']}, b-only {m['b_only']}, p = {m['p_value']:.3g}")
    print(json.dumps(out))
    return 0


def _canonical(args: argparse.Namespace) -> int:
    from mergelab.eval.sandbox import Sandbox, SandboxLimits
    from mergelab.eval.scoring_code import run_code_tests, solution_code
    from mergelab.eval.tasks import get_task, load_benchmark

    load_from_args(args)
    bench = load_benchmark(args.benchmark, args.data, args.limit, _load_options(args))
    if get_task(bench.task).kind != "code":
        raise ValueError(f"{bench.name} is not a code benchmark")
    cases = [
        (it.prompt, solution_code(it.prompt, it.solution or "", it.tests), it.tests)
        for it in bench.items
    ]
    limits = SandboxLimits(timeout_s=args.timeout)
    sandbox = Sandbox(
        workers=args.workers,
        limits=limits,
        isolation=args.isolation,
        memory_limit=args.memory_limit,
        packages=args.packages or (),
    )
    with sandbox:
        print(sandbox.memory_notice())
        verdicts, isolation = run_code_tests(sandbox, cases, progress=True)
    results = [(it.item_id, k, v) for it, vs in zip(bench.items, verdicts) for k, v in vs.items()]
    failed = [r for r in results if not r[2].passed]
    print(
        f"{bench.name}: {len(results) - len(failed)}/{len(results)} tests pass "
        f"with the canonical solutions (isolation: {', '.join(isolation)})"
    )
    for item_id, kind, r in failed[:20]:
        print(f"  {item_id} [{kind}] {r.status}: {r.error.strip().splitlines()[-1:]}")
    return 1 if failed else 0
