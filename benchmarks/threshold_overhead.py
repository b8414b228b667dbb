"""What finding a tensor's exact per-tensor thresholds costs besides its passes, per tensor size,
two ways alternating (``--compare``):

* ``one-call`` (the default): every pass in one compiled call (``kernels.tau_kth``, what
  ``ops.tau_kth_largest_abs`` runs on a chunk worker or for tensors under ``ops.ONE_CALL_MAX``
  entries, since f717cb1) against the same passes driven from Python chunk by chunk
  (``ops._find_many``, the code before), for TIES' 20 % ranks and breadcrumbs' two ranks
  (density 0.9, γ 0.01);
* ``locate``: TIES' ranks with ``ops._locate`` walking the bins in the compiled loop against
  NumPy's cumulative sum over a reversed view (``ops._locate_numpy``, the code before 1d7f500),
  both on the chunked passes.

    python benchmarks/threshold_overhead.py
    python benchmarks/threshold_overhead.py --compare locate --results benchmarks/results/threshold_overhead.json

One thread; base and two experts of each size in bfloat16 (base ~ N(0, 0.02²), expert = base +
N(0, 0.002²), the merge benchmark's statistics), in memory; both experts' thresholds, τ in
float32, as the methods find them. Each round times ``--calls`` calls of each variant, the order
alternating; the results (``--results``, JSON) keep every round's milliseconds per tensor and
the median, and check that both variants found the same thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from merge_speed import _commit, require_this_tree

from mergelab.merge import kernels, ops

# --compare -> its two variants, the first the code's
VARIANTS = {"one-call": ("one_call", "chunked"), "locate": ("compiled", "numpy")}

SIZES = {
    "norm (1024)": (1024,),
    "k/v projection (512×1024)": (512, 1024),
    "q/o projection (1024×1024)": (1024, 1024),
    "MLP (4096×1024)": (4096, 1024),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=list(VARIANTS), default="one-call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--results", default="benchmarks/results/threshold_overhead_one_call.json")
    args = parser.parse_args(argv)
    require_this_tree()
    torch.set_num_threads(1)
    if not kernels.active():
        raise SystemExit("the compiled loops are not active (not built, or turned off)")
    compiled_locate = ops._locate
    first, second = VARIANTS[args.compare]
    methods = {"ties": lambda n: [ops.kept_count(0.2, n)]}
    if args.compare == "one-call":
        methods["breadcrumbs"] = lambda n: ops.outlier_ranks(n, 0.9, 0.01) or []

    def find(variant: str, base: torch.Tensor, experts: list, ranks: list) -> list:
        if variant == "chunked":
            return ops._find_many(
                base.numel(), ranks, ops._tau_histograms(base, experts, torch.float32)
            )
        ops._locate = ops._locate_numpy if variant == "numpy" else compiled_locate
        try:
            return ops.tau_kth_largest_abs(base, experts, ranks, torch.float32)
        finally:
            ops._locate = compiled_locate

    rows = {}
    for name, shape in SIZES.items():
        g = torch.Generator().manual_seed(0)
        base = torch.randn(shape, generator=g) * 0.02
        experts = [(base + torch.randn(shape, generator=g) * 0.002).bfloat16() for _ in range(2)]
        base = base.bfloat16()
        if args.compare == "one-call" and not ops._in_one_call(base, experts):
            raise SystemExit(f"{name}: ops.tau_kth_largest_abs would not take one call here")
        for method, ranks_of in methods.items():
            ranks = [ranks_of(base.numel())] * 2
            found, times = {}, {first: [], second: []}
            for round_ in range(args.rounds):
                order = [first, second] if round_ % 2 == 0 else [second, first]
                for variant in order:
                    found[variant] = find(variant, base, experts, ranks)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        find(variant, base, experts, ranks)
                    times[variant].append((time.perf_counter() - start) / args.calls * 1e3)
            if found[first] != found[second]:
                raise SystemExit(f"{name}: the two variants found different thresholds: {found}")
            row = f"{name}, {method}" if len(methods) > 1 else name
            rows[row] = {
                "numel": base.numel(),
                "ranks": ranks[0],
                "ms_per_tensor": {v: [round(t, 3) for t in ts] for v, ts in times.items()},
                "median_ms": {v: round(statistics.median(ts), 3) for v, ts in times.items()},
            }
            medians = rows[row]["median_ms"]
            print(
                f"{row:42s} {first} {medians[first]:7.3f} ms  {second} {medians[second]:7.3f} ms"
                f"  (median of {args.rounds} rounds of {args.calls} calls)",
                flush=True,
            )
    record = {
        "config": {
            "compare": args.compare,
            "commit": _commit(),
            "threads": 1,
            "rounds": args.rounds,
            "calls": args.calls,
            "density": {"ties": 0.2, "breadcrumbs": [0.9, 0.01]},
            "experts": 2,
            "dtype": "bfloat16 stored, float32 compute",
            "machine": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_before_write": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "rows": rows,
    }
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
