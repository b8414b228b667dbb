"""Where a streamed merge's CPU time goes besides its I/O: each method's work on one tensor, and
the part of it spent finding TIES' and breadcrumbs' exact per-tensor thresholds, per entry.

    python benchmarks/loop_costs.py

One thread; a base and two experts of one MLP-sized tensor (4096×1024) in bfloat16, in memory
(base ~ N(0, 0.02²), expert = base + N(0, 0.002²): the statistics of ``merge_speed.py``'s set).
Each of ``merge_speed.py``'s per-tensor variants runs its registered method with that
benchmark's parameters as the streaming engine calls it: float32 compute into a bfloat16
output buffer (``TensorContext.dtype`` / ``.out``), so the compiled loops run, thresholds
included. Apart, the thresholds alone (``ops.tau_kth_largest_abs`` with TIES' and breadcrumbs'
ranks, as the methods call it: the sampled pass, the exact pass, the selection). Timed in the
same order every round, ``--rounds`` rounds. A streamed merge adds the mapping of the inputs,
the page faults and the output's write; with both cores busy they share one memory bus. The
results (``--results``, JSON) keep every round's nanoseconds per entry, the medians, the
thresholds found and the share of |τ| whose float32 bit pattern ends in 16 zero bits (one
bfloat16 value's worth of significand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from merge_speed import VARIANTS, _commit, require_this_tree

from mergelab.merge import TensorContext, get_merge_method, kernels, ops
from mergelab.outputs import atomic_output_file

SHAPE = (4096, 1024)
DENSITY = VARIANTS["ties"][1]["density"]
BREADCRUMBS = VARIANTS["breadcrumbs"][1]["density"], VARIANTS["breadcrumbs"][1]["gamma"]


def inputs(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(SHAPE, generator=g) * 0.02).bfloat16()
    noise = [torch.randn(SHAPE, generator=g) * 0.002 for _ in range(2)]
    return base, [(base.float() + n).bfloat16() for n in noise]


# merge_speed.py's per-tensor variants (the whole-model ones need a pass over the model)
METHODS = [
    "linear",
    "task_arithmetic",
    "ties",
    "ties_count",
    "dare_linear",
    "dare_ties",
    "breadcrumbs",
]


def cases(
    base: torch.Tensor, experts: list[torch.Tensor], out: torch.Tensor
) -> tuple[dict[str, Callable[[], object]], dict]:
    """name → a callable that does the step once over the whole tensor: each variant's method
    as the streamed merge calls it (float32 compute, the output buffer given, so the compiled
    loop runs), and the thresholds TIES and breadcrumbs find inside it; and what the thresholds
    were, with the share of |τ| ending in 16 zero bits."""
    n = base.numel()
    ties_ranks = [[ops.kept_count(DENSITY, n)]] * 2
    crumbs_ranks = [ops.outlier_ranks(n, *BREADCRUMBS)] * 2

    def method(variant: str) -> Callable[[], object]:
        name, params, *_ = VARIANTS[variant]
        merge = get_merge_method(name)
        b = None if name == "linear" else base
        ctx = TensorContext("t", dtype=torch.float32, out=out)
        return lambda: merge(b, experts, ctx=ctx, **params)

    steps = {variant: method(variant) for variant in METHODS}
    steps["ties thresholds"] = lambda: ops.tau_kth_largest_abs(
        base, experts, ties_ranks, torch.float32
    )
    steps["breadcrumbs thresholds"] = lambda: ops.tau_kth_largest_abs(
        base, experts, crumbs_ranks, torch.float32
    )
    found = {"ties": steps["ties thresholds"](), "breadcrumbs": steps["breadcrumbs thresholds"]()}
    for i, e in enumerate(experts):  # |τ| bit patterns that are a top-16-bit bucket's lowest
        bits = (e.float() - base.float()).abs().view(torch.int32)
        found[f"expert_{i}_tau_low_16_bits_zero_share"] = float(
            ((bits & 0xFFFF) == 0).double().mean()
        )
    return steps, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--results", default="benchmarks/results/loop_costs.json")
    args = parser.parse_args(argv)
    require_this_tree()
    if not kernels.active():
        raise SystemExit("the compiled loops are not built (pip install -e .): nothing to time")
    load_before = list(os.getloadavg())
    torch.set_num_threads(1)
    base, experts = inputs()
    out = torch.empty_like(base)
    steps, found = cases(base, experts, out)
    n = base.numel()
    runs: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            runs[name].append(round((time.perf_counter() - start) / n * 1e9, 4))
    medians = {name: statistics.median(r) for name, r in runs.items()}
    linear = medians["linear"]
    print(f"ns per entry of a {SHAPE[0]}×{SHAPE[1]} tensor, one thread, median of {args.rounds}")
    for name, m in medians.items():
        print(f"{name:30s} {m:6.3f}  min {min(runs[name]):6.3f}  ÷ linear {m / linear:5.2f}")
    record = {
        "config": {
            "shape": list(SHAPE),
            "dtype": "bfloat16 stored, float32 compute, bfloat16 output",
            "threads": 1,
            "rounds": args.rounds,
            "density": DENSITY,
            "breadcrumbs_density_gamma": list(BREADCRUMBS),
            "seed": 0,
            "commit": _commit(),
            "compiled_loops": kernels.loops().__file__,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "load_average_before": load_before,
        },
        "ns_per_entry_median": medians,
        "ns_per_entry_runs": runs,
        "thresholds": found,
    }
    with atomic_output_file(args.results) as tmp:  # makes the folder too
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
