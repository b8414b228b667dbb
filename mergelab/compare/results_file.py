"""``results.json``, the one file a comparison's report is drawn from: its schema name and
version, how it is written (:func:`dump`) and read back (:func:`load_results`). The runner
(:mod:`mergelab.compare.run`) writes through this module and the report
(:mod:`mergelab.compare.report`) reads through it; neither imports the other's internals.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS_SCHEMA = "mergelab.compare.results"
RESULTS_VERSION = 1


def dump(results: Mapping[str, Any]) -> str:
    """The text of ``results.json`` (paths and tuples as JSON strings and lists)."""
    return json.dumps(results, indent=1, sort_keys=False, default=_json_default)


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, tuple):
        return list(o)
    return repr(o)


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """A ``results.json`` this mergelab can read; anything else is refused in one line."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("schema") != RESULTS_SCHEMA:
        raise ValueError(f"{path} is not a mergelab compare results file")
    if data.get("schema_version") != RESULTS_VERSION:
        raise ValueError(
            f"{path}: schema_version {data.get('schema_version')} is not "
            f"{RESULTS_VERSION}, the one this mergelab reads"
        )
    return data
