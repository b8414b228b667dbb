"""What every study does with its results: write JSON atomically, save figures, and resume a run
only when the saved result was made with the same configuration.

    path = out / f"seed_{seed}.json"
    done = load_if_config_matches(path, cfg)            # None: missing, unreadable or stale
    if done is None:
        done = {"config": cfg, "rows": run(cfg)}
        write_json_atomic(path, done)
    save_figure(fig, figures / "toy_merges.png")

Writes go through :mod:`mergelab.outputs` (a temp file renamed over the output), so an
interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mergelab.outputs import atomic_output_file


def write_json_atomic(
    path: str | os.PathLike,
    obj: Any,
    *,
    indent: int | None = None,
    ensure_ascii: bool = False,
    force: bool = True,
    written_by_mergelab: Callable[[Path], bool] | None = None,
) -> Path:
    """Write ``obj`` as JSON to ``path`` (folders created), replacing it in one step; returns it.

    ``force=False`` refuses to replace an existing file (:class:`mergelab.outputs.OutputExistsError`);
    ``written_by_mergelab`` (a predicate on the existing file) refuses to replace a file it does
    not recognise (:class:`mergelab.outputs.ForeignOutputError`), as
    :func:`mergelab.outputs.check_output_file` does.
    """
    text = json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii)
    with atomic_output_file(path, force=force, written_by_mergelab=written_by_mergelab) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_figure(
    fig: Any, path: str | os.PathLike, *, dpi: int = 130, tight: bool = True, close: bool = True
) -> Path:
    """Save a matplotlib figure to ``path`` atomically (format from the suffix); returns it.

    ``tight`` crops to the drawn area (``bbox_inches="tight"``); ``close`` frees the figure.
    """
    path = Path(path)
    fmt = path.suffix.lstrip(".") or None
    with atomic_output_file(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=fmt, bbox_inches="tight" if tight else None)
    if close:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


def load_if_config_matches(
    path: str | os.PathLike, config: Any, *, key: str = "config"
) -> dict[str, Any] | None:
    """The JSON object saved at ``path`` if its ``key`` entry equals ``config``, else ``None``.

    ``None`` also when the file is missing, not valid JSON or not an object (a run to redo, not an
    error). ``config`` is compared as JSON would store it, so tuples equal lists.
    """
    try:
        saved = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(saved, dict) or key not in saved:
        return None
    return saved if saved[key] == json.loads(json.dumps(config)) else None


def fingerprint(obj: Any) -> str:
    """sha256 of ``obj`` as sorted JSON (a recipe, training data): equal content, equal digest."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def json_with_keys(*keys: str) -> Callable[[Path], bool]:
    """A ``written_by_mergelab`` predicate: the file is a JSON object holding all of ``keys`` (a
    results file of the kind about to be written), so a rerun may replace it."""

    def recognised(path: Path) -> bool:
        try:
            content = json.loads(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        return isinstance(content, dict) and all(k in content for k in keys)

    return recognised


def starts_with(prefix: str) -> Callable[[Path], bool]:
    """A ``written_by_mergelab`` predicate for text results (CSV, Markdown): the file begins
    with ``prefix`` (the header the writer puts first)."""
    return lambda path: Path(path).read_bytes().startswith(prefix.encode())
