"""How many test items the smollm2 study needs: the power of the exact McNemar test.

Two candidates scored on the same n items differ on a fraction r of them (the discordant pairs);
a true difference d in accuracy means the pairs split (r + d)/2 vs (r − d)/2. The power of the
two-sided exact McNemar test at α = 0.05 is :func:`mergelab.eval.stats.mcnemar_power` (exact, a
sum over the binomial number of discordant pairs). The rate r is what the committed n = 40 runs
show for the comparisons the study's claims are made from; ``results/llm/smollm2_power.json``
holds those rates and the power at each n::

    python -m studies.llm.power results/llm/smollm2_power.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mergelab.eval.stats import items_for_power, mcnemar_power
from mergelab.results import json_with_keys, write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
DIFFERENCE = 0.15  # the difference the study must detect
TARGET_POWER = 0.8
SOURCES = ("results/llm/smollm2/results.json", "results/llm/smollm2_seed1/results.json")
# the comparisons the claims are made from: composition against each other row
PAIRS = [
    ("composition", other)
    for other in ("task_arithmetic", "ties", "dare_ties", "linear", "math_expert", "code_expert")
]
BENCHMARKS = ("math", "mixed")
SIZES = (40, 100, 150)


def discordant_rate(a: dict[str, float], b: dict[str, float]) -> float:
    """The share of shared items on which two candidates' pass/fail outcomes differ."""
    ids = [i for i in a if i in b]
    return sum((a[i] == 1.0) != (b[i] == 1.0) for i in ids) / len(ids)


def power_summary(root: Path = ROOT) -> dict[str, Any]:
    rates = []
    for source in SOURCES:
        cands = json.loads((root / source).read_text())["candidates"]
        for bench in BENCHMARKS:
            for a, b in PAIRS:
                r = discordant_rate(cands[a][bench]["per_item"], cands[b][bench]["per_item"])
                rates.append(
                    {
                        "source": source,
                        "benchmark": bench,
                        "pair": f"{a} vs {b}",
                        "discordant_rate": r,
                    }
                )
    values = sorted(x["discordant_rate"] for x in rates)
    quartile = values[(3 * len(values)) // 4]
    grid = [0.25, 0.3, 0.35, 0.4, 0.5]
    return {
        "difference": DIFFERENCE,
        "alpha": 0.05,
        "target_power": TARGET_POWER,
        "test": "two-sided exact McNemar (mergelab.eval.stats.mcnemar_power)",
        "observed_discordant_rates": rates,
        "observed_median": values[len(values) // 2],
        "observed_upper_quartile": quartile,
        "power": {f"{r:g}": {str(n): mcnemar_power(n, r, DIFFERENCE) for n in SIZES} for r in grid},
        "items_needed": {f"{r:g}": items_for_power(r, DIFFERENCE, TARGET_POWER) for r in grid},
        "items_needed_at_upper_quartile": items_for_power(quartile, DIFFERENCE, TARGET_POWER),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m studies.llm.power OUT.json", file=sys.stderr)
        return 2
    write_json_atomic(
        Path(argv[0]),
        power_summary(),
        indent=1,
        written_by_mergelab=json_with_keys("difference", "items_needed"),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
