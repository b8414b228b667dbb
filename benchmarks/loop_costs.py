"""Where a streamed merge's CPU time goes: the compiled loops of each method, and the exact
per-tensor thresholds TIES and breadcrumbs find before them, per entry of one tensor.

    python benchmarks/loop_costs.py

One thread; a base and two experts of one MLP-sized tensor (4096×1024) in bfloat16, in memory
(base ~ N(0, 0.02²), expert = base + N(0, 0.002²): the statistics of ``merge_speed.py``'s set),
merged into a bfloat16 output with float32 compute, as the benchmark's merges run. Timed, the
order the same in every round, ``--rounds`` rounds: each method's merge loop over the whole tensor
(``kernels.ChunkSummer`` / ``kernels.ChunkMerger`` with the method's options, the thresholds
already known, chunk by chunk as the methods run it) and the thresholds (``ops.tau_kth_largest_abs`` with TIES' 20 % ranks and
breadcrumbs' two ranks per expert: its sampled pass, its exact pass and the selection). A
streamed merge adds to these the mapping of the inputs, the page faults and the output's write;
with both cores busy, they share one memory bus. The results (``--results``, JSON) keep every
round's nanoseconds per entry, the medians, the thresholds found, and the share of |τ| whose
float32 bit pattern ends in 16 zero bits (a band pass counts those in vector lanes).
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
from pathlib import Path

import torch
from merge_speed import _commit

from mergelab.merge import kernels, ops
from mergelab.outputs import atomic_output_file

SHAPE = (4096, 1024)
DENSITY, BREADCRUMBS = 0.2, (0.9, 0.01)


def inputs(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(SHAPE, generator=g) * 0.02).bfloat16()
    noise = [torch.randn(SHAPE, generator=g) * 0.002 for _ in range(2)]
    return base, [(base.float() + n).bfloat16() for n in noise]


def cases(
    base: torch.Tensor, experts: list[torch.Tensor], out: torch.Tensor
) -> tuple[dict[str, Callable[[], object]], dict]:
    """name → a callable that does the step once over the whole tensor; and what the thresholds
    were, with the share of |τ| ending in 16 zero bits."""
    n = base.numel()
    ties_ranks = [[ops.kept_count(DENSITY, n)]] * 2
    crumbs_ranks = [ops.outlier_ranks(n, *BREADCRUMBS)] * 2
    ties_at = [t[0] for t in ops.tau_kth_largest_abs(base, experts, ties_ranks, torch.float32)]
    crumbs_at = ops.tau_kth_largest_abs(base, experts, crumbs_ranks, torch.float32)

    def summer(with_base: bool, normalize: bool) -> kernels.ChunkSummer:
        b = base if with_base else None
        return kernels.ChunkSummer(b, experts, out, [1.0, 1.0], lambda_=1.0, normalize=normalize)

    def elect(sign: str, dare: bool = False) -> kernels.ChunkMerger:
        params, scalars, flags = kernels.elect_plan(
            [1.0, 1.0], lambda_=1.0, majority_sign=sign, weighted_sign=True, divide_by="weight_sum"
        )
        for i in range(2):
            if dare:
                params[i, kernels.P_DARE_LIMIT] = kernels.dare_limit(DENSITY)
                params[i, kernels.P_DARE_DIVISOR] = DENSITY
            else:
                params[i, kernels.P_LOW] = kernels.trim_below(ties_at[i])
        return kernels.ChunkMerger(base, experts, out, params, scalars, flags, dare_seed=0)

    def dare_linear() -> kernels.ChunkMerger:
        params, scalars, flags = kernels.sum_plan([1.0, 1.0], lambda_=1.0, normalize=False)
        for i in range(2):
            params[i, kernels.P_DARE_LIMIT] = kernels.dare_limit(DENSITY)
            params[i, kernels.P_DARE_DIVISOR] = DENSITY
        return kernels.ChunkMerger(base, experts, out, params, scalars, flags, dare_seed=0)

    def breadcrumbs() -> kernels.ChunkMerger:
        params, scalars, flags = kernels.sum_plan([1.0, 1.0], lambda_=1.0, normalize=False)
        flags[kernels.F_BAND] = 1
        for i, (low, high) in enumerate(crumbs_at):
            params[i, kernels.P_LOW] = kernels.trim_below(low)
            params[i, kernels.P_HIGH] = high
        return kernels.ChunkMerger(base, experts, out, params, scalars, flags)

    loops = {
        "linear loop": summer(False, True),
        "task_arithmetic loop": summer(True, False),
        "ties loop (sum sign rule)": elect("sum"),
        "ties loop (count sign rule)": elect("count"),
        "dare_linear loop": dare_linear(),
        "dare_ties loop": elect("sum", dare=True),
        "breadcrumbs loop": breadcrumbs(),
    }
    dare_size = kernels.dare_chunk(n, 2)  # DARE's chunks: whole blocks, its streams together
    sizes = {"dare_linear loop": dare_size, "dare_ties loop": dare_size}

    def chunked(f: Callable[[slice], object], size: int | None) -> Callable[[], object]:
        return lambda: ops.for_chunks(n, f, size)  # chunk by chunk, as methods._run_loop runs

    steps = {name: chunked(f, sizes.get(name)) for name, f in loops.items()}
    steps["ties thresholds"] = lambda: ops.tau_kth_largest_abs(
        base, experts, ties_ranks, torch.float32
    )
    steps["breadcrumbs thresholds"] = lambda: ops.tau_kth_largest_abs(
        base, experts, crumbs_ranks, torch.float32
    )
    found = {"ties": ties_at, "breadcrumbs": crumbs_at}
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
    linear = medians["linear loop"]
    print(f"ns per entry of a {SHAPE[0]}×{SHAPE[1]} tensor, one thread, median of {args.rounds}")
    for name, m in medians.items():
        print(f"{name:30s} {m:6.3f}  min {min(runs[name]):6.3f}  ÷ linear loop {m / linear:5.2f}")
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
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output_file(path) as tmp:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
