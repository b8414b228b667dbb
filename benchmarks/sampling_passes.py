"""How many passes the exact k-th largest |τ| of one tensor takes (``ops.tau_kth_largest_abs``,
what TIES' and breadcrumbs' per-tensor trims run), on synthetic task vectors with the structure
weight matrices have: rows or columns of different scales, or a low-rank update.

    python benchmarks/sampling_passes.py [--seeds 6] [--results benchmarks/results/sampling_passes.json]
    python benchmarks/sampling_passes.py --max-stride 64 --results benchmarks/results/sampling_passes_stride64.json

Two passes is the least (a sampled pass, then one exact pass over the band the sample brackets);
four means the sample misplaced the band, or the band could not be counted, and the two exact
radix passes followed. Five variants of ``KthLargestAbs``, each on the same tensors:

* ``fixed runs, histogram band``: the sampled pass reads the first run of every period and the
  band is histogrammed (at most ``ops._MAX_BAND_BUCKETS`` buckets), as before 2026-12-02;
* ``hashed runs, histogram band``: the run of each period picked by ``ops.run_offsets``;
* ``fixed runs, collected band``: the band's values kept when the sample says they are few;
* ``hashed runs, collected band``: both;

these four with a 1/8 sample (``ops.SAMPLE_STRIDE``), and

* ``hashed runs, collected band, sparser sample``: both, with the sample as sparse as
  ``ops.sample_stride`` makes it (1/16 of 1024×1024, 1/32 of the 4M-entry shapes: mergelab's
  current code).

Every result is checked against a sort. The torch path counts (the compiled loops sample and
count the same entries, ``tests/test_merge_kernels.py``); pass counts do not depend on the
machine. The structures are synthetic: no fine-tuned checkpoint is available offline here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch
from merge_speed import require_this_tree

from mergelab.merge import kernels, ops
from mergelab.outputs import atomic_output_file

SHAPES = [(1024, 1024), (4096, 1024), (1024, 4096)]
STRUCTURES = ["iid", "row scales", "column scales", "row and column scales", "low rank"]
# TIES' trim (density 0.2) and the smallest |τ| breadcrumbs keeps (density 0.9, gamma 0.01)
RANKS = {"top 20%": 0.2, "top 91%": 0.91}
# name: (hashed runs, collected band, sparser sample)
VARIANTS = {
    "fixed runs, histogram band": (False, False, False),
    "hashed runs, histogram band": (True, False, False),
    "fixed runs, collected band": (False, True, False),
    "hashed runs, collected band": (True, True, False),
    "hashed runs, collected band, sparser sample": (True, True, True),
}


def task_vector(structure: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + shape[0] + shape[1])
    rows, cols = shape
    tau = torch.randn(shape, generator=g)
    if structure == "row scales":
        tau *= torch.exp(torch.randn(rows, 1, generator=g))
    elif structure == "column scales":
        tau *= torch.exp(0.7 * torch.randn(1, cols, generator=g))
    elif structure == "row and column scales":
        tau *= torch.exp(0.7 * torch.randn(rows, 1, generator=g))
        tau *= torch.exp(0.7 * torch.randn(1, cols, generator=g))
    elif structure == "low rank":
        tau = 0.1 * tau + torch.randn(rows, 8, generator=g) @ torch.randn(8, cols, generator=g)
    return tau


def count_passes(
    tau: torch.Tensor, k: int, hashed: bool, collect: bool, sparser: bool
) -> tuple[int, float]:
    """Passes over the tensor, and the k-th largest |τ| found, for one variant."""
    saved = ops.run_offsets, ops.COLLECT_MAX, ops.for_chunks, ops.SAMPLE_STRIDE_MAX
    passes = []

    def counting(numel, fn, size=None):
        passes.append(numel)
        return saved[2](numel, fn, size)

    try:
        if not hashed:
            ops.run_offsets = lambda periods, stride: periods * 0
        if not collect:
            ops.COLLECT_MAX = 0
        if not sparser:
            ops.SAMPLE_STRIDE_MAX = ops.SAMPLE_STRIDE
        ops.for_chunks = counting
        found = ops.tau_kth_largest_abs(torch.zeros_like(tau), [tau], [[k]], torch.float32)
    finally:
        ops.run_offsets, ops.COLLECT_MAX, ops.for_chunks, ops.SAMPLE_STRIDE_MAX = saved
    return len(passes), found[0][0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--results", default="benchmarks/results/sampling_passes.json")
    parser.add_argument(
        "--max-stride",
        type=int,
        default=ops.SAMPLE_STRIDE_MAX,
        help="the sparsest sample the last variant may read (ops.SAMPLE_STRIDE_MAX)",
    )
    args = parser.parse_args(argv)
    require_this_tree()
    ops.SAMPLE_STRIDE_MAX = args.max_stride
    kernels.enabled = False  # the torch path: its sample can be placed by variant
    rows = []
    for structure in STRUCTURES:
        for shape in SHAPES:
            for seed in range(args.seeds):
                tau = task_vector(structure, shape, seed)
                flat = tau.reshape(-1).abs()
                n = flat.numel()
                for rank_name, density in RANKS.items():
                    k = ops.kept_count(density, n)
                    exact = float(flat.kthvalue(n - k + 1).values)
                    row = {"structure": structure, "shape": list(shape), "seed": seed}
                    row["rank"], row["k"] = rank_name, k
                    for name, (hashed, collect, sparser) in VARIANTS.items():
                        n_passes, found = count_passes(tau, k, hashed, collect, sparser)
                        if found != exact:
                            raise AssertionError(f"{name}: {found} != {exact} ({row})")
                        row[name] = n_passes
                    rows.append(row)
        print(f"{structure}: done", file=sys.stderr)
    summary = {}
    for structure in STRUCTURES:
        for rank_name in RANKS:
            cases = [r for r in rows if r["structure"] == structure and r["rank"] == rank_name]
            summary[f"{structure} / {rank_name}"] = {
                name: {
                    "cases": len(cases),
                    "more_than_two_passes": sum(r[name] > 2 for r in cases),
                    "passes": dict(sorted(Counter(r[name] for r in cases).items())),
                }
                for name in VARIANTS
            }
    config = {
        "shapes": SHAPES,
        "structures": STRUCTURES,
        "ranks": RANKS,
        "seeds": args.seeds,
        "sample_stride": ops.SAMPLE_STRIDE,
        "sample_stride_max": args.max_stride,
        "sparser_sample_strides": {f"{r}x{c}": ops.sample_stride(r * c) for r, c in SHAPES},
        "sample_run": ops.SAMPLE_RUN,
        "collect_max": ops.COLLECT_MAX,
        "max_band_buckets": ops._MAX_BAND_BUCKETS,  # noqa: SLF001
        "path": "torch (kernels off)",
    }
    out = {"config": config, "summary": summary, "rows": rows}
    with atomic_output_file(args.results) as tmp:
        tmp.write_text(json.dumps(out, indent=1) + "\n")
    width = max(len(k) for k in summary)
    print(f"{'case':{width}s}  " + "  ".join(f"{v[:22]:>22s}" for v in VARIANTS))
    for key, by_variant in summary.items():
        cells = [
            f"{v['more_than_two_passes']:>3d}/{v['cases']:<3d} >2 passes"
            for v in by_variant.values()
        ]
        print(f"{key:{width}s}  " + "  ".join(f"{c:>22s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
