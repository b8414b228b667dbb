"""The README and the documentation pages hold together: every relative link and anchor resolves,
every number of the findings table and of the performance table equals its committed results
file, and the site's generated pages cover every public module. (CI also builds the site with
``mkdocs build --strict``.)"""

from __future__ import annotations

import json
import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# pages written at build time by docs/gen_pages.py (mkdocs-gen-files), besides the committed ones
GENERATED = ("reference/api/", "figures/")


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) and GitHub give a heading, for plain headings."""
    text = re.sub(r"[`*_]", "", heading.strip()).replace("\u2019", "'")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@cache
def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def check_links(page: Path, inside: Path) -> list[str]:
    """The relative links of ``page`` that point nowhere under ``inside`` (or at a missing
    heading of a Markdown file); links to generated pages are checked by the build."""
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        where = (page.parent / target).resolve() if target else page
        rel = (
            where.relative_to(inside.resolve()) if where.is_relative_to(inside.resolve()) else None
        )
        if rel is None:
            broken.append(f"{link} (outside {inside.name})")
        elif rel.as_posix().startswith(GENERATED) or (
            rel.as_posix() == "reference/api" and inside == DOCS
        ):
            continue
        elif not where.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{link} (no heading #{anchor})")
    return broken


def test_readme_links_resolve():
    assert check_links(README, ROOT) == []


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: p.name)
def test_docs_links_resolve(page):
    assert check_links(page, DOCS) == []


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    missing = {p for p in pages if f": {p}" not in nav}
    assert missing == set()


def test_every_public_module_gets_an_api_page():
    """docs/gen_pages.py walks the package; each module it finds is one that exists, and every
    module file of mergelab outside private (``_``) names is among them."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gen_pages_probe", DOCS / "gen_pages.py")
    source = (DOCS / "gen_pages.py").read_text()
    # run only the function definitions: mkdocs_gen_files needs a build to write into
    body = source.split("\napi_pages()\n")[0].replace("import mkdocs_gen_files\n", "")
    module = type(sys)("gen_pages_probe")
    module.__file__ = spec.origin
    exec(compile(body, spec.origin, "exec"), module.__dict__)  # noqa: S102 - our own file
    names = module.public_modules()
    files = [p for p in (ROOT / "mergelab").rglob("*.py") if not p.name.startswith("_")]
    assert len(names) >= len(files) - 1
    for name in ("mergelab.merge.registry", "mergelab.compare.report", "mergelab.eval.sandbox"):
        assert name in names


# --- numbers: each one read from its results file --------------------------------------------


def block(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end)]


def load(path: str):
    return json.loads((ROOT / path).read_text())


def test_readme_findings_block_is_the_generators_table():
    """The README's findings table is studies.findings' short table of the committed results
    (`python -m studies.findings --readme README.md` writes it)."""
    from studies import findings

    inside = README.read_text().split(findings.START)[1].split(findings.END)[0]
    assert inside.strip() == findings.short_table(findings.findings(ROOT)).strip()


def test_readme_performance_tables_equal_their_results_file():
    """The README's two merge tables are its results file's: first the mergekit-format configs
    (`mergekit_format_rows`), then the float32 table (`rows`), every cell."""
    text = block(README.read_text(), "\n## Performance\n", "\n## Documentation\n")
    (path,) = re.findall(r"`(benchmarks/results/merge_speed[^`]*\.json)`", text)
    data = load(path)
    assert data["config"]["threads"] == "each tool's default"
    assert data["config"]["cpu"]["family_model"] in text
    assert f"best of {data['config']['repeats']}" in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    heads = [i for i, line in enumerate(lines) if line.startswith(("| config", "| method"))]
    assert len(heads) == 2
    first, second = lines[heads[0] + 1 : heads[1]], lines[heads[1] + 1 :]

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    def expected(r: dict, *middle: str) -> list[str]:
        ml, mk = r["mergelab"], r["mergekit"]
        head = [f"{ml['s']:.1f} s", f"{mk['s']:.1f} s", f"{r['speedup']:.1f}×"]
        return [*head, *middle, f"{ml['rss_mib']:.0f} / {mk['rss_mib']:.0f} MiB"]

    formats = {r["variant"]: r for r in data["mergekit_format_rows"]}
    assert [cells(line)[0] for line in first] == list(formats)
    for line in first:
        r = formats[cells(line)[0]]
        assert cells(line)[1:] == expected(r, f"{r['over_linear']:.2f}"), line
    rows = {r["variant"]: r for r in data["rows"]}
    assert len(second) == 6
    for line in second:
        assert cells(line)[1:] == expected(rows[cells(line)[0].split(" (")[0]]), line
    ratios = [r["over_linear_cpu"] for v, r in formats.items() if v != "linear"]
    assert f"{min(ratios):.2f}–{max(ratios):.2f}× mergelab's linear merge" in text


def test_performance_table_is_the_latest_run_with_mergekit(monkeypatch):
    """The README shows the latest default-thread run that measured both tools, in the order
    benchmarks/merge_targets.py gives the runs (by the date of the commit each measured)."""
    from _benchmarks import benchmark_modules

    with benchmark_modules(monkeypatch, "merge_targets") as (targets,):
        runs = targets.collect()["default"]
    with_mergekit = [
        r["file"]
        for r in runs
        if any(
            (row.get("mergekit") or {}).get("s")
            for row in load(f"benchmarks/results/{r['file']}")["rows"]
        )
    ]
    (shown,) = re.findall(r"`benchmarks/results/(merge_speed[^`]*\.json)`", README.read_text())
    assert shown == with_mergekit[-1]
