"""What finding a tensor's exact TIES thresholds costs besides its passes: the bookkeeping between
them, per tensor size, with ``ops._locate`` walking the bins in the compiled loop (the code) and
with NumPy's cumulative sum over a reversed view (``ops._locate_numpy``, the code before
1d7f500), alternating.

    python benchmarks/threshold_overhead.py

One thread; base and two experts of each size in bfloat16 (base ~ N(0, 0.02²), expert = base +
N(0, 0.002²), the merge benchmark's statistics), in memory; both experts' 20 % thresholds, τ in float32
(``ops.tau_kth_largest_abs``), as per-tensor TIES finds them. Each round times ``--calls`` calls
of each variant, the order alternating; the results (``--results``, JSON) keep every round's
milliseconds per tensor and the median, and check that both variants found the same thresholds.
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
from merge_speed import require_this_tree

from mergelab.merge import kernels, ops

SIZES = {
    "norm (1024)": (1024,),
    "k/v projection (512×1024)": (512, 1024),
    "q/o projection (1024×1024)": (1024, 1024),
    "MLP (4096×1024)": (4096, 1024),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--results", default="benchmarks/results/threshold_overhead.json")
    args = parser.parse_args(argv)
    require_this_tree()
    torch.set_num_threads(1)
    if not kernels.active():
        raise SystemExit("the compiled loops are not active (not built, or turned off)")
    compiled_locate = ops._locate
    rows = {}
    for name, shape in SIZES.items():
        g = torch.Generator().manual_seed(0)
        base = torch.randn(shape, generator=g) * 0.02
        experts = [(base + torch.randn(shape, generator=g) * 0.002).bfloat16() for _ in range(2)]
        base = base.bfloat16()
        k = ops.kept_count(0.2, base.numel())
        found, times = {}, {"compiled": [], "numpy": []}
        for round_ in range(args.rounds):
            order = ["compiled", "numpy"] if round_ % 2 == 0 else ["numpy", "compiled"]
            for variant in order:
                ops._locate = compiled_locate if variant == "compiled" else ops._locate_numpy
                try:
                    found[variant] = ops.tau_kth_largest_abs(
                        base, experts, [[k], [k]], torch.float32
                    )
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        ops.tau_kth_largest_abs(base, experts, [[k], [k]], torch.float32)
                    times[variant].append((time.perf_counter() - start) / args.calls * 1e3)
                finally:
                    ops._locate = compiled_locate
        if found["compiled"] != found["numpy"]:
            raise SystemExit(f"{name}: the two variants found different thresholds: {found}")
        rows[name] = {
            "numel": base.numel(),
            "ms_per_tensor": {v: [round(t, 3) for t in ts] for v, ts in times.items()},
            "median_ms": {v: round(statistics.median(ts), 3) for v, ts in times.items()},
        }
        medians = rows[name]["median_ms"]
        print(
            f"{name:28s} compiled {medians['compiled']:7.3f} ms  numpy {medians['numpy']:7.3f} ms"
            f"  (median of {args.rounds} rounds of {args.calls} calls)",
            flush=True,
        )
    record = {
        "config": {
            "threads": 1,
            "rounds": args.rounds,
            "calls": args.calls,
            "density": 0.2,
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
