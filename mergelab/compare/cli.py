"""``mergelab compare SPEC --out DIR``: a comparison from a spec file (docs/compare.md)."""

from __future__ import annotations

import argparse
import sys


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compare",
        help="compare base, experts, compositions and merges on benchmarks, from a spec file",
        description="Run a comparison spec (YAML or TOML; docs/compare.md): every candidate "
        "family over its grid, grid points chosen on validation, test scores with bootstrap "
        "CIs, paired tests against the best single expert, costs; writes results.json, "
        "table.md and figures/ to --out. An interrupted run resumes from its cache folder.",
    )
    p.add_argument("spec", nargs="?", help="the spec file (.yaml, .yml or .toml)")
    p.add_argument("--out", help="output folder (results.json, table.md, figures/)")
    p.add_argument(
        "--cache",
        help="merges, generations and finished jobs (default: the spec's "
        "cache_dir, else OUT.cache beside the output); kept for resuming",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        help="run jobs here or as Ray tasks (overrides the spec's executor.kind)",
    )
    p.add_argument(
        "--ray-address", help="Ray cluster address (default: the spec's, else a local instance)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the expanded plan (candidates × benchmarks × splits, generations) and exit",
    )
    p.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw table.md and figures/ from OUT/results.json",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it is an earlier mergelab output (never anything else)",
    )
    p.add_argument(
        "--example",
        choices=("tiny", "letters"),
        help="run a built-in example: 'tiny' trains a tiny base and math/code experts, "
        "'letters' a copying base and A→B / C→D experts (toy letter replacement); cached in "
        "the cache folder, then compared (a few minutes on 2 CPUs)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (bars on a terminal, lines in a log)",
    )
    from mergelab.plugins import add_plugin_argument

    add_plugin_argument(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mergelab.compare.run import check_work_folders, default_cache_dir, run
    from mergelab.plugins import load_from_args

    plugins = load_from_args(args)  # before the spec names their methods and tasks
    if args.plot_only:
        if not args.out:
            raise ValueError("--plot-only needs --out (the folder holding results.json)")
        from mergelab.compare.report import plot_only

        out = plot_only(args.out)
        print((Path(out) / "table.md").read_text(encoding="utf-8"))
        return 0
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    progress = False if args.no_progress else None
    spec = args.spec
    if args.example:
        if args.spec:
            raise ValueError("give a spec file or --example, not both")
        if not args.out and not args.cache:  # the models are trained there, even for --dry-run
            raise ValueError("--example needs --out (or --cache for --dry-run)")
        from mergelab.compare.example import EXAMPLES

        cache = Path(args.cache) if args.cache else default_cache_dir(args.out)
        if args.out and not args.dry_run:  # refused now, not after the models are trained
            from mergelab.outputs import check_output_path

            check_output_path(args.out, force=args.force, inputs=[cache])
        folder = cache / ("example" if args.example == "tiny" else f"example-{args.example}")
        spec = EXAMPLES[args.example](folder, progress=not args.no_progress)
    if spec is None:
        raise ValueError("give a spec file (or --example tiny); see mergelab compare --help")
    executor = None
    if args.executor or args.ray_address:
        executor = {"kind": args.executor or "ray"}
        if args.ray_address:
            executor["address"] = args.ray_address
    if args.dry_run:
        from mergelab.compare.plan import make_plan
        from mergelab.compare.spec import load_spec, with_executor, with_plugins

        loaded = with_plugins(load_spec(spec), plugins)
        if executor is not None:
            loaded = with_executor(loaded, executor)
        cache = (
            args.cache or loaded.cache_dir or (default_cache_dir(args.out) if args.out else None)
        )
        check_work_folders(loaded, args.out, cache)  # as the run would refuse them
        print(make_plan(loaded).describe())
        return 0
    if not args.out:
        raise ValueError("--out is required (the output folder)")
    from mergelab.progress import quiet_library_bars

    quiet_library_bars()  # in a log: mergelab's progress lines, not transformers' bars
    run(
        spec,
        args.out,
        cache_dir=args.cache,
        executor=executor,
        force=args.force,
        progress=progress,
        plugins=plugins,
    )
    table = (Path(args.out) / "table.md").read_text(encoding="utf-8")
    print(table)
    print(f"results: {Path(args.out) / 'results.json'}", file=sys.stderr)
    return 0
