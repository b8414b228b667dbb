"""The read-and-write floor of ``benchmarks/merge_speed.py``: a process that imports torch (as
both merge tools do), reads every byte of its input checkpoints and writes one output of the
merged size, flushed to disk, and nothing else.

    python benchmarks/io_floor.py MODE OUT_BYTES OUT_DIR INPUT_FOLDER...

It treats Python's garbage collector as the ``mergelab`` command does (none while torch is
imported, then torch's objects moved to the oldest generation, ``mergelab/__init__.py``) and
ends as it does, without the interpreter's teardown (``os._exit`` once done,
``mergelab/cli.py``), so that the floor is no slower than a tool that does the least.
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import sys
import tempfile
from pathlib import Path


def shard_files(folders: list[Path]) -> list[Path]:
    return sorted(f for folder in folders for f in folder.glob("*.safetensors"))


def io_floor(inputs: list[Path], out_bytes: int, out_dir: Path, mode: str = "direct") -> None:
    """Read every byte of every shard of ``inputs``, write ``out_bytes`` into a file in a new
    folder inside ``out_dir`` and flush it to disk, one after the other; then delete that new
    folder (only it: nothing already in ``out_dir`` is touched).

    ``mode`` "direct": the inputs memory-mapped and every 8-byte word loaded once (a sum), the
    output written with ``O_DIRECT`` (mergelab's way of reading and writing); "buffered":
    ``read()`` into a buffer and ``write()`` through the page cache (a plain tool's way).
    """
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs
    view = memoryview(block)
    for shard in shard_files(inputs):
        with open(shard, "rb", buffering=0) as f:
            if mode == "buffered":
                while f.readinto(view):
                    pass
                continue
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            words = torch.frombuffer(mapped, dtype=torch.int64, count=size // 8)
            words.sum()  # every byte from the page cache through the CPU, once
            del words
            mapped.close()
    scratch = Path(tempfile.mkdtemp(prefix="io-floor-", dir=out_dir))
    path = scratch / "floor.bin"
    direct = getattr(os, "O_DIRECT", 0) if mode == "direct" else 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct)
    left = out_bytes - out_bytes % 4096 if direct else out_bytes
    while left:
        left -= os.write(fd, view[: min(left, len(view))])
    os.close(fd)
    with open(path, "ab") as f:  # the unaligned tail, then everything flushed
        f.write(view[: out_bytes - os.path.getsize(path)])
        os.fsync(f.fileno())
    view.release()
    block.close()
    shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] not in ("direct", "buffered"):
        print(
            "usage: io_floor.py direct|buffered OUT_BYTES OUT_DIR INPUT_FOLDER...", file=sys.stderr
        )
        return 2
    mode, out_bytes, out_dir, *inputs = argv
    collecting = gc.isenabled()
    gc.disable()
    import torch  # noqa: F401  (what both tools load first)

    gc.freeze()  # torch's objects into the oldest generation, as `import mergelab` does
    gc.unfreeze()
    if collecting:
        gc.enable()
    io_floor([Path(p) for p in inputs], int(out_bytes), Path(out_dir), mode=mode)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
