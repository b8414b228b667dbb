"""Where a streamed merge's wall time goes: ``merge_speed.py``'s merges of its synthetic 1B set,
each `mergelab merge` run in its own process with a few of the engine's steps timed.

    python benchmarks/merge_timeline.py --variants linear ties breadcrumbs --repeats 3

Each run is split into

* ``start_s``: from starting the process to the first tensor's merge (Python's start, the
  imports, torch's among them, reading the config and the inputs' headers, planning, and for
  whole-model TIES its passes over the model); ``imports_s``, the part up to the engine's
  import;
* ``merge_s``: from there to the end of the last tensor's write;
* ``end_s``: from there to the process's end (the index and config files, the output moved
  into place, the output it replaces removed, exit),

and the busy seconds of the threads over the merge: the chunk workers merging tensors whole
(``workers_busy_s``, summed over the workers, mapping the inputs left out), the main thread
merging tensors in its turn on every core (``in_turn_s``, its wall time: the large tensors, or
every tensor on one thread) and the writer writing (``writer_busy_s``). A merge
phase whose workers are busy for about twice its length waits on the CPU; one whose writer is
busy for about all of it waits on writing the output.

The timing comes from a wrapper that runs in the merge's process (``--child``): it wraps
``CheckpointMergePlan.merge_loaded`` (one tensor's merge, on whichever thread merges it) and
``ShardWriter.write`` (engine
internals: if they are renamed, this script stops with the AttributeError) and then runs the
``mergelab`` command as the console script does, ending the same way. Both processes read the
same monotonic clock. Variants alternate within each round; the inputs stay mapped for the whole
run as in ``merge_speed.py`` (``Resident``). The results (``--results``, JSON) keep every run and
per variant the median of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EVENTS_ENV = "MERGELAB_TIMELINE_OUT"


def child(argv: list[str]) -> None:
    """Run ``mergelab`` with ``argv`` in this process, recording the engine's steps; the events go
    to the JSON file named by the environment variable EVENTS_ENV when the command exits."""
    import atexit
    import threading

    imported = time.perf_counter()
    import mergelab.merge.checkpoint as checkpoint
    from mergelab import cli

    events: list[tuple[str, str, float, float]] = []
    times = {"child_started": imported, "engine_imported": time.perf_counter()}

    def timed(cls: type, name: str, kind: str) -> None:
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                end = time.perf_counter()
                events.append((kind, threading.current_thread().name, start, end))

        setattr(cls, name, wrapper)

    timed(checkpoint.CheckpointMergePlan, "merge_loaded", "merge")
    timed(checkpoint.ShardWriter, "write", "write")

    def dump() -> None:
        times["exit_handlers"] = time.perf_counter()
        Path(os.environ[EVENTS_ENV]).write_text(json.dumps({"times": times, "events": events}))

    atexit.register(dump)
    sys.argv = ["mergelab", *argv]
    cli.main()  # as the console script: ends the process


def summarise(started: float, ended: float, record: dict) -> dict:
    """One run's parts (module docstring) from the child's events."""
    events = record["events"]
    merges = [e for e in events if e[0] == "merge"]
    writes = [e for e in events if e[0] == "write"]
    first, last = min(e[2] for e in merges), max(e[3] for e in writes)
    main = [e for e in merges if e[1] == "MainThread"]
    return {
        "wall_s": ended - started,
        "start_s": first - started,
        "imports_s": record["times"]["engine_imported"] - started,
        "merge_s": last - first,
        "end_s": ended - last,
        "workers_busy_s": sum(e[3] - e[2] for e in merges if e[1] != "MainThread"),
        "in_turn_s": sum(e[3] - e[2] for e in main),
        "writer_busy_s": sum(e[3] - e[2] for e in writes),
        "tensors": len(writes),
    }


def run_once(variant: str, folder: Path, work: Path) -> dict:
    from merge_speed import mergelab_command

    cmd, _ = mergelab_command(variant, folder, work)
    argv = cmd[cmd.index("mergelab.cli") + 1 :]
    events = work / f"timeline-{variant}.json"
    env = {**os.environ, EVENTS_ENV: str(events)}
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", *argv], env=env, check=True
    )
    ended = time.perf_counter()
    try:
        return summarise(started, ended, json.loads(events.read_text()))
    finally:
        events.unlink()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    sys.path.insert(0, str(HERE))
    from io_floor import shard_files
    from merge_speed import (
        VARIANTS,
        Resident,
        add_set_arguments,
        load_average,
        run_config,
        save_results,
        synthetic_set,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_arguments(parser, "benchmarks/results/merge_timeline.json")
    parser.add_argument("--variants", nargs="+", default=["linear", "ties"], choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    folder, work, models = synthetic_set(parser, args)
    held = Resident(shard_files(models))
    load_before = load_average()
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for round_ in range(args.repeats):
        order = args.variants if round_ % 2 == 0 else args.variants[::-1]
        for variant in order:
            run = run_once(variant, folder, work)
            runs[variant].append(run)
            parts = "  ".join(f"{k} {v:.2f}" for k, v in run.items() if k.endswith("_s"))
            print(f"round {round_ + 1} {variant:<18} {parts}", flush=True)
    medians = {
        v: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0] if k.endswith("_s")}
        for v, rs in runs.items()
    }
    print("\nmedians (seconds)")
    for v, m in medians.items():
        print(f"{v:<18}", "  ".join(f"{k} {x:.2f}" for k, x in m.items()))
    record = {
        "config": run_config(folder, args, held, load_before),
        "medians": medians,
        "runs": runs,
    }
    save_results(args.results, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
