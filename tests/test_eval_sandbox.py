"""The sandbox runs real HumanEval correctly and contains hostile programs.

Containment tests need what the default sandbox uses: root (to drop to a sandbox uid) and
Linux namespaces; they are skipped, saying so, where those are unavailable.
"""

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from mergelab.eval.benchmarks import load_humaneval
from mergelab.eval.sandbox import BASE_UID, Sandbox, SandboxLimits
from mergelab.eval.scoring_code import build_test_programs


def _namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    with Sandbox(workers=1) as sb:
        return "netns" in sb.run("pass").isolation


STRICT = _namespaces_work()
needs_strict = pytest.mark.skipif(not STRICT, reason="needs root and Linux namespaces")


@pytest.fixture(scope="module")
def sandbox():
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=512 << 20, max_processes=16)
    with Sandbox(workers=2, limits=limits) as sb:
        yield sb


def _sandbox_processes() -> list[int]:
    """Pids of live processes running under a sandbox uid."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        uid_line = next((ln for ln in text.splitlines() if ln.startswith("Uid:")), "")
        state = next((ln for ln in text.splitlines() if ln.startswith("State:")), "")
        fields = uid_line.split()
        if len(fields) > 1 and int(fields[1]) >= BASE_UID and "Z" not in state:
            pids.append(int(status.parent.name))
    return pids


def test_humaneval_canonical_solutions_pass_164_of_164(sandbox):
    bench = load_humaneval()
    assert len(bench) == 164
    programs = [build_test_programs(it.prompt, it.solution, it.tests)["base"] for it in bench.items]
    t0 = time.monotonic()
    results = sandbox.run_many(programs)
    elapsed = time.monotonic() - t0
    failures = [
        (it.item_id, r.status, r.error[-200:])
        for it, r in zip(bench.items, results)
        if not r.passed
    ]
    assert failures == []
    assert elapsed < 40, f"164 programs took {elapsed:.1f} s"


def test_wrong_solutions_fail(sandbox):
    bench = load_humaneval(limit=12)
    wrong = "    return None\n"
    programs = [build_test_programs(it.prompt, wrong, it.tests)["base"] for it in bench.items]
    # A subtly wrong version of a correct solution (HumanEval/0 never reports a close pair).
    it0 = bench.items[0]
    subtly_wrong = it0.solution.replace("return True", "return False")
    assert subtly_wrong != it0.solution
    programs.append(build_test_programs(it0.prompt, subtly_wrong, it0.tests)["base"])
    results = sandbox.run_many(programs)
    # A wrong answer fails an assert ("failed"), or breaks the test code ("crashed", e.g. a
    # TypeError on None): never "passed".
    assert all(r.status in ("failed", "crashed") for r in results)
    assert sum(r.status == "failed" for r in results) >= len(programs) // 2
    assert results[-1].status == "failed" and "AssertionError" in results[-1].error


def test_statuses_and_error_text(sandbox):
    results = sandbox.run_many(
        [
            "print('hello')\nassert 2 + 2 == 4",
            "assert 2 + 2 == 5, 'arithmetic is broken'",
            "def f(:\n    pass",
            "raise ValueError('boom')",
            "import sys\nsys.exit(0)",
        ]
    )
    assert [r.status for r in results] == ["passed", "failed", "crashed", "crashed", "crashed"]
    assert results[0].stdout == "hello\n"
    assert "arithmetic is broken" in results[1].error
    assert "SyntaxError" in results[2].error
    assert "ValueError: boom" in results[3].error
    assert "exit" in results[4].error  # exiting early is not a pass


def test_infinite_loop_times_out(sandbox):
    t0 = time.monotonic()
    wall, cpu, sleeper = sandbox.run_many(
        ["while True:\n    pass", "while True:\n    pass", "import time\ntime.sleep(60)"],
        limits=[
            SandboxLimits(timeout_s=1.0),
            SandboxLimits(timeout_s=30.0, cpu_s=1.0),
            SandboxLimits(timeout_s=1.0),
        ],
    )
    assert (wall.status, cpu.status, sleeper.status) == ("timed_out",) * 3
    assert "CPU" in cpu.error and "wall" in wall.error and "wall" in sleeper.error
    assert time.monotonic() - t0 < 20  # CPU seconds take longer on a busy machine


def test_memory_bomb_is_stopped(sandbox):
    prog = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))"
    res = sandbox.run(prog, SandboxLimits(timeout_s=10.0, memory_bytes=256 << 20))
    assert res.status == "crashed"
    assert "MemoryError" in res.error
    assert res.seconds < 5


@needs_strict
def test_fork_bomb_is_contained_and_cleaned_up(sandbox):
    bomb = "import os\nwhile True:\n    os.fork()"
    t0 = time.monotonic()
    res = sandbox.run(bomb, SandboxLimits(timeout_s=3.0, max_processes=16))
    assert res.status in ("crashed", "timed_out")
    assert time.monotonic() - t0 < 6
    # Daemons left behind by a program that exits are killed with its pid namespace.
    daemons = (
        "import os, time\n"
        "for _ in range(5):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(600)\n"
    )
    assert sandbox.run(daemons).status == "passed"
    time.sleep(0.2)
    assert _sandbox_processes() == []
    assert sandbox.run("assert True").status == "passed"  # the workers survived


@needs_strict
def test_writes_outside_scratch_dir_do_not_land(sandbox, tmp_path):
    tag = uuid.uuid4().hex
    open_dir = tmp_path / "world-writable"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    repo_root = Path(__file__).resolve().parents[1]
    targets = [
        f"/tmp/mergelab-escape-{tag}",
        f"/var/tmp/mergelab-escape-{tag}",
        f"/dev/shm/mergelab-escape-{tag}",
        str(open_dir / f"escape-{tag}"),
        str(repo_root / f"escape-{tag}"),
    ]
    prog = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('escaped')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', path, type(e).__name__)\n"
        "open('inside.txt', 'w').write('fine')  # the scratch dir is writable\n"
        "print('cwd', os.getcwd())\n"
    )
    res = sandbox.run(prog)
    assert res.status == "passed", res.error
    for path in targets:
        assert not os.path.exists(path), f"{path} was written on the host"
    cwd = res.stdout.split("cwd ")[-1].strip()
    assert not os.path.exists(os.path.join(cwd, "inside.txt"))  # scratch is gone


@needs_strict
def test_network_is_unreachable(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    prog = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'exfiltrated')\n"
    )
    res = sandbox.run(prog)
    try:
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert res.status == "crashed"
    assert "OSError" in res.error or "ConnectionRefusedError" in res.error


@needs_strict
def test_killing_the_parent_is_not_obeyed(sandbox):
    worker_pids = [w.proc.pid for w in sandbox._all if w.proc is not None]
    targets = [os.getpid(), *worker_pids]
    prog = (
        "import os, signal\n"
        "outcomes = []\n"
        f"for pid in [os.getppid(), *{targets!r}]:\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        outcomes.append('sent')\n"
        "    except OSError as e:\n"
        "        outcomes.append(type(e).__name__)\n"
        "print(outcomes)\n"
    )
    res = sandbox.run(prog)
    assert res.status == "passed"
    # Every worker is still alive and still runs programs.
    assert all(w.proc.poll() is None for w in sandbox._all if w.proc is not None)
    assert sandbox.run_many(["assert 1"] * 4) and sandbox.run("assert 1").passed


def test_environment_secrets_are_not_visible(monkeypatch):
    secret = "s3cret-" + uuid.uuid4().hex
    monkeypatch.setenv("MERGELAB_FAKE_API_KEY", secret)
    prog = (
        "import os\n"
        "seen = repr(dict(os.environ))\n"
        f"for path in ['/proc/self/environ', '/proc/1/environ', '/proc/{os.getpid()}/environ',\n"
        "             f'/proc/{os.getppid()}/environ']:\n"
        "    try:\n"
        "        seen += open(path, 'rb').read().decode('latin-1')\n"
        "    except OSError:\n"
        "        pass\n"
        f"assert {secret!r} not in seen, 'secret leaked'\n"
        "assert 'MERGELAB_FAKE_API_KEY' not in seen\n"
    )
    with Sandbox(workers=1) as sb:  # started after the secret was set
        res = sb.run(prog)
    assert res.status == "passed", res.error


def test_basic_isolation_fallback_still_scores(tmp_path):
    with Sandbox(workers=1, isolation="basic", limits=SandboxLimits(timeout_s=2)) as sb:
        ok, bad, net = sb.run_many(
            ["assert sum([1, 2]) == 3", "assert 0", "import socket\nsocket.socket()"]
        )
    assert (ok.status, bad.status, net.status) == ("passed", "failed", "crashed")
    assert "socket-guard" in ok.isolation and "netns" not in ok.isolation


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="none")
    with Sandbox(workers=1) as sb, pytest.raises(TypeError, match="source text"):
        sb.run(b"print(1)")
