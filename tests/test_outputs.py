"""mergelab.outputs: outputs appear complete or not at all, --force never replaces what mergelab
did not write, and no crash, kill or full disk leaves nothing where an output was."""

import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mergelab import outputs
from mergelab.outputs import (
    MARKER_NAME,
    ForeignOutputError,
    OutputExistsError,
    atomic_output_dir,
    atomic_output_file,
    check_output_file,
    check_output_path,
    clean_stale_work_folders,
    exchange,
)


def write_output(out: Path, **files: str) -> None:
    with atomic_output_dir(out, force=True) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def stale_work_folder(out: Path, *, pid: int, host: str | None = None, state="writing") -> Path:
    """A work folder as a writer killed with SIGKILL leaves it."""
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.incomplete-", dir=out.parent))
    owner = {**outputs.owner_record(), "pid": pid, "start": None, "state": state}
    if host is not None:
        owner["host"] = host
    (work / "owner.json").write_text(json.dumps(owner))
    (work / "new").mkdir()
    (work / "new" / "half.bin").write_bytes(b"0" * 100)
    return work


def test_output_dir_appears_only_when_complete(tmp_path):
    out = tmp_path / "merged"
    with atomic_output_dir(out, kind="test") as tmp:
        (tmp / "a.txt").write_text("x")
        assert not out.exists()  # nothing that looks finished while writing
    assert (out / "a.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["written_by"] == "mergelab" and marker["kind"] == "test"
    assert marker["entries"] == ["a.txt"]


def test_interrupted_write_leaves_nothing(tmp_path):
    out = tmp_path / "merged"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"0")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "merged"
    write_output(out, **{"old.txt": "previous merge"})
    with pytest.raises(OutputExistsError, match="--force"):
        with atomic_output_dir(out):
            pass
    assert (out / "old.txt").read_text() == "previous merge"
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert listing(out) == [MARKER_NAME, "new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write_output(empty, **{"a.txt": "a"})  # an empty folder may be replaced too
    assert listing(empty) == ["a.txt", MARKER_NAME]


def test_force_never_replaces_what_mergelab_did_not_write(tmp_path):
    """Data loss once reproduced: `--out . --force` in a folder of unrelated files deleted them."""
    out = tmp_path / "work"
    out.mkdir()
    (out / "a.txt").write_text("thesis")
    (out / "b").mkdir()
    (out / "b" / "data.csv").write_text("1,2")
    (out / "c.txt").write_text("notes")
    message = r"holds 3 entries mergelab did not write: a\.txt, b/, c\.txt; refusing .* --force"
    with pytest.raises(ForeignOutputError, match=message):
        check_output_path(out, force=True)
    with pytest.raises(ForeignOutputError, match=message):
        with atomic_output_dir(out, force=True) as tmp:
            (tmp / "model.safetensors").write_text("x")
    assert listing(out) == ["a.txt", "b", "c.txt"]
    assert (out / "b" / "data.csv").read_text() == "1,2"
    assert [p.name for p in tmp_path.iterdir()] == ["work"]  # no temp folder left

    # A mergelab output to which the user added a file: that file is not mergelab's.
    merged = tmp_path / "merged"
    write_output(merged, **{"config.json": "{}"})
    (merged / "my_notes.md").write_text("keep")
    with pytest.raises(ForeignOutputError, match=r"1 entry mergelab did not write: my_notes\.md"):
        write_output(merged, **{"config.json": "{}"})
    assert (merged / "my_notes.md").read_text() == "keep"

    # A file or a link at the output path is not a mergelab output folder.
    (tmp_path / "file").write_text("user file")
    with pytest.raises(ForeignOutputError, match="is a file"):
        write_output(tmp_path / "file", **{"a": "b"})
    (tmp_path / "link").symlink_to(tmp_path / "merged")
    with pytest.raises(ForeignOutputError, match="symbolic link"):
        write_output(tmp_path / "link", **{"a": "b"})
    assert (tmp_path / "file").read_text() == "user file"


def test_files_added_during_a_long_write_are_still_protected(tmp_path):
    out = tmp_path / "merged"
    write_output(out, **{"config.json": "{}"})
    with pytest.raises(ForeignOutputError, match="late.txt"):
        with atomic_output_dir(out, force=True) as tmp:
            (tmp / "config.json").write_text("{}")
            (out / "late.txt").write_text("written by the user while the merge ran")
    assert (out / "late.txt").exists() and (out / "config.json").exists()


def test_outputs_written_before_the_marker_are_recognised(tmp_path):
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "mergelab_merge.json").write_text('{"method": "ties"}')
    for name in ["config.json", "model-00001-of-00001.safetensors", "tokenizer.json"]:
        (merged / name).write_text("x")
    check_output_path(merged, force=True)  # replaceable
    (merged / "extra.bin").write_text("x")
    with pytest.raises(ForeignOutputError, match="extra.bin"):
        check_output_path(merged, force=True)
    results = tmp_path / "results"
    results.mkdir()
    (results / "summary.json").write_text('{"cache_key": "abc", "metrics": {}}')
    (results / "items.jsonl").write_text("")
    check_output_path(results, force=True)
    (results / "summary.json").write_text('{"something": "else"}')  # not an evaluation summary
    with pytest.raises(ForeignOutputError, match="2 entries"):
        check_output_path(results, force=True)


def test_output_overlapping_an_input_or_the_current_folder_is_refused(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ValueError, match="overlaps input"):
        check_output_path(model / "out", inputs=[model])
    with pytest.raises(ValueError, match="overlaps input"):
        check_output_path(tmp_path, inputs=[model], force=True)
    (model / "weights.bin").write_text("w")
    os.link(model / "weights.bin", tmp_path / "hardlink.bin")
    with pytest.raises(ValueError, match="overlaps input"):
        check_output_file(tmp_path / "hardlink.bin", inputs=[model / "weights.bin"], force=True)
    monkeypatch.chdir(model)
    with pytest.raises(ValueError, match="current folder"):
        check_output_path(".", force=True)
    check_output_path("out", inputs=[None, ""])  # no input given: nothing to overlap


def test_atomic_file(tmp_path):
    out = tmp_path / "r" / "results.json"
    with atomic_output_file(out) as tmp:
        tmp.write_text("{}")
    assert out.read_text() == "{}"
    with pytest.raises(OutputExistsError):
        with atomic_output_file(out, force=False):
            pass
    with pytest.raises(KeyError):
        with atomic_output_file(out) as tmp:
            tmp.write_text("partial")
            raise KeyError("boom")
    assert out.read_text() == "{}"
    assert sorted(p.name for p in out.parent.iterdir()) == ["results.json"]


def test_atomic_file_replaces_only_what_mergelab_recognises(tmp_path):
    out = tmp_path / "gen.jsonl"
    out.write_text("the user's own notes\n")
    ours = lambda p: p.read_text().startswith('{"candidate"')  # noqa: E731
    with pytest.raises(ForeignOutputError, match="not a file mergelab wrote"):
        with atomic_output_file(out, force=True, written_by_mergelab=ours) as tmp:
            tmp.write_text('{"candidate": 1}\n')
    assert out.read_text() == "the user's own notes\n"
    out.write_text('{"candidate": "old"}\n')
    with atomic_output_file(out, force=True, written_by_mergelab=ours) as tmp:
        tmp.write_text('{"candidate": "new"}\n')
    assert out.read_text() == '{"candidate": "new"}\n'
    (tmp_path / "folder").mkdir()
    with pytest.raises(ForeignOutputError, match="not a regular file"):
        check_output_file(tmp_path / "folder", force=True)
    assert listing(tmp_path) == ["folder", "gen.jsonl"]


def test_atomic_file_gets_normal_permissions(tmp_path):
    out = tmp_path / "results.json"
    with atomic_output_file(out) as tmp:
        tmp.write_text("{}")
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    folder = tmp_path / "merged"
    with atomic_output_dir(folder):
        pass
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask


# ----------------------------------------------------------------------------------------------
# The swap: old output intact or new one complete, never nothing.


def test_rename_exchange_swaps_two_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this OS or file system")
    assert listing(tmp_path / "b") == ["x"] and listing(tmp_path / "a") == []


def test_failed_exchange_keeps_the_old_output(tmp_path, monkeypatch):
    out = tmp_path / "merged"
    write_output(out, **{"w.bin": "old"})

    def broken(a, b):
        raise OSError(errno.EIO, "I/O error", str(a))

    monkeypatch.setattr(outputs, "exchange", broken)
    with pytest.raises(OSError, match="I/O error"):
        write_output(out, **{"w.bin": "new"})
    assert (out / "w.bin").read_text() == "old"
    assert listing(tmp_path) == ["merged"]


def test_two_rename_fallback_rolls_back(tmp_path, monkeypatch):
    """Without rename-exchange: old output aside, new one in; a failure in between is undone."""
    out = tmp_path / "merged"
    write_output(out, **{"w.bin": "old"})
    monkeypatch.setattr(outputs, "exchange", lambda a, b: False)
    real_rename = os.rename

    def failing_rename(src, dst):
        if Path(dst) == out and Path(src).name == "new":  # the second step: new content in
            raise OSError(errno.EIO, "I/O error", str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(outputs.os, "rename", failing_rename)
    with pytest.raises(OSError, match="I/O error"):
        write_output(out, **{"w.bin": "new"})
    monkeypatch.setattr(outputs.os, "rename", real_rename)
    assert (out / "w.bin").read_text() == "old"
    assert listing(tmp_path) == ["merged"]
    write_output(out, **{"w.bin": "new"})  # and without the failure the fallback replaces it
    assert (out / "w.bin").read_text() == "new" and listing(tmp_path) == ["merged"]


KILL_SCRIPT = """
import os, sys
from pathlib import Path
from mergelab import outputs

out, point = Path(sys.argv[1]), sys.argv[2]
if point != "after_exchange":
    outputs.exchange = lambda a, b: False  # the two-rename fallback
real_rename, real_rmtree = os.rename, outputs.shutil.rmtree

def rename(src, dst):
    real_rename(src, dst)
    if point == "between_renames" and Path(src) == out:
        os._exit(9)  # killed: the old output is aside, the new one not yet in place

def rmtree(path, *args, **kwargs):
    if point == "after_exchange":
        os._exit(9)  # killed: new output in place, old one still in the work folder
    real_rmtree(path, *args, **kwargs)

outputs.os.rename, outputs.shutil.rmtree = rename, rmtree
with outputs.atomic_output_dir(out, force=True) as tmp:
    (tmp / "w.bin").write_text("new")
    if point == "while_writing":
        os._exit(9)
"""


@pytest.mark.parametrize(
    "point, expected",
    [("while_writing", "old"), ("between_renames", "new"), ("after_exchange", "new")],
)
def test_killed_writer_leaves_old_or_new_never_nothing(tmp_path, point, expected):
    out = tmp_path / "merged"
    write_output(out, **{"w.bin": "old"})
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(out), point])
    assert proc.returncode == 9
    left = [p for p in tmp_path.iterdir() if p.name != "merged"]
    assert len(left) == 1 and ".merged.incomplete-" in left[0].name
    if point == "between_renames":
        assert not out.exists()  # on disk: nothing at the output path until the next start
    check_output_path(out, force=True)  # the next run on this output recovers first
    assert (out / "w.bin").read_text() == expected
    assert listing(tmp_path) == ["merged"]


def test_recovery_restores_the_old_output_when_the_new_one_is_incomplete(tmp_path):
    out = tmp_path / "merged"
    write_output(out, **{"w.bin": "old"})
    work = stale_work_folder(out, pid=dead_pid(), state="swapping")  # new/ has no marker
    os.rename(out, work / "old")
    clean_stale_work_folders(out)
    assert (out / "w.bin").read_text() == "old"
    assert listing(tmp_path) == ["merged"]


def test_stale_work_folders_of_dead_processes_only_are_removed(tmp_path):
    out = tmp_path / "merged"
    dead = stale_work_folder(out, pid=dead_pid())
    alive = stale_work_folder(out, pid=os.getpid())
    other_host = stale_work_folder(out, pid=dead_pid(), host=socket.gethostname() + "-other")
    no_owner = Path(tempfile.mkdtemp(prefix=".merged.incomplete-", dir=tmp_path))
    other_output = stale_work_folder(tmp_path / "other", pid=dead_pid())
    write_output(out, **{"w.bin": "new"})
    assert not dead.exists()
    assert alive.exists() and other_host.exists() and no_owner.exists() and other_output.exists()


SIGTERM_SCRIPT = """
import os, signal, sys
from mergelab.errors import Terminated
from mergelab.outputs import atomic_output_dir

before = signal.getsignal(signal.SIGTERM)
try:
    with atomic_output_dir(sys.argv[1], force=True) as tmp:
        (tmp / "w.bin").write_text("half")
        os.kill(os.getpid(), signal.SIGTERM)
except Terminated as exc:
    assert isinstance(exc, KeyboardInterrupt) and exc.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
    sys.exit(3)
"""


def test_sigterm_while_writing_cleans_up_like_ctrl_c(tmp_path):
    out = tmp_path / "merged"
    write_output(out, **{"w.bin": "old"})
    proc = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT, str(out)], capture_output=True)
    assert proc.returncode == 3, proc.stderr.decode()
    assert (out / "w.bin").read_text() == "old"
    assert listing(tmp_path) == ["merged"]


# ----------------------------------------------------------------------------------------------
# Disk full, read-only output: no temp folder left, old output intact, one clear error.


def test_disk_full_leaves_no_temp_and_the_old_output(tmp_path):
    out = tmp_path / "merged"
    write_output(out, **{"w.bin": "old"})
    with pytest.raises(OSError, match=r"could not write .*merged: No space left") as info:
        with atomic_output_dir(out, force=True) as tmp:
            (tmp / "w.bin").write_text("ne")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert info.value.errno == errno.ENOSPC
    assert (out / "w.bin").read_text() == "old"
    assert listing(tmp_path) == ["merged"]
    with pytest.raises(OSError, match="could not write") as info:
        with atomic_output_file(tmp_path / "r.json") as tmp:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert info.value.errno == errno.ENOSPC and listing(tmp_path) == ["merged"]


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_read_only_output_folder(tmp_path, monkeypatch, code):
    def refuse(prefix="", dir=None, **kwargs):
        raise OSError(code, os.strerror(code), os.path.join(dir, prefix + "abc"))

    monkeypatch.setattr(outputs.tempfile, "mkdtemp", refuse)
    with pytest.raises(OSError, match=r"could not write .*out") as info:
        write_output(tmp_path / "out", **{"a": "b"})
    assert info.value.errno == code
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_output_folder_by_permissions(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="could not write"):
            write_output(parent / "out", **{"a": "b"})
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)
