"""The `mergelab` command. Each subcommand lives beside the component it drives and registers
itself through ``add_subcommand(subparsers)``; this file only lists them, and turns exceptions
into one line and an exit code (:mod:`mergelab.errors`): 2 for bad input, 1 for an environment
fault or a bug, 130 when interrupted (143 on SIGTERM, which is handled like Ctrl-C). ``--debug`` (anywhere on the command line) or
``MERGELAB_DEBUG=1`` also prints the traceback."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

from . import import_without_collecting
from .errors import exit_code, interrupts_deferred, may_be_a_bug, one_line, raise_terminated

# subcommand -> module that defines add_subcommand(subparsers), which sets `func` on its parser.
SUBCOMMAND_MODULES = {
    "merge": "mergelab.merge.cli",
    "compose": "mergelab.compose.cli",
    "eval": "mergelab.eval.cli",
    "compare": "mergelab.compare.cli",
    "demo": "mergelab.demo",  # the README's main job
}
# Each subcommand's one-line help, for `mergelab --help`, which lists the subcommands without
# importing their modules (and with them torch: seconds). A test checks these against the
# modules' own help.
SUBCOMMAND_HELP = {
    "merge": "merge checkpoints or LoRA adapters in weight space",
    "compose": "generate from a logit composition of a base and experts",
    "eval": "evaluate candidates on math and code benchmarks",
    "compare": "compare base, experts, compositions and merges on benchmarks, from a spec file",
    "demo": "tiny end-to-end demo: train a base and two experts, merge with every method",
}

DEBUG_ENV = "MERGELAB_DEBUG"
DEBUG_HELP = f"show the full traceback of an error (or set {DEBUG_ENV}=1)"


def build_parser(only: str | None = None, *, lazy: bool = False) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of subcommand ``only`` alone (importing just its
    module: a merge need not wait for the evaluation code to load). ``lazy``: the subcommands
    other than ``only`` are listed by name and help only, their modules not imported (what
    ``mergelab --help`` shows)."""
    parser = argparse.ArgumentParser(
        prog="mergelab",
        description="Weight-space merges and logit composition of language models, compared.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in SUBCOMMAND_MODULES.items():
        if name != only and (only is not None or lazy):
            if lazy:
                sub.add_parser(name, help=SUBCOMMAND_HELP[name])
            continue
        try:
            module = import_without_collecting(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that component is not installed in this tree
                continue
            raise
        module.add_subcommand(sub)
    _add_debug_flag(sub)
    return parser


def _subcommand(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option: the
    top-level options take no values), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in SUBCOMMAND_MODULES else None


def _add_debug_flag(subparsers: argparse._SubParsersAction) -> None:
    """``--debug`` after a subcommand too (``mergelab merge ... --debug``), at every level."""
    for parser in set(subparsers.choices.values()):
        if "--debug" in parser._option_string_actions:  # the subcommand defines its own
            continue
        # SUPPRESS: a subcommand that was not given --debug leaves the top-level value alone.
        parser.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP
        )
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_debug_flag(action)


def _debug_from_env() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _command_name(args: argparse.Namespace) -> str:
    """``mergelab merge``, or ``mergelab eval run`` for a nested subcommand."""
    parts = ["mergelab", args.command]
    nested = getattr(args, f"{args.command}_command", None)
    if isinstance(nested, str):
        parts.append(nested)
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None  # the `mergelab` command, not a call from Python
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        code = _main(argv)
    except BaseException:  # argparse's exit, or an interrupt while reporting: the usual way out
        if as_program:
            # Python's last garbage collection would walk every object torch created only to
            # free memory the OS takes back anyway; frozen objects are left out of it.
            gc.freeze()
        raise
    if as_program:
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> NoReturn:
    """End the process once a command has returned: the exit handlers run (logging's flush,
    those libraries registered) and the standard streams are flushed, as at any exit, but the
    interpreter does not then tear itself down. That teardown frees, one by one, every object
    torch and the rest created, memory the OS takes back at once anyway: a noticeable
    part of a small merge's time (``docs/merge_performance.md``). Every command has finished
    its work, and closed and moved into place its outputs, before it returns; threads still
    alive then are idle workers (the chunk pool), which the OS ends with the process."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe has nothing more to say
            stream.flush()
    os._exit(code)


def _main(argv: list[str]) -> int:
    # No subcommand on the command line (`mergelab --help`, a typo): list them all, lazily.
    command = _subcommand(argv)
    with interrupts_deferred():  # the subcommand's imports (transformers, ...) run C++ start-up
        parser = build_parser(command, lazy=command is None)
    args = parser.parse_args(argv)
    debug = args.debug or _debug_from_env()
    # SIGTERM unwinds like Ctrl-C (outputs being written are removed), unless an application
    # that calls main() has a handler of its own.
    sigterm = None
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            sigterm = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # Output piped into e.g. `head`, which stopped reading: nothing worth a message.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (Exception, KeyboardInterrupt) as exc:
        if debug:
            traceback.print_exc()
        if isinstance(exc, KeyboardInterrupt):
            print(f"{_command_name(args)}: {one_line(exc)}", file=sys.stderr)
        else:
            hint = (
                " (rerun with --debug for the traceback)" if may_be_a_bug(exc) and not debug else ""
            )
            print(f"{_command_name(args)}: error: {one_line(exc)}{hint}", file=sys.stderr)
        return exit_code(exc)
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


if __name__ == "__main__":
    sys.exit(main())
