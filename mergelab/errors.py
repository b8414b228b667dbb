"""What the ``mergelab`` command does with an exception: which exit code, which one line.

==========  ==============================================================================
exit code   cause
==========  ==============================================================================
2           bad input the user can fix: a value, a config or data file, a path that does
            not exist / already exists / is a folder where a file is expected (or back)
1           an environment fault: any other ``OSError`` (disk full, read-only file system,
            permission denied, ...), out of memory, a missing optional package
1           an unexpected error, i.e. a bug: the line names the exception type and asks for
            ``--debug``
130         interrupted (Ctrl-C); 143 for SIGTERM (128 + the signal number)
==========  ==============================================================================

Library code raises ordinary exceptions: :class:`UserInputError` (a ``ValueError``) or any
``ValueError``/``KeyError``/``TypeError`` for bad values, ``FileNotFoundError``/
``FileExistsError``/``NotADirectoryError``/``IsADirectoryError`` for bad paths, and lets other
``OSError``s propagate. Only :func:`mergelab.cli.main` turns them into exit codes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading

EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 1
EXIT_BUG = 1
EXIT_INTERRUPTED = 130


class UserInputError(ValueError):
    """Input the user can fix (a value, a config entry, a data file); the message says how."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same cleanup runs (outputs being written are
    removed); the command exits with 128 + the signal number, as a shell reports it."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def raise_terminated(signum: int, frame: object) -> None:
    """A signal handler: SIGTERM becomes :class:`Terminated` (``mergelab.cli.main`` and output
    writers install it)."""
    raise Terminated(signum)


# OSErrors that mean "this path is wrong", not "the machine is in trouble".
PATH_MISTAKES = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)


def _parse_errors() -> tuple[type[BaseException], ...]:
    """Parse errors of the config formats we read that are not ValueErrors (YAML's)."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        return ()
    return (yaml.YAMLError,)


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or torch's out-of-memory error (a RuntimeError; older torch: its message)."""
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def classify(exc: BaseException) -> str:
    """``"bad_input"``, ``"environment"``, ``"bug"`` or ``"interrupted"`` (module docstring)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, PATH_MISTAKES):
        return "bad_input"
    if isinstance(exc, (OSError, ImportError)) or is_out_of_memory(exc):
        return "environment"
    if isinstance(exc, (ValueError, KeyError, TypeError, *_parse_errors())):
        return "bad_input"
    return "bug"


EXIT_CODES = {
    "bad_input": EXIT_BAD_INPUT,
    "environment": EXIT_ENVIRONMENT,
    "bug": EXIT_BUG,
    "interrupted": EXIT_INTERRUPTED,
}


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, Terminated):
        return 128 + exc.signum
    return EXIT_CODES[classify(exc)]


def _bare_key_error(exc: BaseException) -> bool:
    """A KeyError of one word (a failed dict lookup), not one raised with a message."""
    return isinstance(exc, KeyError) and not (
        len(exc.args) == 1 and isinstance(exc.args[0], str) and " " in exc.args[0]
    )


def may_be_a_bug(exc: BaseException) -> bool:
    """Whether the line should point to ``--debug``: unexpected errors, and TypeErrors or bare
    KeyErrors, which may come from our code as well as from a bad value."""
    if isinstance(exc, UserInputError):
        return False
    return classify(exc) == "bug" or isinstance(exc, TypeError) or _bare_key_error(exc)


def one_line(exc: BaseException) -> str:
    """A one-line message for ``exc``: its text; for an OSError what failed, errno and path."""
    if isinstance(exc, Terminated):
        return f"interrupted ({signal.Signals(exc.signum).name})"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        text = f"{exc.strerror} [{errno.errorcode.get(exc.errno, exc.errno)}]"
        if exc.filename is not None:
            text += f": {os.fsdecode(exc.filename)}"
            if exc.filename2 is not None:
                text += f" -> {os.fsdecode(exc.filename2)}"
    elif isinstance(exc, KeyError) and not _bare_key_error(exc):
        text = exc.args[0]  # str(KeyError) would wrap the message in quotes
    else:
        text = str(exc)
    if may_be_a_bug(exc) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    # One line: messages from other libraries (YAML, transformers) may span several.
    return " ".join(text.split())


# Programs that are mergelab's commands (console scripts, and `python -m` of these modules).
COMMAND_NAMES = ("mergelab", "mergelab-lm-eval")
COMMAND_MODULES = ("mergelab", "mergelab.cli", "mergelab.eval.lm_eval_bridge")


def started_as_command() -> bool:
    """Whether this process is one of mergelab's commands (not Python importing mergelab)."""
    import sys

    if sys.argv and os.path.basename(sys.argv[0]) in COMMAND_NAMES:
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return "-m" in argv[:-1] and argv[argv.index("-m") + 1] in COMMAND_MODULES


def exit_quietly_when_interrupted() -> None:
    """Ctrl-C that no handler catches (while the command's modules are still being imported,
    before ``main`` runs) ends the command with one line and exit code 130, as an interrupt
    later does, instead of a traceback from inside an import."""
    import sys

    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            previous(kind, value, traceback)
            return
        name = os.path.basename(sys.argv[0]) if sys.argv else ""
        name = name if name in COMMAND_NAMES else "mergelab"
        try:
            print(f"{name}: {one_line(value)}", file=sys.stderr, flush=True)
        finally:
            os._exit(exit_code(value))

    sys.excepthook = hook


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C while the block runs (imports of torch and the like: a KeyboardInterrupt
    raised inside their C++ start-up can abort the process or be swallowed by it), then raise it
    once the block is done. Only where Python's own SIGINT handler is installed, in the main
    thread; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
