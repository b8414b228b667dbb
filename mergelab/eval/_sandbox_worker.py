"""Sandbox worker ("zygote"): a small, clean Python process that runs untrusted programs.

Started by :class:`mergelab.eval.sandbox.Sandbox` with an empty environment and nothing of the
harness in memory. It reads jobs from its stdin and, per job, forks twice:

    worker ──fork──> launcher (root; new net/mount/pid/ipc/uts namespaces, private tmpfs)
                        └──fork──> program (pid 1 of the new pid namespace; rlimits, unprivileged
                                   uid, cwd = fresh scratch dir, clean env) → exec(program)

Forking a warm interpreter costs ~1 ms instead of ~100 ms for a fresh one, which is why this is a
fork server rather than one ``python`` subprocess per program. When the program process (pid 1
of its namespace) exits or is killed, the kernel kills everything it started, so no fork bomb or
daemon outlives its job; the launcher's death takes the program down via PDEATHSIG.

Protocol on stdin/stdout: 4-byte big-endian length + UTF-8 JSON, one request then one reply.
Stdlib only: this file runs as a script and must not import mergelab.
"""

# Modules that test programs commonly import, loaded once here so each forked program gets them
# for free.
import bisect  # noqa: F401
import collections  # noqa: F401
import copy  # noqa: F401
import ctypes
import fractions  # noqa: F401
import functools  # noqa: F401
import hashlib  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import random  # noqa: F401
import re  # noqa: F401
import resource
import selectors
import signal
import socket  # noqa: F401 - also needed by the socket guard of the fallback mode
import string  # noqa: F401
import struct
import sys
import time
import traceback
import typing  # noqa: F401

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 8, 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# Directories any user may write to on a normal Linux system: each gets a private, size-limited
# tmpfs inside the sandbox, so a write there never reaches the real one.
WORLD_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock")
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _private_mounts(job):
    """Launcher side, after unshare: private tmpfs over the world-writable dirs."""
    # Make every mount private so our tmpfs mounts never propagate to the host.
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    opts = f"size={int(job['tmpfs_bytes'])},mode=1777".encode()
    for d in WORLD_WRITABLE_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            _check(_libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), d)
    _expose_python(HIDDEN_PYTHON_ROOTS)
    scratch = "/tmp/scratch"  # inside the private tmpfs: gone when the namespace dies
    os.mkdir(scratch, 0o700)
    return scratch


def _hidden_python_roots():
    """Python install dirs (prefixes) below a directory other users cannot enter (e.g. a pyenv
    under /root, mode 0700). Returns {that directory: [install dirs below it]}."""
    roots = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    hidden = {}
    for root in roots:
        parts = root.split(os.sep)
        for i in range(2, len(parts)):
            ancestor = os.sep.join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:
                hidden.setdefault(ancestor, []).append(root)
                break
    return hidden


def _expose_python(hidden):
    """Inside the mount namespace: cover each hidden directory with an empty tmpfs holding only
    read-only binds of the Python install, so the unprivileged program can import the standard
    library and site-packages, and sees nothing else there (e.g. the rest of /root)."""
    for n, (ancestor, roots) in enumerate(hidden.items()):
        staged = []
        for k, root in enumerate(roots):
            stage = f"/tmp/.stage-{n}-{k}"
            os.mkdir(stage)
            _check(_libc.mount(root.encode(), stage.encode(), None, MS_BIND | MS_REC, None), root)
            staged.append((stage, root))
        _check(
            _libc.mount(
                b"tmpfs", ancestor.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"
            ),
            ancestor,
        )
        for stage, root in staged:
            os.makedirs(root, mode=0o755, exist_ok=True)
            _check(_libc.mount(stage.encode(), root.encode(), None, MS_MOVE, None), f"move {root}")
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY
            _check(_libc.mount(None, root.encode(), None, flags, None), f"read-only {root}")
            os.rmdir(stage)


def _limit(res, value):
    value = int(value)
    resource.setrlimit(res, (value, value))


def _run_program(job, scratch, w_out, w_err, w_res, drop_uid, isolated_net, own_pidns):
    """Program process: apply limits, drop privileges, run the program, report, exit."""
    extra_isolation = []
    try:
        if own_pidns:
            # A /proc of our own pid namespace: host processes (their command lines, their
            # environments) are not even listed.
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
            if _libc.mount(b"proc", b"/proc", b"proc", flags, None) == 0:
                extra_isolation.append("private-proc")
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(w_out, 1)
        os.dup2(w_err, 2)
        # Close everything else the worker had open (its protocol pipes above all).
        os.closerange(3, w_res)
        os.closerange(w_res + 1, 1 << 16)
        os.chdir(scratch)
        os.setpgid(0, 0)  # own process group, so the launcher can kill it as a whole
        cpu = max(1, int(job["cpu_s"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        _limit(resource.RLIMIT_AS, job["memory_bytes"])
        _limit(resource.RLIMIT_FSIZE, job["max_file_bytes"])
        _limit(resource.RLIMIT_CORE, 0)
        _limit(resource.RLIMIT_NOFILE, 256)
        if drop_uid:
            os.setgroups([])
            os.setgid(job["gid"])
            os.setuid(job["uid"])
        # Per-uid process limit: only meaningful once we are not root (root ignores it), and
        # each worker slot has its own uid so parallel jobs do not share the budget.
        _limit(resource.RLIMIT_NPROC, job["max_processes"])
        # After setuid: a credential change clears PDEATHSIG.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.environ.clear()
        os.environ.update({"PATH": CLEAN_PATH, "HOME": scratch, "LANG": "C.UTF-8"})
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if not isolated_net:
            _block_sockets()
        sys.argv = ["program.py"]
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        sys.stdin = os.fdopen(0, "r", closefd=False)
    except BaseException as exc:  # noqa: BLE001 - report set-up failures, never run the program
        msg = {"pid": os.getpid(), "outcome": "crashed", "error": f"sandbox set-up failed: {exc!r}"}
        _write_all(w_res, (json.dumps(msg) + "\n").encode())
        os._exit(0)

    outcome, error = "passed", ""
    try:
        code = compile(job["program"], "program.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except AssertionError as exc:
        outcome, error = "failed", _short_traceback(exc)
    except SystemExit as exc:
        outcome = "crashed"
        error = f"program called exit({exc.code!r}) before finishing"
    except BaseException as exc:  # noqa: BLE001 - the whole point is to catch everything
        outcome, error = "crashed", _short_traceback(exc)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    msg = {"pid": os.getpid(), "outcome": outcome, "error": error, "isolation": extra_isolation}
    _write_all(w_res, (json.dumps(msg) + "\n").encode())
    os._exit(0)


def _short_traceback(exc, limit=4000):
    """The traceback from the program's frames on (this file's frame is skipped)."""
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return text[-limit:]


def _block_sockets():
    """Fallback when no network namespace is available: no socket can be created."""

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    socket.socket = refuse
    socket.create_connection = refuse
    socket.socketpair = refuse


def _launcher(job, w_out, w_err, w_res):
    os.setsid()
    isolation = []
    scratch = None
    is_root = os.geteuid() == 0
    if job["namespaces"] and is_root:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        if _libc.unshare(flags) == 0:
            # Past this point a failure fails the job: half a sandbox is not a fallback.
            scratch = _private_mounts(job)
            isolation += ["netns", "pidns", "mountns", "private-tmp"]
        elif job["namespaces"] == "require":
            raise OSError(ctypes.get_errno(), "unshare failed and isolation='strict'")
        else:
            isolation.append(f"no-namespaces({os.strerror(ctypes.get_errno())})")
    if scratch is None:
        import tempfile

        scratch = tempfile.mkdtemp(prefix="mergelab-sandbox-")
    drop_uid = is_root
    if drop_uid:
        os.chown(scratch, job["uid"], job["gid"])
        isolation.append("unprivileged-uid")
    isolated_net = "netns" in isolation
    if not isolated_net:
        isolation.append("socket-guard")

    child = os.fork()
    if child == 0:
        _run_program(
            job, scratch, w_out, w_err, w_res, drop_uid, isolated_net, "pidns" in isolation
        )
    timed_out = []

    def on_alarm(signum, frame):
        timed_out.append(True)
        # In a pid namespace, killing its pid 1 kills every process in it.
        os.kill(child, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, job["timeout_s"])
    _, status = os.waitpid(child, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if "pidns" not in isolation:
        # Without a pid namespace, take down whatever is left of the program's process group.
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
        _kill_uid(job["uid"] if drop_uid else None)
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    msg = {
        "launcher": True,
        "program_pid": 1 if "pidns" in isolation else child,
        "timed_out": bool(timed_out),
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "isolation": isolation,
    }
    _write_all(w_res, (json.dumps(msg) + "\n").encode())
    os._exit(0)


def _kill_uid(uid):
    """Without a pid namespace: kill every process left running under the sandbox uid."""
    if uid is None:
        return
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # all processes this uid may signal: its own
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _run_job(job):
    t0 = time.monotonic()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_res, w_res = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (r_out, r_err, r_res):
                os.close(fd)
            _launcher(job, w_out, w_err, w_res)
        except BaseException:  # noqa: BLE001
            try:
                _write_all(
                    w_res, (json.dumps({"launcher_error": traceback.format_exc()}) + "\n").encode()
                )
            finally:
                os._exit(70)
        os._exit(70)
    for fd in (w_out, w_err, w_res):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    limits = {r_out: job["max_output_bytes"], r_err: job["max_output_bytes"], r_res: 1 << 20}
    bufs = {r_out: bytearray(), r_err: bytearray(), r_res: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    # Backstop only: the launcher enforces the wall clock itself.
    deadline = t0 + job["timeout_s"] + 5.0
    backstop_kill = False
    exited = False
    while not exited:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            os.kill(pid, signal.SIGKILL)
            backstop_kill = True
            break
        for key, _ in sel.select(timeout=remaining):
            if key.fd == pidfd:
                exited = True
            else:
                _drain(key.fd, bufs, limits, sel)
    os.waitpid(pid, 0)
    os.close(pidfd)
    # Anything still buffered in the pipes (writers are all dead now, or orphaned and killed).
    for fd in list(bufs):
        try:
            _drain(fd, bufs, limits, sel, until_empty=True)
        except OSError:
            pass
        os.close(fd)
    sel.close()
    seconds = time.monotonic() - t0
    return _classify(bufs[r_res], bufs[r_out], bufs[r_err], backstop_kill, seconds, job)


def _drain(fd, bufs, limits, sel, until_empty=False):
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not chunk:
            try:
                sel.unregister(fd)
            except (KeyError, ValueError):
                pass
            return
        room = limits[fd] - len(bufs[fd])
        if room > 0:
            bufs[fd] += chunk[:room]
        if not until_empty:
            return


def _classify(res, out, err, backstop_kill, seconds, job):
    launcher, program_msgs = None, []
    for line in bytes(res).decode("utf-8", "replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if not isinstance(msg, dict):
            continue
        if msg.get("launcher") is True:
            launcher = msg
        elif "launcher_error" in msg:
            launcher = {"error": msg["launcher_error"]}
        else:
            program_msgs.append(msg)
    result = {
        "stdout": bytes(out).decode("utf-8", "replace"),
        "stderr": bytes(err).decode("utf-8", "replace"),
        "seconds": seconds,
        "exit_signal": None,
        "isolation": [],
    }
    if launcher is None or "error" in (launcher or {}):
        detail = (launcher or {}).get("error", "launcher died")
        if backstop_kill:
            return {**result, "status": "timed_out", "error": "killed by the worker's backstop"}
        return {**result, "status": "crashed", "error": f"sandbox failure: {detail}"}
    result["isolation"] = launcher["isolation"]
    result["exit_signal"] = launcher["signal"]
    # Only the program's own process may report an outcome; forked copies are ignored.
    mine = [m for m in program_msgs if m.get("pid") == launcher["program_pid"]]
    if launcher["timed_out"]:
        return {**result, "status": "timed_out", "error": f"wall-clock limit {job['timeout_s']} s"}
    if launcher["signal"] == signal.SIGXCPU or (
        launcher["signal"] == signal.SIGKILL and not mine and seconds >= job["cpu_s"]
    ):
        return {**result, "status": "timed_out", "error": f"CPU-time limit {job['cpu_s']} s"}
    if mine:
        m = mine[-1]
        result["isolation"] = result["isolation"] + m.get("isolation", [])
        return {**result, "status": m["outcome"], "error": m.get("error", "")}
    if launcher["signal"] is not None:
        name = signal.Signals(launcher["signal"]).name
        return {**result, "status": "crashed", "error": f"killed by {name}"}
    return {
        **result,
        "status": "crashed",
        "error": f"exited with code {launcher['exit_code']} before the program finished",
    }


HIDDEN_PYTHON_ROOTS = {}


def main():
    global HIDDEN_PYTHON_ROOTS
    HIDDEN_PYTHON_ROOTS = _hidden_python_roots()
    # Keep the protocol pipes off fds 0/1 so nothing a program does can write into them.
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides when we stop
    while True:
        header = _read_exact(proto_in, 4)
        if header is None:
            return
        (n,) = struct.unpack(">I", header)
        job = json.loads(_read_exact(proto_in, n).decode("utf-8"))
        try:
            reply = _run_job(job)
        except Exception:  # noqa: BLE001 - never let one job take the worker down
            reply = {"status": "crashed", "error": "worker error: " + traceback.format_exc()}
        data = json.dumps(reply).encode("utf-8")
        _write_all(proto_out, struct.pack(">I", len(data)) + data)


if __name__ == "__main__":
    main()
