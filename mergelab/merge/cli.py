"""``mergelab merge``: merge checkpoint folders or LoRA adapters, from flags or a config file.

    mergelab merge --method ties --base base/ --model math/:1.0 --model code/:0.5 \\
        --param density=0.2 --param lambda=1.0 --out merged/
    mergelab merge --config merge.yaml [--dry-run] [--force]

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
from mergelab.outputs import check_output_path

from .checkpoint import DEFAULT_SHARD_SIZE, merge_checkpoints, plan_checkpoint_merge
from .config import (
    DuplicateKeyError,
    MergeConfig,
    ModelSpec,
    load_merge_config,
    load_yaml,
    parse_dtype,
    validate_config,
)
from .lora import is_lora_adapter, merge_lora_adapters, plan_lora_merge
from .registry import get_merge_method, list_merge_methods
from .validation import MergeInputError


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "merge",
        help="merge checkpoints or LoRA adapters in weight space",
        description="Merge checkpoint folders or PEFT LoRA adapters with a registered method, "
        "from flags or a YAML/TOML config file.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="methods: " + ", ".join(list_merge_methods()) + "\n\nexamples:\n"
        "  mergelab merge --method ties --base base/ --model math/:1.0 --model code/:0.5 \\\n"
        "      --param density=0.2 --param lambda=1.0 --out merged/\n"
        "  mergelab merge --config merge.yaml --dry-run",
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
        "--force",
        action="store_true",
        help="replace an existing output: an empty folder or one mergelab wrote, nothing else",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", "-v", action="store_true", help="dry run: list every tensor")
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
            return ModelSpec(path, {"weight": float(tail)})
        except ValueError:
            pass
    return ModelSpec(text)


def config_from_args(args: argparse.Namespace) -> MergeConfig:
    """The config file (if any) with the flags applied on top."""
    models = [_parse_model(m) for m in args.model] + [ModelSpec(m) for m in args.models]
    if args.config:
        config = load_merge_config(args.config)
        if models:
            raise ValueError("give the models in the config file or with --model, not both")
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
    if not config.output and not args.dry_run:
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
    config = config_from_args(args)
    global_params, per_model = config.split_params()
    paths = [spec.path for spec in config.models]
    for path in [config.base, *paths]:
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"model {path} does not exist")
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
    if args.dry_run and config.output:  # an output that would be refused is part of the plan
        check_output_path(config.output, force=args.force, inputs=[config.base, *paths])
    if args.dry_run:
        plan = plan_checkpoint_merge(
            config.method,
            config.base,
            paths,
            out_dtype=parse_dtype(config.out_dtype),
            vocab_padding=config.vocab_padding,
            **common,
        )
        try:
            _print_checkpoint_plan(plan, config, verbose=args.verbose)
        finally:
            plan.close()
        return 0
    out = merge_checkpoints(
        config.method,
        config.base,
        paths,
        output=config.output,
        out_dtype=parse_dtype(config.out_dtype),
        shard_size=config.shard_size if config.shard_size is not None else DEFAULT_SHARD_SIZE,
        vocab_padding=config.vocab_padding,
        force=args.force,
        progress=not args.no_progress,
        **common,
    )
    print(f"merged {len(paths)} models with {config.method} into {out}")
    return 0


def _print_checkpoint_plan(plan, config: MergeConfig, verbose: bool) -> None:
    print(f"method: {plan.method.name}")
    print(f"parameters: {json.dumps(plan.params)}")
    print(f"per-model parameters: {json.dumps(plan.per_model)}")
    print(f"base: {plan.base.path if plan.base is not None else '(none)'}")
    for i, e in enumerate(plan.experts):
        print(f"model {i}: {e.path}")
    print(f"compute dtype: {str(plan.compute_dtype).removeprefix('torch.')}; seed: {plan.seed}")
    m, params = plan.method, {**plan.params, **plan.per_model}
    if m.prepare is not None and (m.needs_prepare is None or m.needs_prepare(params)):
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
