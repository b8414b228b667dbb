import pytest

from mergelab.outputs import (
    OutputExistsError,
    atomic_output_dir,
    atomic_output_file,
    check_output_path,
)


def test_output_dir_appears_only_when_complete(tmp_path):
    out = tmp_path / "merged"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("x")
        assert not out.exists()  # nothing that looks finished while writing
    assert (out / "a.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_interrupted_write_leaves_nothing(tmp_path):
    out = tmp_path / "merged"
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"0")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_force(tmp_path):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="--force"):
        with atomic_output_dir(out):
            pass
    assert (out / "old.txt").read_text() == "keep me"
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]


def test_output_inside_input_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(ValueError, match="overlaps input"):
        check_output_path(model / "out", inputs=[model])
    with pytest.raises(ValueError, match="overlaps input"):
        check_output_path(tmp_path, inputs=[model], force=True)


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


def test_atomic_file_gets_normal_permissions(tmp_path):
    import os

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
