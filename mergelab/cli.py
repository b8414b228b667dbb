"""The `mergelab` command. Each subcommand lives beside the component it drives and registers
itself through ``add_subcommand(subparsers)``; this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

# module path -> each module defines add_subcommand(subparsers) that sets `func` on its parser.
SUBCOMMAND_MODULES = [
    "mergelab.merge.cli",  # mergelab merge
    "mergelab.compose.cli",  # mergelab compose
    "mergelab.eval.cli",  # mergelab eval
    "mergelab.demo",  # mergelab demo  (the README's main job)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mergelab",
        description="Weight-space merges and logit composition of language models, compared.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that component is not installed in this tree
                continue
            raise
        module.add_subcommand(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as exc:
        print(f"mergelab {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
