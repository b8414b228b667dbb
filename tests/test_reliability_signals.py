"""A real `mergelab merge` process stopped mid-merge: SIGTERM cleans up like Ctrl-C (non-zero exit,
one line, no traceback); SIGKILL leaves a work folder that the next run on the output removes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mergelab.cli import main
from mergelab.merge.checkpoint import CheckpointFolder
from mergelab.outputs import MARKER_NAME
from mergelab.tiny import tiny_causal_lm

# Runs `mergelab merge ARGS`, pausing inside the merge (after a few tensors were written) and
# saying so on stdout, so the test can signal it at that point. The pause is many short sleeps:
# Python runs a signal's handler between bytecodes, so a signal that lands after the print but
# before a sleep starts (e.g. while this thread waits for the GIL, which the engine's worker
# threads hold while they merge tensors ahead) is handled when the next short sleep ends; one
# long sleep would keep it pending for its whole length.
PAUSING_MERGE = """
import sys, time
from mergelab.cli import main
from mergelab.merge import checkpoint

real = checkpoint.CheckpointMergePlan.merge_tensor
count = [0]

def merge_tensor(self, t, phase=None):
    count[0] += 1
    if count[0] == 4:
        print("merging", flush=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return real(self, t, phase)

checkpoint.CheckpointMergePlan.merge_tensor = merge_tensor
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    for i, name in enumerate(["base", "math", "code"]):
        model = tiny_causal_lm(
            48,
            architecture="llama",
            hidden_size=16,
            num_layers=2,
            num_heads=2,
            seed=i,
            intermediate_size=32,
            num_key_value_heads=1,
            pad_token_id=None,
        )
        model.save_pretrained(root / name)
    return root


def merge_argv(root: Path, out: Path, method: str = "linear") -> list[str]:
    return [
        "merge",
        "--method",
        method,
        "--models",
        str(root / "math"),
        str(root / "code"),
        "--out",
        str(out),
        "--no-progress",
        "--force",
    ]


def start_and_signal(argv: list[str], signum: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSING_MERGE, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "merging", (line, proc.stderr.read() if proc.poll() else "")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def leftovers(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_sigterm_mid_merge_cleans_up_and_exits_without_traceback(models, tmp_path):
    out = tmp_path / "merged"
    assert main(merge_argv(models, out, "task_arithmetic") + ["--base", str(models / "base")]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    done = start_and_signal(merge_argv(models, out), signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "mergelab merge: interrupted (SIGTERM); the incomplete output was removed and nothing "
        "at the output path was changed"
    ]
    assert leftovers(tmp_path, "merged") == []
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old merge, untouched


def test_sigkill_leftovers_are_removed_by_the_next_run(models, tmp_path):
    out = tmp_path / "merged"
    done = start_and_signal(merge_argv(models, out), signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    (work,) = leftovers(tmp_path, "merged")
    owner = json.loads((work / "owner.json").read_text())
    assert owner["pid"] > 0 and owner["host"] and owner["state"] == "writing"
    assert any((work / "new").glob("model-*.safetensors"))  # a half-written merge
    assert not out.exists()

    # A work folder of a live process (this one) is another run in progress: kept.
    live = tmp_path / ".merged.incomplete-live"
    live.mkdir()
    (live / "owner.json").write_text(json.dumps({**owner, "pid": os.getpid(), "start": None}))

    assert main(merge_argv(models, out)) == 0
    assert not work.exists() and live.exists()
    assert (out / MARKER_NAME).is_file()
    with CheckpointFolder(out) as f:
        merged = {n: f.read(n).clone() for n in f.tensors}
    assert all(torch.isfinite(t).all() for t in merged.values())
