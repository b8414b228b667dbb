"""How much of a per-tensor TIES (or breadcrumbs) merge's wall time is finding its thresholds:
``merge_speed.py``'s merges of its synthetic 1B set, each ``mergelab merge`` in its own process,
once as it runs and once with every per-tensor threshold replayed from an earlier run.

    python benchmarks/threshold_share.py --variants linear ties breadcrumbs --repeats 3

For each variant that finds per-tensor thresholds, a first run (``record``, not timed) keeps the
result of every ``ops.tau_kth_largest_abs`` call, the exact k-th largest |τ_i| of one tensor
(its sampled pass and its exact pass over the tensor), by tensor name and ranks. Then each round
times the merge as it runs (``normal``) and the same merge with those calls answered from the
record (``replay``: no pass over the inputs to find a threshold; everything else the same).
The first replay's output is compared with the normal run's, file by file: they must be equal
byte for byte, or the script stops. ``normal − replay`` is what the threshold passes cost in
wall time, what a merge that found its thresholds while merging could at most save.

The replay runs in the merge's process (``--child``): it wraps
``CheckpointMergePlan._load_ahead`` and ``_merge_loaded`` (to know the tensor, on whichever
thread finds its thresholds) and replaces ``ops.tau_kth_largest_abs`` (engine internals: if
they are renamed, this script stops with the AttributeError). Variants alternate within each
round and the inputs stay mapped for the whole run, as in ``merge_speed.py`` (``Resident``).
The results (``--results``, JSON) keep every run and the medians.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("record", "replay")


def _key(name: str, ranks: list[list[int]]) -> str:
    return json.dumps([name, ranks])


def child(mode: str, cache: str, argv: list[str]) -> None:
    """Run ``mergelab`` with ``argv`` in this process, recording (``mode`` "record") every
    per-tensor threshold into the JSON file ``cache`` when the command exits, or answering
    them from it ("replay")."""
    import atexit
    import threading

    import mergelab.merge.checkpoint as checkpoint
    import mergelab.merge.ops as ops
    from mergelab import cli

    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}")
    current = threading.local()

    def naming(name: str) -> None:
        original = getattr(checkpoint.CheckpointMergePlan, name)

        def wrapper(self, t, *args, **kwargs):
            current.name = t.name
            return original(self, t, *args, **kwargs)

        setattr(checkpoint.CheckpointMergePlan, name, wrapper)

    naming("_load_ahead")
    naming("_merge_loaded")
    found = ops.tau_kth_largest_abs
    store: dict[str, list[list[float]]] = {}
    if mode == "replay":
        store = json.loads(Path(cache).read_text())

    def thresholds(base, experts, ranks, dtype=None):
        key = _key(current.name, ranks)
        if mode == "replay":
            return store[key]
        values = found(base, experts, ranks, dtype)
        store[key] = values
        return values

    ops.tau_kth_largest_abs = thresholds
    if mode == "record":
        atexit.register(lambda: Path(cache).write_text(json.dumps(store)))
    sys.argv = ["mergelab", *argv]
    cli.main()  # as the console script: ends the process


def _timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def run_variant(
    variant: str, folder: Path, work: Path, mode: str | None, out: Path | None = None
) -> float:
    """Wall seconds of one ``mergelab merge`` of ``variant``: as it runs (``mode`` None) or
    recording or replaying its thresholds (cache ``work/thresholds-<variant>.json``); ``out``
    instead of the command's own output folder."""
    from merge_speed import mergelab_command

    cmd, _ = mergelab_command(variant, folder, work)
    if out is not None:
        cmd[cmd.index("--out") + 1] = str(out)
    if mode is None:
        return _timed(cmd)
    argv = cmd[cmd.index("mergelab.cli") + 1 :]
    cache = work / f"thresholds-{variant}.json"
    script = str(Path(__file__).resolve())
    return _timed([sys.executable, script, "--child", mode, str(cache), *argv])


def same_output(a: Path, b: Path) -> bool:
    """Whether two merge outputs hold the same files with the same bytes (the merge record
    and model card, which name the output, left out)."""
    from mergelab.merge.checkpoint import MERGE_RECORD_NAME
    from mergelab.merge.model_card import MODEL_CARD_NAME

    skip = {MERGE_RECORD_NAME, MODEL_CARD_NAME}
    names = sorted(p.name for p in a.iterdir() if p.name not in skip)
    if names != sorted(p.name for p in b.iterdir() if p.name not in skip):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], argv[3:])
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from io_floor import shard_files
    from merge_speed import (
        VARIANTS,
        Resident,
        add_set_arguments,
        load_average,
        mergelab_command,
        run_config,
        save_results,
        synthetic_set,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_arguments(parser, "benchmarks/results/threshold_share.json")
    parser.add_argument(
        "--variants", nargs="+", default=["linear", "ties", "breadcrumbs"], choices=list(VARIANTS)
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    folder, work, models = synthetic_set(parser, args)
    held = Resident(shard_files(models))
    load_before = load_average()
    # Variants whose merge calls tau_kth_largest_abs: their record holds something.
    replayed = []
    for variant in args.variants:
        run_variant(variant, folder, work, "record")
        if json.loads((work / f"thresholds-{variant}.json").read_text()):
            replayed.append(variant)
            replay_out = work / f"replay-{variant}"
            run_variant(variant, folder, work, "replay", out=replay_out)
            if not same_output(mergelab_command(variant, folder, work)[1], replay_out):
                raise SystemExit(f"{variant}: the replayed merge's output differs")
            print(f"{variant}: replayed output equals the merge's, byte for byte", flush=True)
    jobs = [(v, None) for v in args.variants] + [(v, "replay") for v in replayed]
    runs: dict[str, list[float]] = {f"{v} {m or 'normal'}": [] for v, m in jobs}
    for round_ in range(args.repeats):
        for variant, mode in jobs if round_ % 2 == 0 else jobs[::-1]:
            seconds = run_variant(variant, folder, work, mode)
            runs[f"{variant} {mode or 'normal'}"].append(round(seconds, 3))
            print(
                f"round {round_ + 1} {variant:<12} {mode or 'normal':<7} {seconds:.2f} s",
                flush=True,
            )
    medians = {k: round(statistics.median(v), 3) for k, v in runs.items()}
    linear = medians.get("linear normal")
    summary = {}
    for variant in replayed:
        normal, replay = medians[f"{variant} normal"], medians[f"{variant} replay"]
        row = {"normal_s": normal, "replay_s": replay, "thresholds_s": round(normal - replay, 3)}
        if linear:
            row |= {"normal_per_linear": round(normal / linear, 2)}
            row |= {"replay_per_linear": round(replay / linear, 2)}
        summary[variant] = row
        print(variant, row)
    record = {
        "config": run_config(folder, args, held, load_before),
        "linear_s": linear,
        "summary": summary,
        "medians": medians,
        "runs": runs,
    }
    save_results(args.results, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
