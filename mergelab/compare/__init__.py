"""``mergelab compare``: a researcher's comparison as a spec — models, candidate families over
grids, benchmarks with validation and test splits — run on one machine or a Ray cluster.

    import mergelab.compare
    results = mergelab.compare.run("spec.yaml", out="results/x")       # or a dict, see below
    print(open("results/x/table.md").read())

From Python the spec is the same mapping as the YAML file, and models, the tokenizer, benchmarks
and baselines may be objects::

    mergelab.compare.run({
        "models": {"base": base, "tokenizer": tok, "experts": {"math": m, "code": c}},
        "candidates": [{"family": "base"}, {"family": "expert"},
                       {"family": "merge", "method": "task_arithmetic",
                        "grid": {"lambda": [0.5, 1.0]}}],
        "benchmarks": [{"name": "math", "benchmark": math_bench,
                        "split": {"validation": 20, "test": 60}}],
    }, out="results/x")

docs/compare.md is the reference: every key of the spec and every field of results.json.
"""

from mergelab.compare.plan import Plan, make_plan
from mergelab.compare.report import draw_figures, markdown_table, plot_only
from mergelab.compare.results_file import RESULTS_SCHEMA, RESULTS_VERSION, load_results
from mergelab.compare.run import run
from mergelab.compare.spec import CompareSpec, SpecError, load_spec, parse_spec

__all__ = [
    "RESULTS_SCHEMA",
    "RESULTS_VERSION",
    "CompareSpec",
    "Plan",
    "SpecError",
    "draw_figures",
    "load_results",
    "load_spec",
    "make_plan",
    "markdown_table",
    "parse_spec",
    "plot_only",
    "run",
]
