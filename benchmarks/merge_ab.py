"""mergelab against an earlier mergelab: the same streamed merges of ``merge_speed.py``'s
synthetic 1B set, run by two revisions of the code in alternation, to tell a change's effect
from the machine's noise (which moves single runs by a third here).

    python benchmarks/merge_ab.py --old 7f712a5 --variants ties breadcrumbs --repeats 3
    python benchmarks/merge_ab.py --old 7f712a5 --variants dare_ties --threads 1

``--layers N`` takes the smaller set ``merge_speed.py --layers N`` made instead (where a fixed
cost per process, such as start-up or exit, is a larger part of each run).

``--perf`` runs every merge under ``perf record`` (sampling at PERF_HZ, every thread) and keeps
each run's samples per shared object and per symbol of the compiled loops, and in the summary
the median new ÷ old ratio of the loops' samples: CPU time spent in each loop, which moves far
less from run to run than wall time does. perf's own work then adds a little to the CPU times of
both revisions alike, and under ``perf record`` a run's wall time comes out in steps of about a
second (every wall time in ``results/merge_ab_vector_loops_perf.log`` is 3.1, 4.1 or 5.1 s): with
``--perf`` the summary's wall-time ratio is None, and a change's effect on wall time needs a run
without it.

The old revision is checked out into a temporary git worktree (removed at the end: only what
this script created); the new one is this working tree. Both are byte-compiled and get their
compiled loops ready before the timed runs (built in place, or for revisions from before the C
loops, compiled into numba's cache), then every round runs
each variant with both, the order alternating from round to round, each in its own subprocess
at the default thread count (``--threads N``: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` set to N,
as ``merge_speed.py --threads`` does), after ``sync`` and with the inputs read through
(``run_measured``).
The inputs and both trees' files stay mapped for the whole run (``merge_speed.Resident``: this
machine pages out file pages nobody maps once they look idle for a minute). The results
(``--results``, JSON) hold every run's wall and CPU seconds and peak RSS, both revisions'
commits, and per variant the median of the new ÷ old wall-time ratios of the rounds (each
round's pair ran back to back).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from io_floor import shard_files
from merge_speed import (
    LOOPS_IMPORT,
    VARIANTS,
    Resident,
    add_set_arguments,
    load_average,
    mergelab_command,
    proactive_reclaim,
    run_measured,
    synthetic_set,
    tool_env,
    tool_files,
)

from mergelab.outputs import atomic_output_file

ROOT = Path(__file__).resolve().parent.parent


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def prepare(tree: Path, env: dict[str, str]) -> None:
    """Byte-compile the tree's package and get its compiled loops ready: built in place where
    the tree has them in C (setup.py), else (earlier revisions, numba) compiled into numba's
    cache by a first run."""
    if (tree / "setup.py").is_file():
        build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
        subprocess.run(build, cwd=tree, env=env, check=True, capture_output=True)
    code = (
        "import compileall, mergelab; compileall.compile_dir(mergelab.__path__[0], quiet=1)\n"
        + LOOPS_IMPORT
        + "getattr(kernels, 'warm_up', kernels.loops)()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True)


PERF_HZ = 997
LOOPS_DSO = "_loops."  # the compiled loops' shared object (its name starts with this)


def perf_samples(data: Path) -> dict:
    """Samples of a ``perf record`` file per shared object (``dso``) and, for the compiled loops,
    per symbol (``loops``), and in all (``total``)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "-n", "--sort", "dso,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total, by_dso, loops = 0, {}, {}
    for line in report.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 5 or not fields[0].endswith("%"):
            continue
        n, dso, symbol = int(fields[1]), fields[2], " ".join(fields[4:])
        total += n
        by_dso[dso] = by_dso.get(dso, 0) + n
        if dso.startswith(LOOPS_DSO):
            loops[symbol] = loops.get(symbol, 0) + n
    return {"hz": PERF_HZ, "total": total, "dso": by_dso, "loops": loops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="git revision to compare against")
    parser.add_argument("--variants", nargs="+", default=["ties", "breadcrumbs"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: each run's own")
    parser.add_argument(
        "--perf", action="store_true", help="sample each run with perf record (see above)"
    )
    add_set_arguments(parser, "benchmarks/results/merge_ab.json")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    folder, work, models = synthetic_set(parser, args)
    commits = {"old": git("rev-parse", args.old), "new": git("rev-parse", "HEAD")}
    dirty = bool(git("status", "--porcelain", "--", "mergelab"))
    scratch = Path(tempfile.mkdtemp(prefix="merge-ab-"))
    old_tree = scratch / "old"
    git("worktree", "add", "--detach", str(old_tree), commits["old"])
    trees = {"old": old_tree, "new": ROOT}
    runs: dict[str, dict[str, list[dict]]] = {v: {"old": [], "new": []} for v in args.variants}
    try:
        files = set(shard_files(models))
        for tree in trees.values():
            env = {**tool_env(args.threads), "PYTHONPATH": str(tree)}
            prepare(tree, env)
            files.update(tool_files(env, cwd=tree))
        held = Resident(sorted(files))  # see merge_speed.Resident
        print(f"held in memory: {held.summary()}")
        for round_ in range(args.repeats):
            for i, variant in enumerate(args.variants):
                order = ["old", "new"] if (round_ + i) % 2 == 0 else ["new", "old"]
                for name in order:
                    env = {**tool_env(args.threads), "PYTHONPATH": str(trees[name])}
                    cmd, out = mergelab_command(variant, folder, work)
                    shutil.rmtree(out, ignore_errors=True)
                    data = scratch / "perf.data"
                    if args.perf:
                        cmd = ["perf", "record", "-q", "-F", str(PERF_HZ), "-o", str(data), *cmd]
                    run = run_measured(cmd, env, cwd=str(trees[name]), warm=models)
                    wall, cpu = run.wall, run.cpu
                    shutil.rmtree(out, ignore_errors=True)
                    if run.returncode != 0:
                        raise SystemExit(f"{name} {variant} failed ({run.returncode})")
                    runs[variant][name].append(
                        {
                            "s": round(wall, 2),
                            "cpu_s": round(cpu, 2),
                            "rss_mib": round(run.rss_mib),
                            "waits_s": run.waits,
                        }
                    )
                    if args.perf:
                        runs[variant][name][-1]["perf"] = perf_samples(data)
                        data.unlink()
                    print(
                        f"round {round_ + 1} {variant:18s} {name}  {wall:6.1f} s  cpu {cpu:5.1f} s"
                        f"  load {load_average()}",
                        flush=True,
                    )
    finally:
        git("worktree", "remove", "--force", str(old_tree))
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {}
    for variant, by in runs.items():
        ratios = [n["s"] / o["s"] for o, n in zip(by["old"], by["new"])]
        cpu_ratios = [n["cpu_s"] / o["cpu_s"] for o, n in zip(by["old"], by["new"])]
        summary[variant] = {
            "old_best_s": min(r["s"] for r in by["old"]),
            "new_best_s": min(r["s"] for r in by["new"]),
            # perf record's wall times are in steps of about a second (see above)
            "median_new_over_old": None if args.perf else round(statistics.median(ratios), 3),
            "median_cpu_new_over_old": round(statistics.median(cpu_ratios), 3),
        }
        if args.perf:
            summary[variant].update(perf_summary(by))
        print(f"{variant:18s} " + "  ".join(f"{k} {v}" for k, v in summary[variant].items()))
    record = {
        "config": {
            "old": commits["old"],
            "new": commits["new"],
            "new_has_uncommitted_changes": dirty,
            "variants": args.variants,
            "repeats": args.repeats,
            "layers": args.layers,
            "threads": args.threads if args.threads is not None else "default",
            "perf_hz": PERF_HZ if args.perf else None,
            "cpu_count": os.cpu_count(),
            "proactive_reclaim": proactive_reclaim(),
            "held_in_memory": held.summary(),
        },
        "summary": summary,
        "runs": runs,
    }
    with atomic_output_file(args.results) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {args.results}")
    return 0


def perf_summary(by: dict[str, list[dict]]) -> dict:
    """Per revision, the median CPU seconds in the compiled loops and in all (perf samples ÷
    PERF_HZ), and per loop symbol; the median new ÷ old ratio of the loops' samples (rounds
    paired)."""

    def loops(run: dict) -> int:
        return sum(run["perf"]["loops"].values())

    pairs = [(loops(o), loops(n)) for o, n in zip(by["old"], by["new"])]
    out: dict = {  # None where the old revision's runs spent no samples in compiled loops
        "median_loops_new_over_old": round(statistics.median(n / o for o, n in pairs), 3)
        if all(o for o, _ in pairs)
        else None
    }
    for name, runs in by.items():
        symbols = sorted({s for r in runs for s in r["perf"]["loops"]})
        out[f"{name}_cpu_s"] = {
            "all": round(statistics.median(r["perf"]["total"] for r in runs) / PERF_HZ, 2),
            "loops": round(statistics.median(loops(r) for r in runs) / PERF_HZ, 2),
            **{
                s: round(statistics.median(r["perf"]["loops"].get(s, 0) for r in runs) / PERF_HZ, 2)
                for s in symbols
            },
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
