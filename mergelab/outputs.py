"""Writing outputs safely: never delete or overwrite what mergelab did not create, whatever the
flags, and never leave nothing where an output was.

    with atomic_output_dir("merged/", force=args.force, inputs=[base, *models]) as tmp:
        save_everything(tmp)
    # "merged/" now exists, complete; after an exception "merged/" is as it was before.

Folder outputs (merges, LoRA adapters, evaluation results):

* The content is written into ``.NAME.incomplete-XXXX/new/`` next to the output. That work folder
  also holds ``owner.json`` (pid, host, boot id and process start time of the writer, and whether
  it is writing or swapping).
* When the content is complete, a marker ``mergelab_output.json`` listing every entry written is
  added, and the content takes the output's place in one step: ``renameat2(RENAME_EXCHANGE)`` on
  Linux, else two renames (old output aside, new one in; rolled back on an exception). The work
  folder, which then holds the old output, is deleted.
* An existing output is replaced only with ``force=True``, and only if it is an empty folder or a
  previous mergelab output that holds nothing mergelab did not write: every entry is listed in its
  marker (outputs written before the marker existed are recognised by ``mergelab_merge.json`` or
  an evaluation's ``summary.json``, and may hold only the files those outputs had). Anything else
  is refused, with a message listing what is there. A symbolic link is never replaced.
* An output that is, contains or sits inside one of ``inputs`` is refused, and so is the current
  folder or one above it.
* An exception, Ctrl-C or SIGTERM removes the work folder (SIGTERM is raised as
  :class:`Terminated`, a ``KeyboardInterrupt``, while the work folder exists). After SIGKILL or a
  power cut the work folder stays; the next :func:`check_output_path` on the same output (every
  write calls it first) removes work folders whose writer is gone (same host, and its pid is dead
  or now another process), after restoring or completing a swap it interrupted. Work folders of
  live processes or of another host are never touched.

Single-file outputs (:func:`atomic_output_file`): written to a temp file, then renamed over the
output. With ``force``, only a regular file is replaced, never an input, and (for the CLI's
outputs) only one that ``written_by_mergelab(path)`` recognises by its content.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from mergelab.errors import raise_terminated

MARKER_NAME = "mergelab_output.json"
OWNER_NAME = "owner.json"
INCOMPLETE_INFIX = ".incomplete-"
MARKER_FORMAT = 1

# What mergelab wrote into folder outputs before they carried MARKER_NAME (a record of the past,
# so a list of its own, not the merge code's current one): the record file that
# identifies such an output (a JSON object with this key), and the names it may hold.
LEGACY_OUTPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mergelab_merge.json": (
        "method",
        (
            "mergelab_merge.json",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenizer.model",
            "special_tokens_map.json",
            "added_tokens.json",
            "vocab.json",
            "vocab.txt",
            "merges.txt",
            "chat_template.jinja",
            "chat_template.json",
            "model.safetensors.index.json",
            "model-?????-of-?????.safetensors",
            "adapter_config.json",
            "adapter_model.safetensors",
        ),
    ),
    "summary.json": ("cache_key", ("summary.json", "items.jsonl")),
}

# errno values that only a write can cause: reported as "could not write OUTPUT".
_WRITE_FAULTS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}


class OutputExistsError(FileExistsError):
    pass


class ForeignOutputError(OutputExistsError):
    """The output path holds something mergelab did not write: never replaced, even with force."""


# ----------------------------------------------------------------------------------------------
# Checks before anything is written.


def output_path(output: str | os.PathLike) -> Path:
    """``output`` made absolute, with its parent resolved (its last component is not: a symbolic
    link at the output path is the link, not its target)."""
    path = Path(os.path.abspath(output))
    if not path.name:
        raise ValueError(f"output {output!s} is not a usable path")
    return path.parent.resolve() / path.name


def check_inputs_overlap(out: Path, inputs: Sequence[str | os.PathLike | None]) -> None:
    """Refuse an output that is, contains or sits inside an input (or a hard link to one)."""
    targets = {out, out.resolve()}
    for inp in inputs:
        if inp is None or str(inp) == "":
            continue
        p = Path(inp).resolve()
        same = os.path.exists(out) and os.path.exists(p) and os.path.samefile(out, p)
        if same or any(o == p or p in o.parents or o in p.parents for o in targets):
            raise ValueError(
                f"output {out} overlaps input {p} (it is, contains or sits inside it); "
                "choose another output path"
            )
    cwd = Path.cwd().resolve()
    if any(o == cwd or o in cwd.parents for o in targets):
        raise ValueError(
            f"output {out} is the current folder or contains it; choose another output path"
        )


def check_output_path(
    output: str | os.PathLike,
    *,
    force: bool = False,
    inputs: Sequence[str | os.PathLike | None] = (),
) -> Path:
    """Check a folder output before any work: not overlapping an input, and either absent or
    (with ``force``) replaceable. Also removes work folders that dead writers left for it."""
    out = output_path(output)
    check_inputs_overlap(out, inputs)
    clean_stale_work_folders(out)
    if os.path.lexists(out):
        if not force:
            raise OutputExistsError(
                f"output {out} already exists; pass --force (force=True) to replace it"
            )
        check_replaceable_folder(out)
    return out


def check_replaceable_folder(out: Path) -> None:
    """Raise :class:`ForeignOutputError` unless ``out`` is an empty folder or a mergelab output
    holding only what mergelab wrote."""
    if out.is_symlink():
        raise ForeignOutputError(
            f"{out} is a symbolic link; mergelab does not replace it, even with --force"
        )
    if not out.is_dir():
        raise ForeignOutputError(
            f"{out} is a file, not a mergelab output folder; refusing to replace it even with "
            "--force"
        )
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
        what = "entry" if len(foreign) == 1 else "entries"
        raise ForeignOutputError(
            f"{out} holds {len(foreign)} {what} mergelab did not write: {shown}; refusing to "
            "replace it even with --force (move them away or choose another output)"
        )


def foreign_entries(folder: Path, limit: int = 10_000) -> list[str]:
    """Top-level entries of ``folder`` (``"b/"`` for a folder) that hold anything mergelab did
    not write, by the folder's marker (or, for older outputs, their known file names)."""
    names = sorted(os.listdir(folder))
    marker = _read_json(folder / MARKER_NAME)
    if isinstance(marker, dict) and marker.get("written_by") == "mergelab":
        allowed = {MARKER_NAME, *(e for e in marker.get("entries", []) if isinstance(e, str))}
        foreign = []
        for name in names:
            entries = _tree(folder / name, name, limit)
            if entries is None or any(e not in allowed for e in entries):
                foreign.append(_shown(folder, name))
        return foreign
    patterns: tuple[str, ...] = ()
    for record, (key, legacy) in LEGACY_OUTPUTS.items():
        data = _read_json(folder / record)
        if isinstance(data, dict) and key in data:
            patterns = legacy
            break
    return [
        _shown(folder, name)
        for name in names
        if not (
            (folder / name).is_file()
            and not (folder / name).is_symlink()
            and any(fnmatch.fnmatchcase(name, p) for p in patterns)
        )
    ]


def _shown(folder: Path, name: str) -> str:
    p = folder / name
    return name + "/" if p.is_dir() and not p.is_symlink() else name


def _tree(path: Path, rel: str, limit: int) -> list[str] | None:
    """Relative paths of ``path`` and everything under it (folders end in "/"); links are not
    followed. ``None`` past ``limit`` entries."""
    if path.is_symlink() or not path.is_dir():
        return [rel]
    out = [rel + "/"]
    for root, dirs, files in os.walk(path):
        base = Path(root).relative_to(path.parent).as_posix()
        for d in dirs:
            full = Path(root) / d
            out.append(f"{base}/{d}" if full.is_symlink() else f"{base}/{d}/")
        out.extend(f"{base}/{f}" for f in files)
        if len(out) > limit:
            return None
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------------------------
# Who owns a work folder, and whether that process is gone.


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), where there is one."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), to tell a reused pid apart."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def owner_record() -> dict[str, Any]:
    """This process, as work folders and cache claims record it."""
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "start": _start_ticks(pid),
    }


def owner_is_gone(owner: Any) -> bool:
    """True only when we can tell: the same host, and the process no longer runs (another boot,
    no such pid, or the pid now belongs to a process started at another time)."""
    if not isinstance(owner, dict) or owner.get("host") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    boot = _boot_id()
    if owner.get("boot_id") and boot and owner["boot_id"] != boot:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    fields = _proc_stat(pid)
    if fields and fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return True
    start = owner.get("start")
    return start is not None and _start_ticks(pid) not in (None, start)


def _write_owner(work: Path, out: Path, state: str) -> None:
    record = {**owner_record(), "output": str(out), "state": state}
    tmp = work / (OWNER_NAME + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, work / OWNER_NAME)


def clean_stale_work_folders(out: Path) -> list[Path]:
    """Remove ``.NAME.incomplete-*`` work folders of ``out`` whose writer is gone; first, if the
    output is missing, complete the swap it was in (its new content is complete) or restore the
    old output it had moved aside. Returns the folders removed."""
    removed = []
    try:
        candidates = sorted(out.parent.glob(f".{_glob_escape(out.name)}{INCOMPLETE_INFIX}*"))
    except OSError:
        return removed
    for work in candidates:
        owner = _read_json(work / OWNER_NAME)
        if not work.is_dir() or work.is_symlink() or not owner_is_gone(owner):
            continue
        new, old = work / "new", work / "old"
        try:
            if not os.path.lexists(out):
                if owner.get("state") == "swapping" and (new / MARKER_NAME).is_file():
                    os.rename(new, out)  # the writer had finished: complete its swap
                elif old.is_dir():
                    os.rename(old, out)  # restore the output it had moved aside
        except OSError:
            continue  # keep everything; the next run tries again
        shutil.rmtree(work, ignore_errors=True)
        removed.append(work)
    return removed


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# ----------------------------------------------------------------------------------------------
# The swap.


def _renameat2() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()
_AT_FDCWD = -100
RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``). False where the OS or
    file system cannot; raises OSError for other failures."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under ``folder`` to disk, so a rename never publishes data
    that a power cut would lose."""
    for root, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_marker(content: Path, kind: str) -> None:
    entries = []
    for name in sorted(os.listdir(content)):
        entries.extend(_tree(content / name, name, limit=10**9) or [])
    marker = {
        "written_by": "mergelab",
        "format": MARKER_FORMAT,
        "kind": kind,
        "entries": entries,
    }
    (content / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n")


def _swap_into_place(content: Path, out: Path, work: Path, force: bool) -> None:
    """Put the complete ``content`` at ``out`` in one step, the old output (if any) going to the
    work folder; on an error the old output stays at ``out``."""
    _write_owner(work, out, "swapping")
    if not os.path.lexists(out):
        os.rename(content, out)  # an empty folder created meanwhile is replaced, nothing else
        return
    if not force:
        raise OutputExistsError(f"output {out} appeared while writing; pass --force to replace it")
    check_replaceable_folder(out)  # again: the user may have added files during a long merge
    if exchange(content, out):
        return
    old = work / "old"
    os.rename(out, old)
    try:
        os.rename(content, out)
    except BaseException:
        os.rename(old, out)  # roll back
        raise


# ----------------------------------------------------------------------------------------------
# Signals: SIGTERM raises like Ctrl-C while an output is written; both wait during the swap.


class _SignalGuard:
    def __init__(self) -> None:
        self.pending: list[int] = []
        self.active = threading.current_thread() is threading.main_thread()
        self.previous: dict[int, Any] = {}

    def _defer(self, signum: int, frame: Any) -> None:
        self.pending.append(signum)

    def __enter__(self) -> _SignalGuard:
        if self.active:
            previous = signal.getsignal(signal.SIGTERM)
            if previous is signal.SIG_DFL:  # never take over an application's handler
                self.previous[signal.SIGTERM] = previous
                signal.signal(signal.SIGTERM, raise_terminated)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()
        if self.pending:  # a signal that came during the swap: delivered now, output complete
            signal.raise_signal(self.pending[0])

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Signals wait until the block is done (a swap must not stop halfway)."""
        if not self.active:
            yield
            return
        saved = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if handler in (signal.SIG_DFL, signal.default_int_handler, raise_terminated):
                saved[signum] = signal.signal(signum, self._defer)
        try:
            yield
        finally:
            for signum, handler in saved.items():
                signal.signal(signum, handler)


def _output_fault(exc: OSError, out: Path, work: Path | None) -> OSError | None:
    """A clearer OSError for a failed write (disk full, read-only, no permission) of ``out``."""
    inside = exc.filename is not None and (
        str(exc.filename).startswith(str(work) if work else "\0")
        or Path(os.fsdecode(exc.filename)).parent == out.parent
    )
    writing = exc.errno in _WRITE_FAULTS or (exc.errno in (errno.EACCES, errno.EPERM) and inside)
    if not writing:
        return None
    return OSError(
        exc.errno,
        f"could not write {out}: {exc.strerror or os.strerror(exc.errno)}; "
        "the incomplete output was removed and the old one (if any) is unchanged",
    )


@contextlib.contextmanager
def atomic_output_dir(
    output: str | os.PathLike,
    *,
    force: bool = False,
    inputs: Sequence[str | os.PathLike | None] = (),
    kind: str = "output",
) -> Iterator[Path]:
    """Yield an empty folder to write the output into; it becomes ``output`` only when the block
    completes. ``kind`` (e.g. "merge", "lora-adapter", "eval") is recorded in the marker."""
    out = check_output_path(output, force=force, inputs=inputs)
    work: Path | None = None
    with _SignalGuard() as guard:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f".{out.name}{INCOMPLETE_INFIX}", dir=out.parent))
            _write_owner(work, out, "writing")
            content = work / "new"
            content.mkdir()  # default permissions (mkdtemp's folder is 0700)
            yield content
            _write_marker(content, kind)
            _fsync_tree(content)
            with guard.deferred():
                _swap_into_place(content, out, work, force)
                _fsync_dir(out.parent)
                shutil.rmtree(work, ignore_errors=True)  # the old output, after an exchange
        except BaseException as exc:
            if work is not None and not (work / "old").exists():
                shutil.rmtree(work, ignore_errors=True)
            clearer = _output_fault(exc, out, work) if isinstance(exc, OSError) else None
            if clearer is not None:
                raise clearer from exc
            raise


def check_output_file(
    output: str | os.PathLike,
    *,
    force: bool = False,
    inputs: Sequence[str | os.PathLike | None] = (),
    written_by_mergelab: Callable[[Path], bool] | None = None,
) -> Path:
    """Check a single-file output: not an input or inside one; if it exists, replaced only with
    ``force``, only if it is a regular file and (given ``written_by_mergelab``) only if that
    recognises it as a file mergelab wrote."""
    out = output_path(output)
    check_inputs_overlap(out, inputs)
    if os.path.lexists(out):
        if not force:
            raise OutputExistsError(f"output {out} already exists; pass --force to replace it")
        if out.is_symlink() or not out.is_file():
            raise ForeignOutputError(
                f"{out} is not a regular file; refusing to replace it even with --force"
            )
        if written_by_mergelab is not None and not written_by_mergelab(out):
            raise ForeignOutputError(
                f"{out} is not a file mergelab wrote (its content is not mergelab's format); "
                "refusing to replace it even with --force"
            )
    return out


@contextlib.contextmanager
def atomic_output_file(
    output: str | os.PathLike,
    *,
    force: bool = True,
    inputs: Sequence[str | os.PathLike | None] = (),
    written_by_mergelab: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """Same idea for one file (results, figures): written to a temp file, then renamed over the
    output. See :func:`check_output_file` for what ``force`` may replace."""
    out = check_output_file(
        output, force=force, inputs=inputs, written_by_mergelab=written_by_mergelab
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        check_output_file(out, force=force, inputs=inputs, written_by_mergelab=written_by_mergelab)
        os.replace(tmp, out)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        clearer = _output_fault(exc, out, None) if isinstance(exc, OSError) else None
        if clearer is not None:
            raise clearer from exc
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask
