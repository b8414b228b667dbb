"""Does this machine drop files from the page cache on its own, and does mapping them keep them?

    python benchmarks/page_cache_hold.py --minutes 2

``merge_speed.py`` holds its inputs and both tools' files mapped for the whole run
(``merge_speed.Resident``) because some VMs page out file pages that no process maps once they
went unread for a while (``merge_speed.proactive_reclaim`` names the kernel's scheme), even with
most memory free. This measures it on the synthetic set ``merge_speed.py --layers N`` made: the
shards are read once (page cache), then their resident share is sampled every ``--every``
seconds for ``--minutes`` without any process mapping them, then read again and sampled as long
while this process maps them (``Resident``). The results (``--results``, JSON) hold every
sample (seconds, resident MiB) of both phases, the total size and the machine's reclaim scheme.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import sys
import time
from pathlib import Path

from io_floor import shard_files
from merge_speed import Resident, proactive_reclaim, read_through

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_bytes(paths: list[Path]) -> int:
    """How many bytes of ``paths`` are in the page cache now (``mincore`` over a fresh map,
    which reads nothing)."""
    page = mmap.PAGESIZE
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                continue
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if address in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = ctypes.create_string_buffer((size + page - 1) // page)
                if _libc.mincore(address, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                total += sum(b & 1 for b in vec.raw) * page
            finally:
                _libc.munmap(address, size)
    return min(total, sum(p.stat().st_size for p in paths))


def watch(paths: list[Path], seconds: float, every: float) -> list[tuple[float, int]]:
    start = time.perf_counter()
    samples = []
    while True:
        now = time.perf_counter() - start
        samples.append((round(now, 1), round(resident_bytes(paths) / 2**20)))
        print(f"  {now:6.1f} s  {samples[-1][1]} MiB resident", flush=True)
        if now >= seconds:
            return samples
        time.sleep(every)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=".cache/merge_speed")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--results", default="benchmarks/results/page_cache_hold.json")
    args = parser.parse_args(argv)
    folder = Path(args.cache_dir).resolve() / f"llama-{args.layers}L"
    models = [folder / n for n in ("base", "expert_0", "expert_1")]
    if not all(m.is_dir() for m in models):
        parser.error(f"no synthetic set in {folder}: run merge_speed.py --layers {args.layers}")
    paths = shard_files(models)
    size_mib = round(sum(p.stat().st_size for p in paths) / 2**20)
    print(f"{len(paths)} shards, {size_mib} MiB; reclaim: {proactive_reclaim()}")
    phases = {}
    for phase in ("unmapped", "mapped"):
        read_through(models)
        held = Resident(paths) if phase == "mapped" else None
        print(f"{phase}:")
        phases[phase] = watch(paths, args.minutes * 60, args.every)
        del held
    record = {
        "config": {
            "set": str(folder.name),
            "shards": len(paths),
            "size_mib": size_mib,
            "minutes": args.minutes,
            "every_s": args.every,
            "proactive_reclaim": proactive_reclaim(),
            "machine": platform.platform(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        },
        "samples_s_mib": phases,
    }
    Path(args.results).write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
