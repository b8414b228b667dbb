"""Plugins: a user's merge methods and evaluation tasks, loaded from outside mergelab.

A plugin is Python code that registers names with mergelab's registries when it is imported —
``@merge_method`` (:mod:`mergelab.merge.registry`) or ``register_task``
(:mod:`mergelab.eval.tasks`). It is found in one of three ways (docs/guides/plugins.md):

* a ``.py`` file: ``--plugin my_methods.py``, or ``plugins: [my_methods.py]`` in a merge config or
  a compare spec (relative paths are read from the folder of the file that names them);
* a module: ``--plugin my_pkg.methods`` (imported as Python imports it; when it is not importable
  from ``sys.path``, from the folder of the file or the working directory that names it);
* an installed distribution that declares an entry point in the group ``mergelab.plugins``
  (``[project.entry-points."mergelab.plugins"] my_methods = "my_pkg.methods"``): every such entry
  point is imported the first time a registry is asked for a name or its list, in any process —
  the CLI, a Python session, a Ray worker. Loading them then rather than at CLI start keeps
  ``mergelab --help`` and commands that look nothing up from paying for other packages' imports,
  and gives Python users and workers the same names as the CLI without a setup step.

Every registered name keeps its origin (``builtin``, ``file /abs/x.py``, ``module my_pkg.m``,
``entry point name (dist 1.0)``), shown next to it when a name is unknown. A missing file, a
module that cannot be found, a plugin that raises while it is imported, or a name it registers
that is already taken, is one :class:`PluginError` line (exit code 2).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

from mergelab.errors import UserInputError

ENTRY_POINT_GROUP = "mergelab.plugins"
BUILTIN = "builtin"
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

# plugin key ("file /abs/x.py" | "module pkg.m" | "entry point ...") -> the imported module
_LOADED: dict[str, ModuleType] = {}
# module name -> origin, for every module a plugin brought in under its own name
_MODULE_ORIGINS: dict[str, str] = {}
# origins of the plugins being imported right now (innermost last)
_LOADING: list[str] = []
_entry_points_loaded = False


class PluginError(UserInputError):
    """A plugin that cannot be loaded: missing, failing on import, or clashing with a name."""


def is_file_plugin(spec: str) -> bool:
    """Whether ``spec`` names a ``.py`` file (else it is a module name, perhaps resolved)."""
    return spec.endswith(".py") or not _MODULE_NAME.fullmatch(spec.partition("@")[0])


def resolve(spec: str | os.PathLike, base_dir: str | os.PathLike | None = None) -> str:
    """``spec`` as it can be loaded from any working directory and any process: a file made
    absolute (relative to ``base_dir``, default the working directory), a module name as given
    with ``@<base_dir>`` appended, the folder it may be imported from (see :func:`load_plugin`)."""
    if not isinstance(spec, (str, os.PathLike)) or not str(os.fspath(spec)).strip():
        raise PluginError(f"plugin: expected a .py file or a module name, got {spec!r}")
    text = str(os.fspath(spec))
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    if is_file_plugin(text):
        path = Path(os.path.expanduser(text))
        return str((path if path.is_absolute() else base / path).resolve())
    if "@" in text:  # already resolved
        return text
    return f"{text}@{base.resolve()}"


def load_plugins(
    specs: Iterable[str | os.PathLike] | None, base_dir: str | os.PathLike | None = None
) -> list[str]:
    """Load every plugin in ``specs`` (files or module names; see :func:`load_plugin`); returns
    their resolved forms, which load the same plugins from any directory or worker process."""
    return [load_plugin(spec, base_dir) for spec in specs or ()]


def load_plugin(spec: str | os.PathLike, base_dir: str | os.PathLike | None = None) -> str:
    """Import one plugin (once per process: loading it again does nothing) and return its
    resolved form (:func:`resolve`). A file is run as a module of its own; a module name is
    imported from ``sys.path``, else from ``base_dir``."""
    resolved = resolve(spec, base_dir)
    if is_file_plugin(resolved):
        key = f"file {resolved}"
        if key not in _LOADED:
            _LOADED[key] = _import_file(Path(resolved), key)
    else:
        name, _, folder = resolved.partition("@")
        key = f"module {name}"
        if key not in _LOADED:
            _LOADED[key] = _import_module(name, folder, key)
    return resolved


def _import_file(path: Path, origin: str) -> ModuleType:
    if not path.is_file():
        raise PluginError(f"plugin file {path} does not exist")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_mergelab_plugin_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin file {path} cannot be imported (not a Python source file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up by its name
    _MODULE_ORIGINS[name] = origin
    try:
        with _loading(origin):
            spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(name, None)
        _MODULE_ORIGINS.pop(name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise _failed(f"plugin file {path}", exc) from exc
    return module


def _import_module(name: str, folder: str, origin: str) -> ModuleType:
    def attempt() -> ModuleType:
        with _loading(origin):
            return importlib.import_module(name)

    top = name.split(".")[0]
    try:
        try:
            module = attempt()
        except ModuleNotFoundError as exc:
            local = Path(folder) if folder else None
            if exc.name != top or local is None or not _has_module(local, top):
                raise
            if str(local) not in sys.path:
                sys.path.append(str(local))
            module = attempt()
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            where = f" (nor in {folder})" if folder else ""
            raise PluginError(f"plugin module {name!r} not found on sys.path{where}") from None
        raise _failed(f"plugin module {name!r}", exc) from exc
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise _failed(f"plugin module {name!r}", exc) from exc
    _MODULE_ORIGINS.setdefault(name, origin)
    return module


def _has_module(folder: Path, top: str) -> bool:
    return (folder / top).is_dir() or (folder / f"{top}.py").is_file()


def _failed(what: str, exc: BaseException) -> PluginError:
    if isinstance(exc, PluginError):  # a plugin loading another one: keep the innermost line
        return exc
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (ValueError, TypeError)) and "already registered" in text:
        return PluginError(f"{what}: {text}")
    return PluginError(f"{what} failed to import: {type(exc).__name__}: {text}")


@contextlib.contextmanager
def _loading(origin: str) -> Iterator[None]:
    _LOADING.append(origin)
    try:
        yield
    finally:
        _LOADING.pop()


def origin_of(module: str | None) -> str:
    """Where a function defined in ``module`` came from: the plugin being imported right now,
    ``builtin`` for mergelab's own modules, the plugin that brought ``module`` in (or one of its
    parent packages), else ``module <name>`` (code a user imported themselves)."""
    if _LOADING:
        return _LOADING[-1]
    if not module:
        return "unknown"
    if module == "mergelab" or module.startswith("mergelab."):
        return BUILTIN
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        found = _MODULE_ORIGINS.get(".".join(parts[:n]))
        if found is not None:
            return found
    return f"module {module}"


def describe_registered(origins: dict[str, str]) -> str:
    """``name → origin`` as one line grouped by origin: ``builtin: a, b; file /x.py: c``."""
    groups: dict[str, list[str]] = {}
    for name in sorted(origins):
        groups.setdefault(origins[name], []).append(name)
    order = sorted(groups, key=lambda o: (o != BUILTIN, o))
    return "; ".join(f"{o}: {', '.join(groups[o])}" for o in order) or "none"


def load_entry_points() -> None:
    """Import every ``mergelab.plugins`` entry point, once per process (the registries call this
    before their first lookup). An entry point names a module, or a function called with no
    arguments."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        made_by = f" ({dist.name} {dist.version})" if dist is not None else ""
        origin = f"entry point {ep.name}{made_by}"
        if origin in _LOADED:
            continue
        try:
            with _loading(origin):
                target = ep.load()
                if callable(target) and not isinstance(target, ModuleType):
                    target()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise _failed(f"plugin {origin} = {ep.value}", exc) from exc
        module = target if isinstance(target, ModuleType) else sys.modules.get(ep.module)
        if module is not None:
            _MODULE_ORIGINS.setdefault(module.__name__, origin)
        _LOADED[origin] = module


def loaded() -> list[str]:
    """The plugins loaded in this process (their keys: ``file …``, ``module …``, ``entry point
    …``), in loading order."""
    return list(_LOADED)


def add_plugin_argument(parser) -> None:
    """``--plugin FILE.py|MODULE`` (repeatable) on a subcommand's parser."""
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE.py|MODULE",
        help="load a user's merge methods or evaluation tasks from a .py file or an importable "
        "module before anything else (repeatable; docs/guides/plugins.md)",
    )


def load_from_args(args) -> list[str]:
    """Load the ``--plugin`` values of a parsed command line (relative to the working
    directory); returns their resolved forms."""
    return load_plugins(getattr(args, "plugin", None) or (), Path.cwd())


def check_list(value: object, where: str) -> Sequence[str]:
    """A config's ``plugins`` value: a list of strings (one string is taken as a list of one)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PluginError(f"{where}: plugins must be a list of .py files or module names")
    return value
