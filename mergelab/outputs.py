"""Writing outputs safely: into a temporary sibling folder, moved into place only when complete.

    with atomic_output_dir("merged/", force=args.force) as tmp:
        save_everything(tmp)
    # "merged/" now exists, complete; on an exception nothing named "merged/" was created.

An existing output is never replaced unless ``force=True``; an output inside one of ``inputs``
(or an input inside the output) is refused, since replacing it would destroy the input.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path


class OutputExistsError(FileExistsError):
    pass


def check_output_path(
    output: str | os.PathLike, *, force: bool = False, inputs: Sequence[str | os.PathLike] = ()
) -> Path:
    out = Path(output).resolve()
    for inp in inputs:
        p = Path(inp).resolve()
        if out == p or p in out.parents or out in p.parents:
            raise ValueError(f"output {out} overlaps input {p}; choose another output path")
    if out.exists() and not force:
        raise OutputExistsError(
            f"output {out} already exists; pass --force (force=True) to replace it"
        )
    return out


@contextlib.contextmanager
def atomic_output_dir(
    output: str | os.PathLike, *, force: bool = False, inputs: Sequence[str | os.PathLike] = ()
) -> Iterator[Path]:
    out = check_output_path(output, force=force, inputs=inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.incomplete-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder normal permissions
    if out.exists():
        # Move the old output aside first so that a crash never leaves neither.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


@contextlib.contextmanager
def atomic_output_file(output: str | os.PathLike, *, force: bool = True) -> Iterator[Path]:
    """Same idea for one file (results, figures): written to a temp file, then renamed."""
    out = Path(output)
    if out.exists() and not force:
        raise OutputExistsError(f"output {out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
    os.replace(tmp, out)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
