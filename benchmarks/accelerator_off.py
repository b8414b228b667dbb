"""mergelab with its accelerator against without it (``MERGELAB_ACCELERATOR=off``): the same
streamed merges of ``merge_speed.py``'s synthetic set, the plain torch methods (whole tensors,
one after the other, ordinary writes) against the compiled loops, look-ahead scheduler and
``O_DIRECT`` writes, from the same working tree.

    python benchmarks/accelerator_off.py --layers 8 --repeats 3

The set (``--layers N`` of ``merge_speed.py``'s Llama shape, in ``--cache-dir``) is made on the
first run, as ``merge_speed.py --layers N`` makes it, and reused.

Every round runs each variant both ways, the order alternating from round to round, each in its
own subprocess (``merge_speed.run_measured``: after ``sync``, with the inputs read through; wall
and CPU seconds, peak RSS from GNU time), with the inputs and the package's files held in memory
(``merge_speed.Resident``). Each run's shards are hashed: the results file says whether both
ways wrote the same bytes. The summary gives per variant the medians of each way and the
median off ÷ on ratio of the rounds' pairs (wall and CPU), and the highest peak RSS of each,
also as the memory above a process that only imports the merge command (``import_rss_mib``,
measured the same way), in float32 copies of the set's largest tensor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from io_floor import shard_files
from merge_speed import (
    LLAMA_SHAPE,
    TOOL_IMPORTS,
    VARIANTS,
    Resident,
    _commit,
    add_set_arguments,
    cpu_description,
    llama_tensors,
    load_average,
    mergelab_command,
    run_measured,
    save_results,
    synthetic_set,
    tool_env,
    tool_files,
    write_checkpoint_set,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = ["linear", "task_arithmetic", "ties", "ties_model", "dare_ties", "breadcrumbs"]
WAYS = ("on", "off")


def shards_digest(folder: Path) -> str:
    """sha256 over the output's shards, in name order."""
    digest = hashlib.sha256()
    for shard in sorted(folder.glob("*.safetensors")):
        with open(shard, "rb") as f:
            while block := f.read(16 << 20):
                digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each way once per round)")
    parser.add_argument("--threads", type=int, default=None, help="default: each run's own")
    add_set_arguments(parser, "benchmarks/results/accelerator_off.json")
    args = parser.parse_args(argv)
    shape = {**LLAMA_SHAPE, "num_hidden_layers": args.layers}
    spec = Path(args.cache_dir).resolve() / f"llama-{args.layers}L" / "spec.json"
    if not spec.is_file() or json.loads(spec.read_text()) != shape:
        print(f"writing synthetic checkpoints to {spec.parent} (once)")
        write_checkpoint_set(spec.parent, shape)
    folder, work, models = synthetic_set(parser, args)
    base_env = {**tool_env(args.threads), "PYTHONPATH": str(ROOT)}
    base_env.pop("MERGELAB_ACCELERATOR", None)
    envs = {"on": base_env, "off": {**base_env, "MERGELAB_ACCELERATOR": "off"}}
    probe = "from mergelab.merge import accelerator; print(accelerator.enabled())"
    for way, expected in (("on", "True"), ("off", "False")):
        done = subprocess.run(
            [sys.executable, "-c", probe], env=envs[way], capture_output=True, text=True
        )
        if done.stdout.strip() != expected:
            raise SystemExit(
                f"the accelerator is not {way} where it should be (build the loops first:"
                f" python setup.py build_ext --inplace): {done.stderr.strip()[-300:]}"
            )
    held = Resident(sorted({*shard_files(models), *tool_files(base_env, cwd=ROOT)}))
    print(f"held in memory: {held.summary()}")
    largest_f32_mib = max(math.prod(s) for _, s in llama_tensors(shape)) * 4 / 2**20
    importing = [sys.executable, "-c", TOOL_IMPORTS["mergelab"]]
    import_rss = {way: round(run_measured(importing, envs[way]).rss_mib) for way in WAYS}
    print(f"import only: {import_rss} MiB; largest tensor in float32: {largest_f32_mib:.0f} MiB")
    load_before = load_average()
    runs: dict[str, dict[str, list[dict]]] = {v: {w: [] for w in WAYS} for v in args.variants}
    for round_ in range(args.repeats):
        for i, variant in enumerate(args.variants):
            order = WAYS if (round_ + i) % 2 == 0 else WAYS[::-1]
            for way in order:
                cmd, out = mergelab_command(variant, folder, work)
                run = run_measured(cmd, envs[way], cwd=str(ROOT), warm=models)
                if run.returncode != 0:
                    raise SystemExit(f"{variant} with the accelerator {way} failed")
                digest = shards_digest(out)
                shutil.rmtree(out, ignore_errors=True)
                runs[variant][way].append(
                    {
                        "s": round(run.wall, 2),
                        "cpu_s": round(run.cpu, 2),
                        "rss_mib": round(run.rss_mib),
                        "waits_s": run.waits,
                        "sha256": digest,
                    }
                )
                print(
                    f"round {round_ + 1} {variant:16s} {way:3s} {run.wall:6.1f} s"
                    f"  cpu {run.cpu:6.1f} s  rss {run.rss_mib:6.0f} MiB  load {load_average()}",
                    flush=True,
                )
    summary = {}
    for variant, by in runs.items():
        pairs = list(zip(by["on"], by["off"]))
        row: dict = {}
        for way in WAYS:
            row[f"{way}_median_s"] = round(statistics.median(r["s"] for r in by[way]), 2)
            row[f"{way}_median_cpu_s"] = round(statistics.median(r["cpu_s"] for r in by[way]), 2)
            row[f"{way}_peak_rss_mib"] = max(r["rss_mib"] for r in by[way])
            above = (row[f"{way}_peak_rss_mib"] - import_rss[way]) / largest_f32_mib
            row[f"{way}_rss_above_import_in_largest_f32"] = round(above, 1)
        row["median_off_over_on"] = round(statistics.median(f["s"] / o["s"] for o, f in pairs), 2)
        row["median_cpu_off_over_on"] = round(
            statistics.median(f["cpu_s"] / o["cpu_s"] for o, f in pairs), 2
        )
        row["same_bytes"] = len({r["sha256"] for w in WAYS for r in by[w]}) == 1
        summary[variant] = row
        print(f"{variant:16s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    record = {
        "config": {
            "commit": _commit(),
            "variants": {v: VARIANTS[v] for v in args.variants},
            "repeats": args.repeats,
            "layers": args.layers,
            "largest_tensor_f32_mib": round(largest_f32_mib, 1),
            "import_rss_mib": import_rss,
            "threads": args.threads if args.threads is not None else "default",
            "cpu_count": os.cpu_count(),
            "cpu": cpu_description(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
            "held_in_memory": held.summary(),
        },
        "summary": summary,
        "runs": runs,
    }
    save_results(args.results, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
