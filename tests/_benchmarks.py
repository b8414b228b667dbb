"""The benchmark scripts (``benchmarks/``, not a package) imported as modules by the tests."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@contextlib.contextmanager
def benchmark_modules(
    monkeypatch, *names: str, imported: tuple[str, ...] = ()
) -> Iterator[list[ModuleType]]:
    """The scripts ``names`` imported from ``benchmarks/``; afterwards they and ``imported``
    (the scripts they import from there) leave ``sys.modules``, so every test imports them
    afresh."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    try:
        yield [importlib.import_module(name) for name in names]
    finally:
        for name in (*names, *imported):
            sys.modules.pop(name, None)
