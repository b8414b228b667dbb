"""The README and the documentation pages hold together: every relative link and anchor resolves,
every number of the findings table and of the performance table equals its committed results
file, and the site's generated pages cover every public module. (CI also builds the site with
``mkdocs build --strict``.)"""

from __future__ import annotations

import csv
import json
import re
import statistics
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


def findings() -> list[str]:
    text = block(README.read_text(), "<!-- findings:start -->", "<!-- findings:end -->")
    return [row for row in text.splitlines() if row.startswith("| ") and "---" not in row][1:]


def load(path: str):
    return json.loads((ROOT / path).read_text())


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def toy_row(path, **match):
    rows = load(path)
    rows = rows["summary"] if isinstance(rows, dict) else rows
    (row,) = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    seeds = " / ".join(pct(s) for s in row["per_seed"])
    return row, f"{pct(row['mean'])}% ({seeds}), ", f"[{pct(row['ci_low'])}, {pct(row['ci_high'])}]"


def llm_score(run: str, candidate: str, bench: str) -> str:
    s = load(f"results/llm/{run}/results.json")["candidates"][candidate][bench]["score"]
    return f"{pct(s['mean'])} [{pct(s['low'])}, {pct(s['high'])}]"


def p2(x: float) -> str:
    return f"{x:.2g}" if x < 0.9995 else "1.0"


def expected_findings() -> list[list[str]]:
    """Per findings row, the strings it must contain, each computed from the results files."""
    rows = []
    authors, _, _ = toy_row(
        "results/toy/fast/summary.json",
        part="authors",
        method="composition",
        pair="A->B + C->D",
        metric="joint",
        x=None,
    )
    assert authors["per_seed"] == [1.0, 1.0, 1.0]
    rows.append([f"{pct(authors['mean'])}% in each of seeds 0/1/2", "part `authors`"])
    _, gen, gen_ci = toy_row(
        "results/toy/fast/summary.json",
        part="generative",
        method="composition",
        metric="joint",
        x=None,
    )
    rows.append([gen.rstrip(", "), gen_ci])
    _, four, four_ci = toy_row(
        "results/toy/many_experts.json",
        part="aligned, fine-tuned, set 1",
        method="composition",
        metric="joint exact match",
        x=4,
    )
    ta, _, _ = toy_row(
        "results/toy/many_experts.json",
        part="aligned, fine-tuned, set 1",
        method="task arithmetic λ=1",
        metric="joint exact match",
        x=4,
    )
    assert ta["per_seed"] == [1.0, 1.0, 1.0]
    rows.append([four + four_ci, f"task arithmetic λ = 1: {pct(ta['mean'])}% in each seed"])

    with open(ROOT / "results/testbed/results.csv") as f:
        kl = {}
        for r in csv.DictReader(f):
            if (r["model"], r["finetune"], r["method"], r["lambda"]) == (
                "mlp",
                "standard",
                "task_arithmetic",
                "1.0",
            ) and (float(r["overlap"]), float(r["alpha"])) == (0.0, 1.0):
                kl.setdefault(int(r["depth"]), []).append(float(r["kl_to_composition"]))
    assert all(len(v) == 3 for v in kl.values())
    gaps = " / ".join(f"{statistics.mean(kl[d]):.2f}" for d in (1, 2, 3))
    rows.append([f"{gaps} nats at depth 1 / 2 / 3, mean of 3 seeds"])

    pairs = load("results/llm/smollm2_seeds/summary.json")
    mc = pairs["mcnemar_vs_best_expert"]["math"]["composition"]
    rows.append(
        [
            f"composition {llm_score('smollm2', 'composition', 'math')} / "
            f"{llm_score('smollm2_seed1', 'composition', 'math')}",
            f"math expert {llm_score('smollm2', 'math_expert', 'math')} / "
            f"{llm_score('smollm2_seed1', 'math_expert', 'math')}",
            f"p = {mc[0]:.1g} / {mc[1]:.2g}",
        ]
    )
    floors = load("results/llm/floors.json")["committed_vs_floor"]
    seeds = [
        floors[f"results/llm/{r}"]["mixed"]["composition"] for r in ("smollm2", "smollm2_seed1")
    ]
    rows.append(
        [
            f"composition {pct(seeds[0]['score'])} vs the sum-of-numbers floor "
            f"{pct(seeds[0]['floor'])} (p = {p2(seeds[0]['p_value'])}) / {pct(seeds[1]['score'])} "
            f"vs {pct(seeds[1]['floor'])} (p = {p2(seeds[1]['p_value'])})"
        ]
    )
    ta_pairs = pairs["pairs"]["composition vs task_arithmetic"]
    cells = []
    for bench in ("math", "mixed"):
        a, b = ta_pairs[bench]
        cells.append(
            f"{bench} {pct(a['score_b'])} vs {pct(a['score_a'])} (p = {p2(a['p_value'])}) / "
            f"{pct(b['score_b'])} vs {pct(b['score_a'])} (p = {p2(b['p_value'])})"
        )
    rows.append(cells)
    term = pairs["termination"]
    two, three = term["2_experts/plain"]["math"]["score"], term["3_experts/plain"]["math"]["score"]
    rows.append(
        [
            f"math {pct(two['per_seed'][0])} → {pct(three['per_seed'][0])} (seed 0), "
            f"{pct(two['per_seed'][1])} → {pct(three['per_seed'][1])} (seed 1)",
            f"EOS policies: {pct(term['3_experts/base']['math']['score']['mean'])} too",
        ]
    )
    assert term["3_experts/most_confident"]["math"]["score"]["per_seed"] == three["per_seed"]
    combos, experts = [], []
    for seed in (0, 1, 2):
        cands = load(f"results/llm/mini_seed{seed}/results.json")["candidates"]
        experts.append(pct(cands["math_expert"]["math"]["score"]["mean"]))
        combos += [
            cands[c]["math"]["score"]["mean"]
            for c in cands
            if not c.endswith(("_expert", "_lora")) and c != "base"
        ]
    rows.append([f"at most {pct(max(combos))}% on math", f"math expert {' / '.join(experts)}"])
    rows.append(["not testable here"])
    return rows


def test_findings_numbers_equal_their_results_files():
    table = findings()
    expected = expected_findings()
    assert len(table) == len(expected)
    for row, wanted in zip(table, expected):
        for text in wanted:
            assert text in row, (text, row)


def test_findings_page_mirrors_the_readme_table():
    marks = ("<!-- findings:start -->", "<!-- findings:end -->")
    assert block((DOCS / "findings.md").read_text(), *marks) == block(README.read_text(), *marks)


def test_readme_performance_table_equals_its_results_file():
    text = block(README.read_text(), "\n## Performance\n", "\n## Documentation\n")
    (path,) = re.findall(r"`(benchmarks/results/merge_speed[^`]*\.json)`", text)
    data = load(path)
    assert data["config"]["threads"] == "each tool's default"
    assert data["config"]["cpu"]["family_model"] in text
    assert f"best of {data['config']['repeats']}" in text
    rows = {r["variant"]: r for r in data["rows"]}
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == 6
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        variant = cells[0].split(" (")[0]
        r = rows[variant]
        ml, mk = r["mergelab"], r["mergekit"]
        assert cells[1:] == [
            f"{ml['s']:.1f} s",
            f"{mk['s']:.1f} s",
            f"{r['speedup']:.1f}×",
            f"{ml['rss_mib']:.0f} / {mk['rss_mib']:.0f} MiB",
        ], line


def test_performance_table_is_the_latest_run_with_mergekit(monkeypatch):
    """The README shows the latest default-thread run that measured both tools, in the order
    benchmarks/merge_targets.py gives the runs (by the date of the commit each measured)."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    targets = importlib.import_module("merge_targets")
    try:
        runs = targets.collect()["default"]
    finally:
        sys.modules.pop("merge_targets", None)
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
