"""Every command explains itself: `mergelab --help` is quick (it imports no torch), and every
option of every subcommand has plain help text."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mergelab import cli

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _parsers(parser: argparse.ArgumentParser, path: str = "mergelab"):
    """(command path, parser) for ``parser`` and every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_top_level_help_imports_no_torch_and_is_quick():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['mergelab', '--help']\n"
        "try:\n"
        "    runpy.run_module('mergelab', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout
    assert all(name in done.stdout for name in cli.SUBCOMMAND_MODULES)

    # Wall time, best of three, against a bare `import torch` timed the same way: on a shared
    # machine absolute times move with the load (benchmarks/cli_help_time.py measures them).
    def best(argv):
        times = []
        for _ in range(3):
            started = time.perf_counter()
            subprocess.run(argv, capture_output=True, env=_env(), cwd=ROOT, check=True)
            times.append(time.perf_counter() - started)
        return min(times)

    helped = best([sys.executable, "-m", "mergelab", "--help"])
    torch_alone = best([sys.executable, "-c", "import torch"])
    assert helped < 0.5 * torch_alone, (helped, torch_alone)


def test_every_option_of_every_subcommand_has_plain_help():
    missing, markup = [], []
    for path, parser in _parsers(cli.build_parser()):
        texts = [parser.description or "", parser.epilog or ""]
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not action.help:  # (argparse.SUPPRESS hides an option on purpose)
                missing.append(f"{path} {name}")
            texts.append(action.help or "")
        if any("``" in t for t in texts):
            markup.append(path)
    assert missing == [], f"options without help: {missing}"
    assert markup == [], f"literal `` markup in the help of: {markup}"
