"""Pages generated at build time (mkdocs-gen-files), so they cannot drift from the code:

* ``reference/api/``: one page per public module of the ``mergelab`` package, found by walking
  the package's files (a module added on any branch gets its page), with a ``SUMMARY.md`` that
  literate-nav turns into the API section of the navigation;
* ``reference/methods.md``: after the hand-written table of equivalents, every registered merge
  method's docstring, parameters, defaults, allowed values and model counts, read from the
  registry (``mergelab.merge``);
* the figures the pages show, copied from ``figures/`` and ``results/compare/letters/figures/``
  (the results folders stay the only copy in the repository).
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mergelab"
sys.path.insert(0, str(ROOT))


def public_modules() -> list[str]:
    """Dotted names of every module and package of mergelab whose path has no ``_`` part."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts) or parts[-1] == "__main__":
            continue
        names.append(".".join(parts))
    return names


def api_pages() -> None:
    nav = mkdocs_gen_files.Nav()
    for name in public_modules():
        parts = name.split(".")
        doc = Path("reference", "api", *parts).with_suffix(".md")
        nav[tuple(parts)] = Path(*parts).with_suffix(".md").as_posix()
        with mkdocs_gen_files.open(doc, "w") as f:
            f.write(f"# `{name}`\n\n::: {name}\n")
        mkdocs_gen_files.set_edit_path(doc, Path("..", *parts[:-1], parts[-1] + ".py"))
    with mkdocs_gen_files.open("reference/api/SUMMARY.md", "w") as f:
        f.writelines(nav.build_literate_nav())


def _value(v) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "∞" if v > 0 else "−∞"
    return f"`{v!r}`" if isinstance(v, str) else f"`{v}`"


def method_section(m) -> str:
    """The generated reference of one registered method (``MergeMethod``)."""
    rows = []
    for key in m.per_model:
        default = m.per_model_defaults.get(key)
        rows.append((key, "per model", "required" if default is None else _value(default)))
    for key, default in m.global_defaults.items():
        rows.append((key.rstrip("_"), "global", _value(default)))
    lines = [f"### `{m.name}`", "", m.doc.strip(), ""]
    if rows:
        lines += ["| parameter | kind | default | allowed |", "|---|---|---|---|"]
        for key, kind, default in rows:
            allowed = ""
            choices = m.choices.get(key) or m.choices.get(key + "_")
            if choices:
                allowed = " \\| ".join(_value(c) for c in choices)
            interval = m.ranges.get(key) or m.ranges.get(key + "_")
            if interval is not None:
                allowed = str(interval).replace("inf", "∞")
            lines.append(f"| `{key}` | {kind} | {default} | {allowed} |")
        lines.append("")
    low, high = m.n_experts
    count = f"{low}" if low == high else f"{low} or more" if high is None else f"{low}–{high}"
    base = "needs a base model" if m.needs_base else "takes no base model"
    lines += [f"Models besides the base: {count}; {base}.", ""]
    return "\n".join(lines)


def methods_page() -> None:
    """Append the registry's sections to the hand-written ``reference/methods.md``."""
    from mergelab.merge import list_merge_methods
    from mergelab.merge.registry import get_merge_method

    sections = [method_section(get_merge_method(n)) for n in list_merge_methods()]
    with mkdocs_gen_files.open("reference/methods.md", "a") as f:
        f.write("\n## Every method, from the registry\n\n" + "\n".join(sections))


def copy_figures() -> None:
    for src, dest in (
        (ROOT / "figures", "figures"),
        (ROOT / "results" / "compare" / "letters" / "figures", "figures/compare"),
    ):
        for png in sorted(src.glob("*.png")):
            with mkdocs_gen_files.open(f"{dest}/{png.name}", "wb") as f:
                shutil.copyfileobj(png.open("rb"), f)


api_pages()
methods_page()
copy_figures()
