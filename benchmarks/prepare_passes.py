"""Where a whole-model TIES merge spends its extra time: the passes of its global threshold.

    python benchmarks/prepare_passes.py --repeats 3

On ``merge_speed.py``'s synthetic 1B set (made by ``merge_speed.py`` once), every round runs,
one after the other: a streamed linear merge and a whole-model TIES merge
(``ties_model``: density 0.2, ``trim_scope: model``), each as ``mergelab merge`` in its own
subprocess at the default thread count (``merge_speed.run_measured``); then, in this process,
the TIES prepare step alone (``ops.global_magnitude_thresholds`` over the stored inputs, as the
engine runs it) with each pass timed, and a pass that only maps and unmaps every tensor's inputs
(what any pass over the stored inputs costs before it counts anything). The inputs stay mapped
for the whole run (``merge_speed.Resident``). The results (``--results``, JSON) hold every
run's wall and CPU seconds and the medians; they say how much of ``ties_model``'s time over a
linear merge its prepare passes are, and what one pass costs on this machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from io_floor import shard_files
from merge_speed import (
    VARIANTS,
    Resident,
    _commit,
    add_set_arguments,
    load_average,
    mergelab_command,
    require_this_tree,
    run_measured,
    synthetic_set,
    tool_env,
)

from mergelab.merge import checkpoint, ops
from mergelab.outputs import atomic_output_file

ROOT = Path(__file__).resolve().parent.parent


def since(wall: float, cpu: float) -> dict:
    """Wall and CPU seconds since ``time.perf_counter()`` gave ``wall`` and
    ``time.process_time()`` gave ``cpu``."""
    return {
        "s": round(time.perf_counter() - wall, 3),
        "cpu_s": round(time.process_time() - cpu, 3),
    }


def timed_passes(plan: checkpoint.CheckpointMergePlan) -> tuple[float, list[dict]]:
    """The TIES prepare step of ``plan`` as ``run_checkpoint_merge`` runs it (over the stored
    inputs, the garbage collector frozen), each pass timed: (total wall seconds, per pass wall
    and CPU seconds, and ``sparse``: over maps not populated ahead, as the cluster count and the
    cluster sample read them)."""
    passes: list[dict] = []

    def make_iter(sparse=False):
        wall, cpu = time.perf_counter(), time.process_time()
        yield from plan.iter_inputs(stored=True, sparse=sparse)
        passes.append({**since(wall, cpu), "sparse": sparse})

    params = {**plan.params, **plan.per_model}
    start = time.perf_counter()
    with checkpoint._gc_frozen():
        plan.method.compute_stats(params, make_iter, plan.compute_dtype)
    return round(time.perf_counter() - start, 3), passes


def map_only_pass(plan: checkpoint.CheckpointMergePlan) -> dict:
    """One pass that maps every tensor's stored inputs and lets them go, counting nothing."""
    wall, cpu = time.perf_counter(), time.process_time()
    numel = 0
    for _, base, _experts in plan.iter_inputs(stored=True):
        numel += base.numel()
    return {**since(wall, cpu), "entries": numel}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    add_set_arguments(parser, "benchmarks/results/prepare_passes.json")
    args = parser.parse_args(argv)
    require_this_tree()
    folder, work, models = synthetic_set(parser, args)
    held = Resident(shard_files(models))  # see merge_speed.Resident
    print(f"held in memory: {held.summary()}")
    method, params, *_ = VARIANTS["ties_model"]  # what the ties_model subprocess merges
    plan = checkpoint.plan_checkpoint_merge(
        method, models[0], models[1:], params=params, dtype=torch.float32
    )
    rounds: list[dict] = []
    try:
        for round_ in range(args.repeats):
            row: dict = {}
            for variant in ("linear", "ties_model"):
                cmd, out = mergelab_command(variant, folder, work)
                shutil.rmtree(out, ignore_errors=True)
                run = run_measured(cmd, tool_env(None), cwd=str(ROOT), warm=models)
                shutil.rmtree(out, ignore_errors=True)
                if run.returncode != 0:
                    raise SystemExit(f"{variant} failed ({run.returncode})")
                row[variant] = {"s": round(run.wall, 2), "cpu_s": round(run.cpu, 2)}
            row["prepare_s"], row["passes"] = timed_passes(plan)
            row["map_only_pass"] = map_only_pass(plan)
            rounds.append(row)
            print(f"round {round_ + 1}: {json.dumps(row)}  load {load_average()}", flush=True)
    finally:
        plan.close()

    def median(get) -> float:
        return round(statistics.median(get(r) for r in rounds), 3)

    linear, ties_model = median(lambda r: r["linear"]["s"]), median(lambda r: r["ties_model"]["s"])
    prepare = median(lambda r: r["prepare_s"])
    summary = {
        "linear_s": linear,
        "ties_model_s": ties_model,
        "ties_model_over_linear": round(ties_model / linear, 3),
        "prepare_s": prepare,
        "prepare_over_linear": round(prepare / linear, 3),
        "ties_model_less_prepare_over_linear": round((ties_model - prepare) / linear, 3),
        "pass_s": [
            median(lambda r, i=i: r["passes"][i]["s"]) for i in range(len(rounds[0]["passes"]))
        ],
        "map_only_pass_s": median(lambda r: r["map_only_pass"]["s"]),
    }
    config = {
        "commit": _commit(),
        "shape": json.loads((folder / "spec.json").read_text()),
        "ties_model": {"method": method, **params},
        "repeats": args.repeats,
        "threads": "default",
        "torch_threads": torch.get_num_threads(),
        "model_sample": {
            "cluster_entries": ops.MODEL_SAMPLE_CLUSTER,
            "clusters": ops.MODEL_SAMPLE_CLUSTERS,
            "run_per_period": [ops.MODEL_SAMPLE_RUN, ops.MODEL_SAMPLE_PERIOD],
            "margin_se": ops.MODEL_SAMPLE_MARGIN,
        },
    }
    result = {"config": config, "summary": summary, "rounds": rounds}
    with atomic_output_file(args.results) as tmp:
        Path(tmp).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
