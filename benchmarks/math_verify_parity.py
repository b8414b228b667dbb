"""Which MATH answer checker to trust? math-verify, mergelab's own checker, and the hybrid, on
the MATH fixture answers and a table of hard cases, each with the verdict a careful grader gives.

Cases: ``tests/fixtures/eval/math_answer_pairs.jsonl`` — every MATH fixture solution against its
own answer, variants of those answers, the own checker's test table, and hard cases (sets,
choice letters, intervals, units, percentages, unordered solution lists). A case with a
``prediction`` is scored as the generation ``So the answer is $\\boxed{<prediction>}$.``; a case
with a ``generation`` (a whole fixture solution) as it is. Writes
``results/eval/math_verify_parity.json`` (verdicts per case, agreement per checker and category,
package versions); ``--markdown`` prints the table that docs/evaluators.md shows.

    python benchmarks/math_verify_parity.py
    python benchmarks/math_verify_parity.py --markdown
"""

from __future__ import annotations

import argparse
import hashlib
import json
from importlib.metadata import version
from pathlib import Path

from mergelab.eval.scoring_math import MATH_CHECKERS, math_correct
from mergelab.outputs import atomic_output_file

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "fixtures" / "eval" / "math_answer_pairs.jsonl"
OUT = ROOT / "results" / "eval" / "math_verify_parity.json"


def load_cases(path: Path = CASES) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def generation_of(case: dict) -> str:
    if "generation" in case:
        return case["generation"]
    return f"So the answer is $\\boxed{{{case['prediction']}}}$."


def verdicts(case: dict) -> dict[str, bool]:
    """Each checker's verdict on one case."""
    text = generation_of(case)
    return {c: math_correct(text, case["reference"], checker=c)[0] for c in MATH_CHECKERS}


def run(cases: list[dict]) -> dict:
    rows = []
    for case in cases:
        rows.append({**case, "verdicts": verdicts(case)})
    agreement: dict[str, dict[str, list[int]]] = {c: {} for c in MATH_CHECKERS}
    for row in rows:
        for checker, verdict in row["verdicts"].items():
            right, total = agreement[checker].setdefault(row["category"], [0, 0])
            agreement[checker][row["category"]] = [right + (verdict == row["equal"]), total + 1]
    summary = {
        c: {"right": sum(r for r, _ in cats.values()), "cases": len(rows), "by_category": cats}
        for c, cats in agreement.items()
    }
    return {
        "config": {
            "cases": str(CASES.relative_to(ROOT)),
            "cases_sha256": hashlib.sha256(CASES.read_bytes()).hexdigest(),
            "math_verify": version("math-verify"),
            "latex2sympy2_extended": version("latex2sympy2_extended"),
            "sympy": version("sympy"),
        },
        "summary": summary,
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """Agreement per category, then every case where some checker is wrong."""
    cats = list(dict.fromkeys(r["category"] for r in result["rows"]))
    lines = [
        "| category | cases | " + " | ".join(MATH_CHECKERS) + " |",
        "|---|---|" + "---|" * len(MATH_CHECKERS),
    ]
    for cat in [*cats, None]:
        counts = [
            result["summary"][c]["by_category"][cat]
            if cat
            else [result["summary"][c]["right"], result["summary"][c]["cases"]]
            for c in MATH_CHECKERS
        ]
        label = cat or "**all**"
        lines.append(
            f"| {label} | {counts[0][1]} | " + " | ".join(f"{r}/{n}" for r, n in counts) + " |"
        )
    lines += [
        "",
        "| prediction | reference | should be | " + " | ".join(MATH_CHECKERS) + " |",
        "|---|---|---|" + "---|" * len(MATH_CHECKERS),
    ]
    for row in result["rows"]:
        v = row["verdicts"]
        if all(v[c] == row["equal"] for c in MATH_CHECKERS):
            continue
        pred = row.get("prediction", "(whole solution)")
        marks = [
            ("equal" if v[c] else "differ") + ("" if v[c] == row["equal"] else " ✗")
            for c in MATH_CHECKERS
        ]
        lines.append(
            f"| `{pred}` | `{row['reference']}` | {'equal' if row['equal'] else 'differ'} "
            f"| " + " | ".join(marks) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--markdown", action="store_true", help="print the docs table too")
    args = parser.parse_args()
    result = run(load_cases())
    with atomic_output_file(args.out) as tmp:
        tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for c, s in result["summary"].items():
        print(f"{c:12s} {s['right']}/{s['cases']} verdicts right")
    if args.markdown:
        print(markdown(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
