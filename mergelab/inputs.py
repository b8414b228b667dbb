"""Reading the user's files: regular files only, of a sensible size, nested a sensible depth.

Every config, spec and data file mergelab reads goes through :func:`check_regular_file` before it
is opened: a FIFO would block the read forever, ``/dev/zero`` would fill memory, a folder or a
device is a mistake. ``os.stat`` answers without opening, so none of them can hang the check.
Configs are small, so :func:`read_config_bytes` also caps their size; parsed configs are checked
for depth (:func:`check_nesting`) and a parser's ``RecursionError`` becomes a line naming the
file (:func:`parse_nested`). Every refusal is a :class:`~mergelab.errors.UserInputError` (exit 2).
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from mergelab.errors import UserInputError

T = TypeVar("T")

MAX_CONFIG_BYTES = 16 * 2**20  # configs and specs: far beyond any real one
MAX_NESTING = 100  # levels of lists/mappings in a config (real ones use fewer than 10)

_KINDS = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_regular_file(path: str | os.PathLike, what: str, *, max_bytes: int | None = None) -> Path:
    """``path`` as a :class:`Path` if it is a regular file (a symbolic link to one is fine) of at
    most ``max_bytes``; ``FileNotFoundError`` if it does not exist, ``IsADirectoryError`` for a
    folder, else ``UserInputError`` saying what it is instead. ``what`` names the file's role ("benchmark file")."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} not found") from None
    except NotADirectoryError:
        raise FileNotFoundError(f"{what} {path} not found (a parent is not a folder)") from None
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{what} {path} is not a file: it is a folder")
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise UserInputError(f"{what} {path} is not a file: it is {kind}; give a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UserInputError(
            f"{what} {path} is {st.st_size:,} bytes; a {what} may have at most {max_bytes:,}"
        )
    return path


def read_config_bytes(
    path: str | os.PathLike, what: str, *, max_bytes: int = MAX_CONFIG_BYTES
) -> bytes:
    """The bytes of a config/spec file after :func:`check_regular_file` (read at most
    ``max_bytes + 1``: a file that grows meanwhile is refused too)."""
    path = check_regular_file(path, what, max_bytes=max_bytes)
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UserInputError(f"{what} {path} has more than {max_bytes:,} bytes")
    return data


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of lists/tuples/mappings in ``value`` (a scalar is 0), counted without recursion;
    stops counting once past ``limit``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_nesting(value: Any, where: str, limit: int = MAX_NESTING) -> Any:
    """``value`` unchanged, or ``UserInputError`` if it nests deeper than ``limit`` levels."""
    if nesting_depth(value, limit) > limit:
        raise UserInputError(f"{where}: nested more than {limit} levels deep; not a config")
    return value


def parse_nested(parse: Callable[[], T], where: str, limit: int = MAX_NESTING) -> T:
    """``parse()`` (a JSON/YAML/TOML parser call) with its ``RecursionError`` on deeply nested
    input reported as a line naming ``where``, and its result checked by :func:`check_nesting`."""
    try:
        value = parse()
    except RecursionError:
        raise UserInputError(
            f"{where}: nested too deeply to parse (more than {limit} levels); not a config"
        ) from None
    return check_nesting(value, where, limit)


# Files of a model or adapter folder that loaders open (weights, configs, tokenizer files).
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".pt")
# JSON configs of a model folder, parsed here to check their depth before any loader does.
MODEL_CONFIG_FILES = ("config.json", "generation_config.json", "adapter_config.json")


def check_model_folder(folder: str | os.PathLike, label: str | None = None) -> None:
    """The files a loader would open in ``folder`` are regular files (a FIFO named
    ``config.json`` would block the loader), and its JSON configs are of a sensible size and
    depth. A folder that does not exist is left to the caller (it says what it expected)."""
    import json

    folder = Path(folder)
    if not folder.is_dir():
        return
    label = label or str(folder)
    for entry in os.scandir(folder):
        if entry.name.endswith(MODEL_FILE_SUFFIXES) and not entry.is_dir():  # no loader opens one
            check_regular_file(entry.path, f"{entry.name} of {label}")
    for name in MODEL_CONFIG_FILES:
        path = folder / name
        if not path.exists():
            continue
        text = read_config_bytes(path, f"{name} of {label}").decode("utf-8", "replace")
        try:
            parse_nested(functools.partial(json.loads, text), str(path))
        except json.JSONDecodeError as exc:
            raise UserInputError(
                f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
            ) from None
