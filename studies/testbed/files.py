"""The files of the testbed's results folder, recognised by their content: ``--force`` (and a
rerun) replaces only files this study wrote, never a file of the same name it did not."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def _read_json(path: Path) -> dict:
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return content if isinstance(content, dict) else {}


def study_file(name: str) -> Callable[[Path], bool]:
    """A predicate recognising the study's file ``name`` ("run" for ``runs/<id>.json``)."""
    if name == "results.csv":
        return lambda p: p.read_bytes().startswith(b"model,depth,alpha,overlap,seed,")
    if name == "config.json":
        return lambda p: _read_json(p).get("study") == "linear_testbed"
    if name == "summary.json":
        return lambda p: "composition_vs_ceiling" in _read_json(p)
    return lambda p: {"config", "spec", "rows"} <= set(_read_json(p))  # runs/<id>.json
