"""``mergelab merge``: merge checkpoint folders or LoRA adapters, from flags or a config file.

    mergelab merge --method ties --base base/ --model math/:1.0 --model code/:0.5 \\
        --param density=0.2 --param lambda=1.0 --out merged/
    mergelab merge --config merge.yaml [--dry-run] [--explain] [--force]

A config spelled the mergekit way (``merge_method``) is read with mergekit's semantics
(:mod:`mergelab.merge.mergekit_dialect`); one spelled mergelab's way (``method``) with mergelab's
(:mod:`mergelab.merge.config`). ``--explain`` prints, for either, the fully resolved parameters of
every group of tensors and writes nothing.

Models that are PEFT adapter folders (``adapter_config.json``) are merged as LoRA adapters
(see :mod:`mergelab.merge.lora`); all other models are checkpoint folders, merged streamed
(see :mod:`mergelab.merge.checkpoint`). Flags given next to ``--config`` override its values.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from mergelab.errors import Terminated
from mergelab.inputs import check_model_folder
from mergelab.lora import is_lora_adapter
from mergelab.outputs import check_output_path
from mergelab.plugins import add_plugin_argument, load_from_args
from mergelab.vocabulary import check_merge_tokenizers

from .checkpoint import DEFAULT_SHARD_SIZE, plan_checkpoint_merge, run_checkpoint_merge
from .config import (
    DuplicateKeyError,
    MergeConfig,
    ModelSpec,
    hub_snapshot,
    load_merge_config,
    load_yaml,
    locate_model,
    looks_like_hub_id,
    parse_dtype,
    shard_size_bytes,
    validate_config,
)
from .lora import merge_lora_adapters, plan_lora_merge
from .mergekit_dialect import MergekitConfig, MergekitPlan, plan_mergekit_merge
from .mergekit_flags import add_mergekit_flags, apply_mergekit_flags
from .registry import get_merge_method, list_merge_methods
from .validation import MergeInputError


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "merge",
        help="merge checkpoints or LoRA adapters in weight space",
        description="Merge checkpoint folders or PEFT LoRA adapters with a registered method, "
        "from flags or a YAML/TOML config file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="methods: "
        + ", ".join(list_merge_methods(entry_points=False))
        + ", and those plugins register (--plugin, docs/guides/plugins.md)\n\nexamples:\n"
        "  mergelab merge --method ties --base base/ --model math/:1.0 --model code/:0.5 \\\n"
        "      --param density=0.2 --param lambda=1.0 --out merged/\n"
        "  mergelab merge --config merge.yaml --dry-run\n"
        "  mergelab merge --config mergekit.yml --explain   # mergekit's merge_method: its semantics\n"
        "  mergelab merge mergekit.yml merged/ --lazy-unpickle   # as mergekit-yaml CONFIG OUT",
    )
    p.add_argument("--config", help="YAML or TOML merge config (see mergelab.merge.config)")
    p.add_argument("--method", help="merge method, e.g. ties")
    p.add_argument("--base", help="base model folder")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH[:WEIGHT]",
        help="a model to merge, optionally with its weight (repeat)",
    )
    p.add_argument("--models", nargs="+", default=[], metavar="PATH", help="models, weight 1 each")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method parameter (repeat); a list [a, b] gives one value per model",
    )
    p.add_argument("--dtype", help="compute dtype (default float32)")
    p.add_argument("--out-dtype", help="stored dtype (default: each tensor's checkpoint dtype)")
    p.add_argument("--out", "-o", dest="output", help="output folder")
    p.add_argument("--seed", type=int, help="seed for random methods (DARE); default 0")
    p.add_argument("--shard-size", help="max output shard size, e.g. 2GB (default 5GB)")
    p.add_argument(
        "--vocab-padding",
        choices=["error", "truncate"],
        help="embedding rows that differ by vocabulary padding (default error)",
    )
    p.add_argument(
        "--lora-output", choices=["full", "adapter"], help="LoRA: full model or new adapter"
    )
    p.add_argument("--rank", type=int, help="LoRA adapter output: rank (SVD truncation)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan only")
    p.add_argument(
        "--explain",
        action="store_true",
        help="print the fully resolved parameters of every group of tensors; write nothing",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output: an empty folder or one mergelab wrote, nothing else",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", "-v", action="store_true", help="dry run: list every tensor")
    add_plugin_argument(p)
    add_mergekit_flags(p)
    p.set_defaults(func=run)
    return p


def _parse_value(key: str, text: str) -> Any:
    """A ``--param`` value read as YAML (numbers, lists, mappings); text that is not YAML stays
    text, but a mapping that gives one key twice is refused as in a config file."""
    try:
        return load_yaml(text, f"--param {key}")
    except ValueError as exc:
        if isinstance(exc.__context__, DuplicateKeyError):
            raise
        return text


def _parse_model(text: str) -> ModelSpec:
    """``path`` or ``path:weight`` (a path may itself contain ':'; only a numeric tail counts)."""
    path, sep, tail = text.rpartition(":")
    if sep and path:
        try:
            return ModelSpec(path, {"weight": float(tail)}, given=path)
        except ValueError:
            pass
    return ModelSpec(text, given=text)


def _mergekit_overrides(config: MergekitConfig, args: argparse.Namespace) -> MergekitConfig:
    """Run options from flags (output, seed, shard size); flags that would change the merge are
    refused next to a mergekit-dialect config."""
    given = [flag for key, flag in MERGEKIT_FIXED_FLAGS.items() if getattr(args, key, None)]
    if given:
        raise ValueError(
            f"{', '.join(given)} cannot be combined with a mergekit-dialect config "
            "(merge_method): edit the config instead"
        )
    if args.output is not None:
        config.output = args.output
    if args.seed is not None:
        config.seed = args.seed
    if args.shard_size is not None:
        config.shard_size = args.shard_size
    shard_size_bytes(config.shard_size)
    if not config.output and not (args.dry_run or args.explain):
        raise ValueError("--out is required (or 'output' in the config)")
    return config


# Flags that change what a mergekit-dialect config means: refused next to one (edit the file).
MERGEKIT_FIXED_FLAGS = {
    "method": "--method",
    "base": "--base",
    "param": "--param",
    "dtype": "--dtype",
    "out_dtype": "--out-dtype",
    "vocab_padding": "--vocab-padding",
    "lora_output": "--lora-output",
    "rank": "--rank",
}


def config_from_args(args: argparse.Namespace) -> MergeConfig | MergekitConfig:
    """The config file (if any) with the flags applied on top."""
    models = [_parse_model(m) for m in args.model] + [ModelSpec(m, given=m) for m in args.models]
    if args.config:
        config = load_merge_config(args.config)
        if models:
            raise ValueError("give the models in the config file or with --model, not both")
        if isinstance(config, MergekitConfig):
            return _mergekit_overrides(config, args)
    else:
        if not args.method:
            raise ValueError("--method is required (or --config)")
        if not models:
            raise ValueError("give at least one --model (or --models, or --config)")
        config = MergeConfig(method=args.method, models=models)
    overrides = {
        "method": args.method,
        "base": args.base,
        "dtype": args.dtype,
        "out_dtype": args.out_dtype,
        "output": args.output,
        "seed": args.seed,
        "shard_size": args.shard_size,
        "vocab_padding": args.vocab_padding,
        "lora_output": args.lora_output,
        "rank": args.rank,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param takes KEY=VALUE, got {item!r}")
        config.params[key.strip()] = _parse_value(key.strip(), value)
    validate_config(config)
    if not config.output and not (args.dry_run or args.explain):
        raise ValueError("--out is required (or 'output' in the config)")
    return config


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    return f"{nbytes} B"


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except Terminated as exc:  # SIGTERM while writing: the work folder is already removed
        print(
            f"mergelab merge: interrupted ({signal.Signals(exc.signum).name}); the incomplete "
            "output was removed and nothing at the output path was changed",
            file=sys.stderr,
        )
        return 128 + exc.signum


def _run(args: argparse.Namespace) -> int:
    load_from_args(args)  # before the method is looked up
    apply_mergekit_flags(args)
    config = config_from_args(args)
    if isinstance(config, MergekitConfig):
        return _run_mergekit(args, config)
    global_params, per_model = config.split_params()
    _locate_missing(config)
    paths = [spec.path for spec in config.models]
    for folder in [config.base, *paths]:
        if folder is not None:
            check_model_folder(folder)  # its files regular, its configs of a sensible depth
    lora = [is_lora_adapter(p) for p in paths]
    if any(lora) and not all(lora):
        raise MergeInputError(
            "some models are LoRA adapters and some are checkpoints; merge one kind at a time"
        )
    common = dict(
        params=global_params,
        per_model_params=per_model,
        dtype=parse_dtype(config.dtype),
        seed=config.seed,
    )
    if all(lora):
        return _run_lora(args, config, paths, common)
    inputs = [p for p in [config.base, *paths] if p is not None]
    check_merge_tokenizers(
        inputs, [f"{'base' if p == config.base else 'model'} {p}" for p in inputs]
    )
    if config.output and (not (args.dry_run or args.explain) or args.dry_run):
        # an output that would be refused is part of a dry run's plan
        check_output_path(config.output, force=args.force, inputs=inputs)
    plan = plan_checkpoint_merge(
        config.method,
        config.base,
        paths,
        out_dtype=parse_dtype(config.out_dtype),
        vocab_padding=config.vocab_padding,
        **common,
    )
    try:
        if args.explain or args.dry_run:
            if args.explain:
                _print_lines(_explain_mergelab(plan, config))
            if args.dry_run:
                _print_checkpoint_plan(plan, config, verbose=args.verbose)
            return 0
        plan.config_text = config.text or _config_yaml(config)
        plan.record = {"dialect": "mergelab", "hub_models": _hub_models(config)}
        shard_size = config.shard_size if config.shard_size is not None else DEFAULT_SHARD_SIZE
        out = run_checkpoint_merge(
            plan,
            config.output,
            shard_size=shard_size,
            force=args.force,
            progress=not args.no_progress,
        )
    finally:
        plan.close()
    print(f"merged {len(paths)} models with {config.method} into {out}")
    return 0


def _locate_missing(config: MergeConfig) -> None:
    """Every model must exist; a hub id that is neither a folder nor cached is named as not
    available offline (flags' paths are looked up in the hub cache here, configs' on reading)."""
    specs = [(config.base, config.base_given)] if config.base is not None else []
    specs += [(spec.path, spec.given) for spec in config.models]
    resolved = []
    for path, given in specs:
        if Path(path).exists():
            resolved.append(path)
            continue
        if given and looks_like_hub_id(given.partition("@")[0]):
            folder, _ = locate_model(given, [Path.cwd()])  # cached, or "not available offline"
            resolved.append(str(folder))
            continue
        raise FileNotFoundError(f"model {path} does not exist")
    if config.base is not None:
        config.base = resolved.pop(0)
    for spec, path in zip(config.models, resolved):
        spec.path = path


def _hub_models(config: MergeConfig) -> list[str]:
    names = [config.base_given] + [s.given for s in config.models]
    return [
        n
        for n in names
        if n and looks_like_hub_id(n) and not Path(n).exists() and hub_snapshot(n) is not None
    ]


def _config_yaml(config: MergeConfig) -> str:
    """The merge as a mergelab-dialect config (for the model card of a merge given by flags)."""
    import yaml

    raw: dict[str, Any] = {"method": config.method}
    if config.base is not None:
        raw["base"] = config.base_given or config.base
    raw["models"] = [
        {"model": s.given or s.path, **({"parameters": s.params} if s.params else {})}
        for s in config.models
    ]
    if config.params:
        raw["parameters"] = config.params
    raw.update(dtype=config.dtype, seed=config.seed)
    if config.out_dtype:
        raw["out_dtype"] = config.out_dtype
    return yaml.safe_dump(raw, sort_keys=False)


def _print_lines(lines: list[str]) -> None:
    for line in lines:
        print(line)


def _explain_mergelab(plan, config: MergeConfig) -> list[str]:
    """mergelab's dialect: one parameter set for every tensor (defaults filled in)."""
    m = plan.method
    shown = {("lambda" if k == "lambda_" else k): v for k, v in plan.params.items()}
    lines = [
        "dialect: mergelab (method) - the papers' defaults unless set",
        f"method: {m.name}",
        f"base: {plan.base.path if plan.base is not None else '(none)'}",
        *(f"model {i}: {e.path}" for i, e in enumerate(plan.experts)),
        f"dtype: compute {str(plan.compute_dtype).removeprefix('torch.')}, output "
        + ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in plan.tensors})),
        f"tensors: {len(plan.tensors)} in 1 group",
        f"all {len(plan.tensors)} tensors"
        + (f" (vocabulary rows merged: {plan.truncated_rows})" if plan.truncated_rows else ""),
        "  parameters: " + (" ".join(f"{k}={json.dumps(v)}" for k, v in shown.items()) or "(none)"),
        "  per model: "
        + (" ".join(f"{k}={json.dumps(v)}" for k, v in plan.per_model.items()) or "(none)"),
    ]
    if m.has_first_pass({**plan.params, **plan.per_model}):
        lines.append("  a whole-model statistics pass first (e.g. global top-k thresholds)")
    return lines


def _run_mergekit(args: argparse.Namespace, config: MergekitConfig) -> int:
    """A mergekit-dialect config: plan (resolving every tensor), explain, dry-run or merge."""
    roots = [Path(config.root), Path.cwd()]
    hub: list[str] = []

    def locate(ref: str) -> Path:
        folder, cached = locate_model(ref, list(dict.fromkeys(roots)))
        check_model_folder(folder)
        if cached:
            hub.append(ref)
        others = [r / ref for r in roots if (r / ref).exists()]
        if not cached and len({p.resolve() for p in others}) > 1:
            raise ValueError(
                f"model {ref!r} is ambiguous: {others[0]} (next to the config) and {others[1]} "
                "(in the working folder) both exist; write an absolute path"
            )
        return folder

    if config.output and not args.explain:
        check_output_path(config.output, force=args.force, inputs=[])
    planned = plan_mergekit_merge(config, locate, hub)
    try:
        inputs = [f.path for f in planned.plan.folders]
        if config.output and not args.explain:
            check_output_path(config.output, force=args.force, inputs=inputs)
        if args.explain or args.dry_run:
            if args.explain:
                _print_lines(planned.explain())
            if args.dry_run:
                _print_mergekit_plan(planned, verbose=args.verbose)
            return 0
        out = run_checkpoint_merge(
            planned.plan,
            config.output,
            shard_size=config.shard_size,
            force=args.force,
            progress=not args.no_progress,
        )
    finally:
        planned.close()
    print(f"merged with mergekit's {config.merge_method} (mergekit dialect) into {out}")
    return 0


def _print_mergekit_plan(planned: MergekitPlan, verbose: bool) -> None:
    plan = planned.plan
    print(f"method: {planned.spec.name} (mergekit dialect) -> {planned.spec.target}")
    print(f"models: {', '.join(planned.config.referenced_models())}")
    print(f"tensors: {len(plan.tensors)} in {len(planned.groups)} parameter groups (--explain)")
    shown = plan.tensors if verbose else plan.tensors[:20]
    for t in shown:
        print(f"  {t.name:60s} {str(list(t.shape)):>20s} {str(t.dtype).removeprefix('torch.')}")
    if len(shown) < len(plan.tensors):
        print(f"  ... {len(plan.tensors) - len(shown)} more (--verbose lists all)")
    if plan.config_updates:
        print(f"config.json: {json.dumps(plan.config_updates)}")
    print(f"estimated output size: {_human(plan.output_bytes)}")
    print(f"output: {planned.config.output or '(not given)'} (dry run: nothing written)")


def _print_checkpoint_plan(plan, config: MergeConfig, verbose: bool) -> None:
    print(f"method: {plan.method.name}")
    print(f"parameters: {json.dumps(plan.params)}")
    print(f"per-model parameters: {json.dumps(plan.per_model)}")
    print(f"base: {plan.base.path if plan.base is not None else '(none)'}")
    for i, e in enumerate(plan.experts):
        print(f"model {i}: {e.path}")
    print(f"compute dtype: {str(plan.compute_dtype).removeprefix('torch.')}; seed: {plan.seed}")
    m, params = plan.method, {**plan.params, **plan.per_model}
    if m.has_first_pass(params):
        print("passes: a whole-model statistics pass over the inputs first, then the merge")
    if plan.truncated_rows:
        print(f"vocabulary rows merged (truncate rule): {plan.truncated_rows}")
    n_params = sum(_numel(t.shape) for t in plan.tensors)
    print(f"tensors: {len(plan.tensors)} ({n_params:,} parameters)")
    shown = plan.tensors if verbose else plan.tensors[:20]
    for t in shown:
        print(f"  {t.name:60s} {str(list(t.shape)):>20s} {str(t.dtype).removeprefix('torch.')}")
    if len(shown) < len(plan.tensors):
        print(f"  ... {len(plan.tensors) - len(shown)} more (--verbose lists all)")
    print(f"estimated output size: {_human(plan.output_bytes)}")
    print(f"output: {config.output or '(not given)'} (dry run: nothing written)")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _run_lora(args: argparse.Namespace, config: MergeConfig, paths: list[str], common) -> int:
    if args.explain:
        plan = plan_lora_merge(config.method, paths, base=config.base, **common)
        merge = plan.merge
        shown = {("lambda" if k == "lambda_" else k): v for k, v in merge.params.items()}
        print("dialect: mergelab (method); LoRA adapters merged in ΔW = B·A·scaling space")
        print(f"method: {merge.method.name}")
        print(f"all {len(merge.modules)} modules")
        print("  parameters: " + " ".join(f"{k}={json.dumps(v)}" for k, v in shown.items()))
        print(
            "  per model: " + " ".join(f"{k}={json.dumps(v)}" for k, v in merge.per_model.items())
        )
        if plan.base is not None:
            plan.base.close()
        if not args.dry_run:
            return 0
    if args.dry_run:
        plan = plan_lora_merge(config.method, paths, base=config.base, **common)
        merge = plan.merge
        print(f"method: {merge.method.name} (applied to ΔW = B·A·scaling, base ΔW = 0)")
        print(f"parameters: {json.dumps(merge.params)}")
        print(f"per-model parameters: {json.dumps(merge.per_model)}")
        for i, a in enumerate(merge.adapters):
            print(f"adapter {i}: {a.path} (rank {a.max_rank}, {len(a.modules)} modules)")
        print(f"output: {config.lora_output} -> {config.output or '(not given)'}")
        shown = merge.modules if args.verbose else merge.modules[:20]
        for module in shown:
            print(f"  {module:60s} {str(list(merge.shapes[module])):>20s}")
        if len(shown) < len(merge.modules):
            print(f"  ... {len(merge.modules) - len(shown)} more (--verbose lists all)")
        if plan.base is not None:
            plan.base.close()
        print("dry run: nothing written")
        return 0
    get_merge_method(config.method)
    result = merge_lora_adapters(
        config.method,
        paths,
        output=config.output,
        base=config.base,
        output_kind=config.lora_output,
        rank=config.rank,
        shard_size=config.shard_size,
        force=args.force,
        progress=not args.no_progress,
        **common,
    )
    if result.kind == "adapter":
        how = "exact concatenation" if result.exact else "SVD truncation"
        print(f"adapter of rank {result.rank} ({how}) written to {result.output}")
        for module, err in result.truncation_error.items():
            print(f"  {module:60s} relative Frobenius error {err:.3e}")
        if result.truncation_error:
            print(f"max relative truncation error: {result.max_truncation_error:.3e}")
    else:
        print(f"merged {len(paths)} LoRA adapters into full model {result.output}")
    return 0
