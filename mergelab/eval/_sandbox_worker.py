"""Sandbox worker ("zygote"): a small, clean Python process that runs untrusted programs.

Started by :class:`mergelab.eval.sandbox.Sandbox` with an empty environment and nothing of the
harness in memory. It reads jobs from its stdin and, per job, forks twice:

    worker ──fork──> launcher ──fork──> program
    reads the        enters new           pid 1 of the new pid namespace: private /proc, fds
    launcher's       namespaces, builds   0/1/2 (3: a call job's outputs) only, rlimits, no
    report, the      the new root, waits  capabilities, no_new_privs, clean environment →
    program's        (polling the job's   exec(source), then in a call job the calls
    stdout/stderr    memory), judges the
    and outputs      exit status

Forking a warm interpreter costs ~1 ms instead of ~100 ms for a fresh one, which is why this is a
fork server rather than one ``python`` subprocess per program. When the program (pid 1 of its
namespace) ends or is killed, the kernel kills everything it started. Like any pid 1, it ignores
signals it has no handler for when they come from inside its namespace (``os.kill(os.getpid(),
SIGTERM)`` does nothing; a real fault such as SIGSEGV still kills it).

Namespaces ("namespaces" mode; one code path, two ways to hold the privilege it needs):

* as root, the launcher unshares net, pid, mount, ipc and uts namespaces with root's own
  privileges; the program then drops to a uid/gid of its own per worker slot (owning no files);
* as any other user, the same five plus a user namespace that maps the caller's uid and gid to
  themselves (one id each, setgroups denied): the launcher holds capabilities only inside it,
  enough to mount; user.max_user_namespaces is 0 inside it, so the program cannot make a nested
  one to get capabilities back. The program keeps the caller's uid, so the filesystem is made
  read-only. (Root's programs may create user namespaces where the host lets any user do so;
  the mounts they would copy are locked read-only and cannot be unmounted.)

Either way the program sees: no network (a new network namespace has only a down loopback); only
its own processes (/proc is a new proc of its pid namespace, or an empty tmpfs where the kernel
refuses that); a root of its own (:func:`_private_root`: a tmpfs with read-only binds of
SYSTEM_PATHS, the Python installation with empty site-packages but for the packages asked for,
a minimal /dev; the host's tree detached by pivot_root), read-only except one size-limited tmpfs
holding /tmp, /var/tmp, /dev/shm and /run, whose /tmp/scratch is its working directory; no
capabilities (bounding, ambient, effective, permitted all empty) and no_new_privs, so no setuid
binary or file capability can give any back. rlimits cap CPU time, address space, file size,
open files and processes (RLIMIT_NPROC counts per user namespace, so each job has a budget of its
own; as root, per worker slot's uid); the job's memory and process count are held by a cgroup of
its own where the worker can make one (:func:`_detect_cgroups`, :func:`_make_cgroup`; the
program joins it first), else the launcher kills the job when all its processes together hold
more than memory_bytes (:class:`_JobMeter`). "weak" mode, only when asked for, skips the
namespaces: rlimits, a scratch dir under the real /tmp, a Python-level socket block, and for root
the per-slot uid.

The outcome is derived from what the launcher observes, never from what the program says. No
channel the program can reach carries one: every inherited descriptor is closed but 0
(/dev/null), 1 and 2 (output pipes, read as output only); the launcher's report pipe exists only
in the launcher and the worker, which live outside the program's pid namespace (it cannot name
them to signal, trace or kill them, and its /proc lists neither them nor their pipes) and are not
dumpable (same-uid processes cannot open their /proc/PID/fd or memory); a dead launcher is
"crashed"; no file is read back. What the launcher judges is the program's exit status against
three distinct exit codes drawn at random per job for "passed", "failed" and "crashed". The
wrapper exits with the pass code only after ``exec`` of the source returned normally;
``sys.exit``, ``os._exit``, ``exec`` of another binary, a signal or any other code is "crashed".
While the program runs the pass code is in no variable, container or attribute it could look up
(it sits on the value stack of the frame that calls ``exec``; the launcher's copy is emptied in
the program's process). What remains: code that reads its own raw memory (ctypes,
/proc/self/mem) and knows CPython's frame layout could find it; a blind guess wins with
probability 1/253. That is why code is not scored this way: a call job (:func:`_run_calls`)
only returns its function's outputs, as plain data, and "passed" there means only that the calls
returned; the caller compares the outputs, outside (mergelab/eval/scoring_code.py).

Not covered: there is no seccomp filter (kernel bugs reachable from an unprivileged process, or
from inside a user namespace, are in scope); without a cgroup the job's memory is polled every
POLL_S seconds, so it can overshoot for that long; kernel keyrings are not isolated. In weak mode, a program of a non-root
caller runs as the caller: it can read and write the caller's files, reach the network through
ctypes or a subprocess, and signal or trace the caller's other processes (the harness included).

Protocol on stdin/stdout: 4-byte big-endian length + UTF-8 JSON, one request then one reply.
Stdlib only: this file runs as a script and must not import mergelab.
"""

# Modules that test programs commonly import, loaded once here so each forked program gets them
# for free. In weak mode as root with Python installed under a folder the sandbox uid cannot
# enter, these are the only modules a program can import.
import base64  # noqa: F401
import bisect  # noqa: F401
import builtins
import collections  # noqa: F401
import copy  # noqa: F401
import ctypes
import errno
import fractions  # noqa: F401
import functools  # noqa: F401
import hashlib  # noqa: F401
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import pickle  # noqa: F401
import random
import re  # noqa: F401
import resource
import select
import selectors
import shutil
import signal
import socket  # noqa: F401 - also needed by the socket guard of the weak mode
import stat
import string  # noqa: F401
import struct
import sys
import tempfile
import time
import traceback
import typing  # noqa: F401

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.02  # how often the job's memory is measured
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
SYS_MOUNT_SETATTR = 442  # same number on every architecture (syscalls >= 424 are shared)
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
MNT_DETACH = 2
# pivot_root has no libc wrapper; its number differs between architectures.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(
    os.uname().machine, -1
)
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# The one tmpfs the program may write: /tmp itself, and these bound to directories in it, so all
# of them share one size budget and a write there never reaches the real one.
PRIVATE_DIRS = {"/var/tmp": "var-tmp", "/dev/shm": "dev-shm", "/run": "run"}
# What the new root shows of the host besides Python: the system's programs and libraries (for
# a subprocess, a shell, the dynamic loader) and the files of /etc they read.
SYSTEM_PATHS = (
    *("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"),
    *("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives"),
    *("/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/localtime"),
)
STDIO = ("stdin", "stdout", "stderr")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEV_LINKS = {"fd": "/proc/self/fd", **{n: f"/proc/self/fd/{i}" for i, n in enumerate(STDIO)}}
SCRATCH = "/tmp/scratch"
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
# Written to stderr before the failure text, so the worker can split the text off.
ERROR_MARK = b"\n\x1e[mergelab-sandbox: error]\x1e\n"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.capset.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_libc.capget.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class SetupError(Exception):
    """A step of building the sandbox failed; the job is not run (half a sandbox is no sandbox)."""

    def __init__(self, step, err):
        super().__init__(f"{step}: {os.strerror(err)}")
        self.step, self.errno = step, err


def _check(ret, step):
    if ret != 0:
        raise SetupError(step, ctypes.get_errno())


def _mount(source, target, fstype, flags, data, step):
    enc = [s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), step)


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


# ---------------------------------------------------------------------------------------------
# Launcher: namespaces and the filesystem view


def _enter_namespaces(job):
    """Unshare, map ids (non-root), build the filesystem view. Returns (scratch, isolation)."""
    root = os.geteuid() == 0
    uid, gid = os.geteuid(), os.getegid()
    sockets = _host_unix_sockets()  # read while still in the host's network namespace
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    isolation = []
    if not root:
        flags |= CLONE_NEWUSER
        # Our own /proc/self/uid_map must be ours to write (the worker is not dumpable).
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    names = ("user, " if not root else "") + "net, pid, mount, ipc, uts"
    _check(_libc.unshare(flags), f"unshare({names} namespaces)")
    if not root:
        writes = (
            ("/proc/self/setgroups", "deny"),
            ("/proc/self/uid_map", f"{uid} {uid} 1"),
            ("/proc/self/gid_map", f"{gid} {gid} 1"),
            # No user namespace inside this one: the program cannot get capabilities back, even
            # over namespaces of its own (much of the kernel's attack surface needs them).
            ("/proc/sys/user/max_user_namespaces", "0"),
        )
        for path, text in writes:
            try:
                _write_file(path, text)
            except OSError as exc:
                raise SetupError(f"write {path}", exc.errno) from None
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        isolation += ["userns", "no-nested-userns"]
    isolation += ["netns", "pidns", "mountns", "ipcns", "utsns"]
    _libc.sethostname(b"sandbox", 7)
    isolation += _build_filesystem(job, sockets)
    if root:
        os.chown(SCRATCH, job["uid"], job["gid"])
    isolation += ["private-proc", "unprivileged-uid" if root else "caller-uid"]
    return SCRATCH, isolation


def _write_file(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _build_filesystem(job, sockets):
    """Inside the new mount namespace: a new root holding only what programs need, read-only,
    then the private tmpfs."""
    _mount("none", "/", None, MS_REC | MS_PRIVATE, None, "make mounts private")
    _private_root(job.get("packages", ()), sockets)
    _make_readonly(job.get("readonly_method", "mount_setattr"))
    _private_tmp(job["tmpfs_bytes"])
    packages = job.get("packages", ())
    shown = "site-packages:" + ",".join(packages) if packages else "no-site-packages"
    tags = ["private-root", "private-home", shown]
    return tags + ["readonly-root", "private-tmp", "private-run", "host-sockets-hidden"]


def _private_root(packages, sockets):
    """Replace the root with a small tmpfs holding read-only binds of the system's programs and
    libraries (SYSTEM_PATHS), a few files of /etc, the Python installation with its
    site-packages emptied but for ``packages``, a minimal /dev and /proc; nothing else of the
    host: not the caller's working directory, home, caches, results, /work, /srv, /var, ..."""
    sources = [p for p in (*SYSTEM_PATHS, *PYTHON_DIRS) if os.path.lexists(p)]
    sources = [p for p in sources if not any(p.startswith(q + "/") for q in sources)]
    shown = [os.path.join(sp, e) for sp in SITE_DIRS for e in _package_entries(sp, packages)]
    fds = {}
    try:
        for path in [*sources, *PYTHON_ALIASES, *shown, *DEVICES, "/proc"]:  # before covering
            if not os.path.islink(path):
                fds[path] = os.open(path, os.O_PATH | (0 if path in DEVICES else os.O_NOFOLLOW))
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755", "new root")
        for path in sources:
            _place(path, fds.get(path))
        for path in PYTHON_ALIASES:  # e.g. a venv under /home when /home links to /var/home
            if _fresh("/tmp" + path):
                _place(path, fds.get(path))
        for path in SITE_DIRS:
            if os.path.isdir("/tmp" + path):
                flags, opts = MS_NOSUID | MS_NODEV, "size=1m,mode=0755"
                _mount("tmpfs", "/tmp" + path, "tmpfs", flags, opts, f"hide {path}")
        for path in shown:
            _place(path, fds[path])
        os.makedirs("/tmp/dev", mode=0o755)
        _mount("tmpfs", "/tmp/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755", "/dev")
        for path in DEVICES:
            _place(path, fds[path])
        for name, target in DEV_LINKS.items():
            os.symlink(target, "/tmp/dev/" + name)
        _place("/proc", fds["/proc"])  # the program mounts its own proc over it
        for path in ("/tmp/tmp", "/tmp/var/tmp", "/tmp/run", "/tmp/dev/shm"):
            os.makedirs(path, mode=0o755, exist_ok=True)
    finally:
        for fd in fds.values():
            os.close(fd)
    for path in sockets:  # a host socket inside a bound directory stays covered
        if os.path.exists("/tmp" + path) and not path.startswith(("/tmp/", "/run/", "/dev/")):
            _mount("/dev/null", "/tmp" + path, None, MS_BIND, None, f"cover socket {path}")
    os.chdir("/tmp")
    _check(_libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host's root")
    os.chdir("/")


def _fresh(target):
    """True when creating ``target``'s missing directories can only write to the new root's own
    tmpfs: no existing ancestor below it is a symlink or another mount (a host directory)."""
    parts = target.split("/")
    for i in range(3, len(parts)):
        ancestor = "/".join(parts[:i])
        if not os.path.lexists(ancestor):
            return True
        if os.path.islink(ancestor) or os.path.ismount(ancestor):
            return False
    return not os.path.lexists(target)


def _place(path, fd):
    """``path`` of the host at the same place under the new root (/tmp for now): a symlink
    copied, a directory or file bound (recursively) from ``fd``."""
    target = "/tmp" + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if fd is None:
        os.symlink(os.readlink(path), target)
        return
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC, None, f"bind {path}")


def _package_entries(site_dir, packages):
    """The entries of ``site_dir`` that make up the import packages ``packages``: the package
    or module itself, its compiled extension and bundled libraries, its metadata."""
    try:
        entries = os.listdir(site_dir)
    except OSError:
        return []
    out = []
    for e in entries:
        for name in packages:
            if (
                e == name
                or e.startswith(name + ".")
                or (e.startswith(name + "-") and e.endswith((".dist-info", ".egg-info")))
            ):
                out.append(e)
    return sorted(set(out))


def _host_unix_sockets():
    """Paths of the host's bound Unix sockets (abstract ones are per network namespace)."""
    try:
        with open("/proc/net/unix") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    fields = (line.split(None, 7) for line in lines)
    return sorted({f[7] for f in fields if len(f) == 8 and f[7].startswith("/")})


def _make_readonly(method):
    """Every mount in our namespace read-only (the private tmpfs is mounted afterwards)."""
    if method == "mount_setattr":
        attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, 0, 0)
        ret = _libc.syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            ctypes.c_int(AT_FDCWD),
            ctypes.c_char_p(b"/"),
            ctypes.c_uint(AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        )
        if ret == 0:
            return
        err = ctypes.get_errno()
        if err != errno.ENOSYS:  # kernels before 5.12 lack it: remount one by one instead
            raise SetupError("mount_setattr(/, read-only, recursive)", err)
    _remount_each_readonly()


def _remount_each_readonly():
    # A remount inside a user namespace must restate the flags the mount was locked with.
    keep = {
        os.ST_NOSUID: MS_NOSUID,
        os.ST_NODEV: MS_NODEV,
        os.ST_NOEXEC: MS_NOEXEC,
        os.ST_NOATIME: MS_NOATIME,
        os.ST_NODIRATIME: MS_NODIRATIME,
        os.ST_RELATIME: MS_RELATIME,
    }
    with open("/proc/self/mountinfo") as f:
        points = [_unescape(line.split()[4]) for line in f]
    for point in sorted(set(points), key=len):
        try:
            st_flags = os.statvfs(point).f_flag
        except OSError:
            continue  # covered by a later mount
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(ms for st, ms in keep.items() if st_flags & st)
        _mount(None, point, None, flags, None, f"remount {point} read-only")


def _unescape(field):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _private_tmp(size):
    # A Python installation inside one of the dirs about to be replaced (a virtual environment
    # in /tmp, say) is bound back at its own path, read-only like the rest of the tree.
    covered = ["/tmp", *PRIVATE_DIRS]
    keep = [
        p
        for p in (*PYTHON_DIRS, *PYTHON_ALIASES)
        if os.path.isdir(p) and any(p == d or p.startswith(d + "/") for d in covered)
    ]
    fds = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in keep]  # before covering
    opts = f"size={int(size)},mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts, "tmpfs on /tmp")
    for target, name in PRIVATE_DIRS.items():
        if os.path.isdir(target) and not os.path.islink(target):
            src = f"/tmp/.sandbox/{name}"
            os.makedirs(src)
            os.chmod(src, 0o1777)
            _mount(src, target, None, MS_BIND, None, f"private {target}")
            if target == "/run":
                os.mkdir("/run/lock")
                os.chmod("/run/lock", 0o1777)
    os.mkdir(SCRATCH, 0o700)
    for path, fd in zip(keep, fds):
        os.makedirs(path, mode=0o755, exist_ok=True)
        # A bind of a read-only mount is read-only too: the installation stays unwritable.
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None, f"bind {path}")
        os.close(fd)


def _weak_setup(job):
    scratch = tempfile.mkdtemp(prefix="mergelab-sandbox-")
    isolation = ["weak", "socket-guard"]
    if os.geteuid() == 0:
        os.chown(scratch, job["uid"], job["gid"])
        isolation.append("unprivileged-uid")
    else:
        isolation.append("caller-uid")
    return scratch, isolation


def _site_dirs():
    """The directories of third-party packages (site- and dist-packages) of this Python."""
    import site
    import sysconfig

    dirs = {*site.getsitepackages(), *(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))}
    dirs |= {p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")}
    dirs = {d for d in dirs if os.path.isdir(d)}
    return sorted({os.path.realpath(d) for d in dirs} | {os.path.abspath(d) for d in dirs})


def _python_dirs():
    """The Python installation the programs run on: prefix, base prefix, exec prefix (real
    paths, none inside another)."""
    dirs = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    return [p for p in dirs if not any(p.startswith(q + "/") for q in dirs)]


def _python_aliases(real_dirs):
    """The installation's paths as Python names them where they differ from the real ones (a
    symlink on the way): bound there too, so that sys.path and sys.executable resolve."""
    named = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    named.add(os.path.dirname(os.path.abspath(sys.executable)))
    inside = [*real_dirs, *SYSTEM_PATHS]
    return sorted(p for p in named if not any(p == q or p.startswith(q + "/") for q in inside))


# ---------------------------------------------------------------------------------------------
# Program process


def _program(job, scratch, w_out, w_err, w_res, codes, isolation):
    """Set up the process, run the source, exit with the code for what happened. Never returns.

    ``codes`` is the launcher's [passed, failed, crashed] list: emptied here first, so that the
    pass code is not left in a frame the program can walk to (the launcher's). In a call job
    "passed" only means that every call returned: what counts is the outputs (see
    :func:`_run_calls`), judged by the trusted caller."""
    failed, crashed = codes[1], codes[2]
    pending = [codes[0]]
    codes.clear()
    try:
        _enter_program_sandbox(job, scratch, w_out, w_err, w_res, isolation)
    except BaseException as exc:  # noqa: BLE001 - never run the program in half a sandbox
        _exit_with(crashed, f"sandbox set-up failed: {exc!r}")
    try:
        code = compile(job["program"], "program.py", "exec")
    except BaseException as exc:  # noqa: BLE001 - a SyntaxError is the program's crash
        _exit_with(crashed, _short_traceback(exc))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        _exec_to_end(code, namespace, pending, job.get("calls"))
    except AssertionError as exc:
        _exit_with(failed, _short_traceback(exc))
    except SystemExit as exc:
        _exit_with(crashed, f"program called exit({exc.code!r}) before finishing")
    except BaseException as exc:  # noqa: BLE001 - the whole point is to catch everything
        _exit_with(crashed, _short_traceback(exc))
    _exit_with(crashed, "sandbox error: program neither finished nor raised")


def _exec_to_end(code, namespace, pending, calls):
    # The pass code leaves `pending` for this frame's value stack before the program starts;
    # while it runs, no name, container or attribute reachable from Python holds it.
    _ran_to_end(pending.pop(), exec(code, namespace), calls and _run_calls(namespace, calls))


def _ran_to_end(pass_code, *_):
    _flush_stdio()
    os._exit(pass_code)


def _run_calls(namespace, calls):
    """A call job: call the program's ``entry_point`` on each input (fresh objects decoded from
    plain data each time) and write one line per call to the outputs pipe: {"value": plain
    data}, {"raised": exception type name, "message": text} or {"invalid": why the value is
    not plain data}. Nothing here judges anything: the outputs are compared with the expected
    ones by the trusted caller, which never sends them here."""
    fn = namespace.get(calls["entry_point"])
    if not callable(fn):
        raise NameError(f"the program does not define {calls['entry_point']!r}")
    for line in calls["inputs"]:
        args, kwargs = PLAIN.loads(line)
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an exception is an output like any other
            record = {"raised": _safe_text(_type_name, exc), "message": _safe_text(str, exc)}
        else:
            try:
                record = {"value": PLAIN.encode(value)}
            except PLAIN.NotPlainData as exc:
                record = {"invalid": str(exc)}
            except RecursionError:
                record = {"invalid": "nested too deep"}
        _write_all(RESULTS_FD, (json.dumps(record, allow_nan=False) + "\n").encode())
    return True


def _type_name(obj):
    return type(obj).__name__


def _safe_text(make, obj, limit=300):
    try:
        text = make(obj)
        return text[:limit] if type(text) is str else "(not text)"
    except BaseException:  # noqa: BLE001 - a hostile __str__
        return "(unprintable)"


def _exit_with(code, text):
    try:
        _flush_stdio()
        _write_all(2, ERROR_MARK + text.encode("utf-8", "replace"))
    except BaseException:  # noqa: BLE001 - the exit code is what counts
        pass
    finally:
        os._exit(code)


def _flush_stdio():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass


def _enter_program_sandbox(job, scratch, w_out, w_err, w_res, isolation):
    # Descriptors first, so that whatever fails below is reported on stderr: 0 = /dev/null,
    # 1/2 = the output pipes, 3 = the outputs pipe of a call job, nothing else (the launcher's
    # report pipe above all).
    for fd in job.get("cgroup", {}).get("procs", ()):
        os.write(fd, b"0")  # join the job's cgroups ("0": this process), before anything runs
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(w_out, 1)
    os.dup2(w_err, 2)
    if w_res is not None:
        os.dup2(w_res, RESULTS_FD)
    os.closerange(3 if w_res is None else RESULTS_FD + 1, 2**31 - 1)
    if "pidns" in isolation:
        _mount_private_proc()
    os.chdir(scratch)
    os.setpgid(0, 0)  # own process group, so the weak mode can kill it as a whole
    cpu = max(1, int(job["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    _limit(resource.RLIMIT_AS, job["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, job["max_file_bytes"])
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NOFILE, 256)
    _drop_privileges(job, weak="weak" in isolation)
    if "weak" in isolation and "caller-uid" in isolation:
        # RLIMIT_NPROC counts every process of the uid: leave room for the caller's own.
        _limit(resource.RLIMIT_NPROC, _tasks_of(os.getuid()) + job["max_processes"])
    else:
        # With a user namespace, the count is per namespace: this job's processes only.
        _limit(resource.RLIMIT_NPROC, job["max_processes"])
    _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self files, as usual
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # last: credential changes clear it
    os.environ.clear()
    os.environ.update({"PATH": CLEAN_PATH, "HOME": scratch, "LANG": "C.UTF-8"})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "socket-guard" in isolation:
        _block_sockets()
    sys.argv = ["program.py"]
    sys.stdin = os.fdopen(0, "r", closefd=False)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _mount_private_proc():
    """A /proc of the program's own pid namespace: host processes are not even listed. Where
    the kernel refuses a new proc (e.g. a container that masks parts of the host's), an empty
    read-only tmpfs hides the host's /proc instead."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0:
        _mount("tmpfs", "/proc", "tmpfs", flags | MS_RDONLY, "size=4k,mode=0555", "hide /proc")


def _drop_privileges(job, weak):
    """No capabilities in any set, and for root a uid/gid of the worker slot's own."""
    for cap in range(CAP_LAST + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and not weak:
            raise SetupError(f"drop capability {cap} from the bounding set", ctypes.get_errno())
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(job["gid"])
        os.setuid(job["uid"])
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset(0)")
    _check(_libc.capget(ctypes.byref(header), ctypes.byref(data)), "capget")
    if any(data):
        raise SetupError("capabilities still held", errno.EPERM)


def _limit(res, value):
    value = int(value)
    resource.setrlimit(res, (value, value))


def _tasks_of(uid):
    n = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _short_traceback(exc, limit=4000):
    """The traceback from the program's frames on (this file's frames are skipped)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return text[-limit:]


def _block_sockets():
    """Weak mode only: no socket from the socket module (ctypes and subprocesses still can)."""

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    socket.socket = refuse
    socket.create_connection = refuse
    socket.socketpair = refuse


# ---------------------------------------------------------------------------------------------
# Launcher: fork, wait, judge


def _exit_codes(job):
    """[passed, failed, crashed]: distinct, random per job, never 0, 1 or 2."""
    fixed = job.pop("exit_codes", None)  # tests only
    return list(fixed) if fixed else random.SystemRandom().sample(range(3, 256), 3)


def _launcher(job, w_out, w_err, w_res):
    """Enter the sandbox, run the program in it, judge how it ended. Returns the report."""
    os.setsid()
    codes = _exit_codes(job)
    if job["mode"] == "weak":
        scratch, isolation = _weak_setup(job)
    else:
        scratch, isolation = _enter_namespaces(job)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after the credential change
    isolation += ["no-capabilities", "no-new-privs", "closed-fds", "rlimits"]
    meter = None
    if job["memory_mode"] == "cgroup":
        meter = _CgroupWatch(job)
        isolation += ["job-memory-cgroup", "job-pids-cgroup"]
    elif job["memory_mode"] == "polled":
        # Orphans of the job become our children, so "our descendants" is the whole job.
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "become a child subreaper")
        meter = _JobMeter(job, private_tmp="weak" not in isolation)
        isolation.append("job-memory-polled")
    else:
        isolation.append("per-process-memory")
    child = os.fork()
    if child == 0:
        try:
            _program(job, scratch, w_out, w_err, w_res, codes, isolation)
        finally:
            os._exit(1)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # nobody of our uid may read our memory or fds
    for fd in (w_out, w_err, w_res):
        if fd is not None:
            os.close(fd)
    status, rusage, timed_out, held = _wait(child, job["timeout_s"], "weak" in isolation, meter)
    if "weak" in isolation:
        if os.geteuid() == 0:
            _kill_uid(job["uid"])
        shutil.rmtree(scratch, ignore_errors=True)
    if held is not None:
        mib = job["memory_bytes"] / 2**20
        error = (
            f"the job held {held / 2**20:.0f} MiB, over its memory limit of {mib:.0f} MiB (all "
            "its processes together, memfd, SysV and /tmp or /dev/shm memory included)"
        )
        if job["memory_mode"] == "cgroup":
            error = (
                f"the kernel stopped the job at its memory limit of {mib:.0f} MiB (its cgroup: "
                "all its processes together, memfd, SysV and /tmp or /dev/shm memory included)"
            )
        report = {"status": "crashed", "error": error, "exit_code": None, "signal": signal.SIGKILL}
        return {**report, "isolation": isolation}
    return {**_judge(status, rusage, timed_out, codes, job), "isolation": isolation}


def _wait(child, timeout_s, killpg, meter):
    """Wait for the program, killing it at the wall-clock limit, or when ``meter`` finds the
    job over its memory limit. Returns status, rusage, timed out, and the bytes held when the
    job was killed for memory (else None). A pidfd, so a kill can never hit a recycled pid."""
    pidfd = os.pidfd_open(child)
    held = None
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            step = remaining if meter is None else min(remaining, POLL_S)
            ready, _, _ = select.select([pidfd], [], [], max(0.0, step))
            timed_out = not ready and remaining <= step
            if ready or timed_out:
                break
            held = meter.over()
            if held is not None:
                break
        if timed_out or held is not None:
            # In a pid namespace, killing its pid 1 kills every process in it.
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            if meter is not None and killpg:
                meter.kill_all()
        if killpg:
            # Exited but not reaped yet: its process group id cannot be recycled.
            os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
            try:
                os.killpg(child, signal.SIGKILL)
            except OSError:
                pass
        _, status, rusage = os.wait4(child, 0)
    finally:
        os.close(pidfd)
    if held is None and isinstance(meter, _CgroupWatch):
        held = meter.over()  # the kernel's kill may have ended the program between two looks
    return status, rusage, timed_out, held


class _CgroupWatch:
    """The job's cgroup, as the launcher sees it (through a descriptor the worker opened: the
    launcher's own root no longer shows /sys): the kernel holds the job to its memory limit;
    this says when the kernel had to kill one of its processes for it, so that the launcher
    ends the rest of the job too."""

    def __init__(self, job):
        self.made = job["cgroup"]
        self.limit = int(job["memory_bytes"])

    def over(self):
        text = _read_fd(self.made["events_fd"])
        key = self.made["events"][1]
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit() and int(value) > 0:
                return self.limit
        return None

    def kill_all(self):
        pass  # the worker kills what is left in the cgroup when it removes it


class _JobMeter:
    """The memory a job holds, all its processes together, polled every POLL_S seconds by the
    launcher (where no cgroup can be made for the job): each process's proportional set size
    (shared pages split between their users), plus memfd files (open, or only mapped: then as
    much as RLIMIT_FSIZE lets one file hold, where the kernel will not say), plus, in the
    namespaces mode, the job's SysV shared memory and its private tmpfs (/tmp, /dev/shm). The
    job's processes are the launcher's descendants (the launcher is their child subreaper).
    Between two polls a program can allocate past the limit for up to POLL_S seconds."""

    def __init__(self, job, private_tmp):
        self.limit = int(job["memory_bytes"])
        self.file_cap = int(job["max_file_bytes"])
        self.private_tmp = private_tmp
        self.root = os.getpid()
        try:  # the host's /proc, kept before the program mounts its own over /proc
            self.proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._read(f"{self.root}/task/{self.root}/children")
            self._read("self/statm")
        except OSError as exc:
            raise SetupError("read /proc to account the job's memory", exc.errno) from None

    def _read(self, path):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.proc)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks).decode("ascii", "replace")
        finally:
            os.close(fd)

    def _listdir(self, path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.proc)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def pids(self):
        found, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            try:
                for tid in self._listdir(f"{pid}/task"):
                    kids = [int(k) for k in self._read(f"{pid}/task/{tid}/children").split()]
                    found += kids
                    todo += kids
            except OSError:
                continue  # gone meanwhile
        return found

    def over(self):
        used = self.held()
        return used if used > self.limit else None

    def held(self):
        total, files = 0, {}
        for pid in self.pids():
            total += self._resident(pid)
            self._memfds(pid, files)
        total += sum(files.values())
        if self.private_tmp:
            total += self._sysv_shm() + self._tmpfs()
        return total

    def _resident(self, pid):
        try:
            for line in self._read(f"{pid}/smaps_rollup").splitlines():
                if line.startswith(("Pss:", "SwapPss:")):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:  # no smaps_rollup (kernels before 4.14): resident set size
            return int(self._read(f"{pid}/statm").split()[1]) * PAGE_SIZE
        except (OSError, IndexError, ValueError):
            return 0

    def _memfds(self, pid, files):
        try:
            for n in self._listdir(f"{pid}/fd"):
                try:
                    if os.readlink(f"{pid}/fd/{n}", dir_fd=self.proc).startswith("/memfd:"):
                        st = os.stat(f"{pid}/fd/{n}", dir_fd=self.proc)
                        files[st.st_ino] = st.st_blocks * 512
                except OSError:
                    continue
            maps = self._read(f"{pid}/maps")
        except OSError:
            return
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) < 6 or not fields[5].startswith("/memfd:"):
                continue
            ino = int(fields[4])
            if ino in files:
                continue
            try:  # needs CAP_SYS_ADMIN (root's launcher)
                files[ino] = (
                    os.stat(f"{pid}/map_files/{fields[0]}", dir_fd=self.proc).st_blocks * 512
                )
            except OSError:
                files[ino] = self.file_cap  # the most one file may hold (RLIMIT_FSIZE)

    def _sysv_shm(self):
        try:  # the launcher's IPC namespace: the job's
            rows = [r.split() for r in self._read("sysvipc/shm").splitlines()[1:]]
        except OSError:
            return 0
        return sum(int(r[14]) + int(r[15]) if len(r) >= 16 else int(r[3]) for r in rows)

    def _tmpfs(self):
        st = os.statvfs("/tmp")
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def kill_all(self):
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# Cgroups: a hard limit on the job's memory and process count, where one can be made


CGROUP_PREFIX = "mergelab-sandbox-"
CGROUPS = None  # what _detect_cgroups found, once per worker (main)


def _cgroup_dirs():
    """This process's cgroup directories: {"v2": dir} and/or {"memory": dir, "pids": dir} (v1),
    from /proc/self/cgroup and the cgroup mounts of /proc/self/mountinfo."""
    mounts = {}  # controller ("v2" for the unified tree) -> (mount root, mount point)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(fields) < 5 or len(rfields) < 3:
                continue
            root, point = _unescape(fields[3]), _unescape(fields[4])
            if rfields[0] == "cgroup2":
                mounts.setdefault("v2", (root, point))
            elif rfields[0] == "cgroup":
                for option in rfields[2].split(","):
                    if option in ("memory", "pids"):
                        mounts.setdefault(option, (root, point))
    dirs = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            names = ["v2"] if controllers == "" else controllers.split(",")
            for name in names:
                if name not in mounts:
                    continue
                root, point = mounts[name]
                if path == root or path.startswith(root.rstrip("/") + "/") or root == "/":
                    rel = path[len(root) :] if root != "/" else path
                    dirs[name] = os.path.normpath(os.path.join(point, rel.lstrip("/")))
    return dirs


def _detect_cgroups():
    """Where this worker can make a cgroup per job, tried once: the unified hierarchy (v2) with
    the memory and pids controllers enabled for children, else the v1 memory and pids
    hierarchies. Returns {"version": 2 | 1, "parents": {controller: dir}, "swap": how swap is
    limited} or {"version": None, "why": the reason none can be made}."""
    try:
        dirs = _cgroup_dirs()
    except OSError as exc:
        return {"version": None, "why": f"cannot read this process's cgroups: {exc.strerror}"}
    reasons = []
    if "v2" in dirs:
        found = _try_cgroup({"v2": dirs["v2"]}, 2, reasons)
        if found:
            return found
    if "memory" in dirs and "pids" in dirs:
        found = _try_cgroup({"memory": dirs["memory"], "pids": dirs["pids"]}, 1, reasons)
        if found:
            return found
    elif "memory" not in dirs or "pids" not in dirs:
        missing = [c for c in ("memory", "pids") if c not in dirs]
        reasons.append(f"cgroup v1: no {' or '.join(missing)} hierarchy mounted")
    return {"version": None, "why": "; ".join(reasons) or "no cgroup hierarchy mounted"}


def _try_cgroup(parents, version, reasons):
    """Make a trial cgroup under ``parents`` with limits set, then remove it."""
    if version == 2:
        parent = parents["v2"]
        try:
            enabled = set(_read_text(os.path.join(parent, "cgroup.subtree_control")).split())
            if not {"memory", "pids"} <= enabled:
                available = set(_read_text(os.path.join(parent, "cgroup.controllers")).split())
                if not {"memory", "pids"} <= available:
                    lacking = " and ".join(sorted({"memory", "pids"} - available))
                    reasons.append(f"cgroup v2 ({parent}): no {lacking} controller delegated")
                    return None
                _write_text(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        except OSError as exc:
            reasons.append(f"cgroup v2 ({parent}): cannot enable memory and pids: {exc.strerror}")
            return None
    _sweep_stale(parents)
    found = {"version": version, "parents": parents, "swap": "none"}
    try:
        made = _make_cgroup(found, f"{CGROUP_PREFIX}{os.getpid()}-probe", 64 << 20, 8)
    except OSError as exc:
        where = ", ".join(parents.values())
        reasons.append(f"cgroup v{version} ({where}): cannot make a cgroup: {exc.strerror}")
        return None
    found["swap"] = made["swap"]
    _remove_cgroup(made)
    if made["swap"] == "unlimited":
        reasons.append(f"cgroup v{version}: swap is on and cannot be limited (no memsw accounting)")
        return None
    return found


def _read_text(path):
    with open(path) as f:
        return f.read()


def _write_text(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _swap_on():
    try:
        return len(_read_text("/proc/swaps").splitlines()) > 1
    except OSError:
        return False


def _make_cgroup(cgroups, name, memory_bytes, max_processes):
    """A cgroup for one job, limits set: {"dirs": [...], "procs": [fds], "events": fd, ...}.
    Removed again if any step fails."""
    made = {"version": cgroups["version"], "dirs": [], "procs": [], "swap": "none"}
    try:
        for controller, parent in cgroups["parents"].items():
            path = os.path.join(parent, name)
            if path not in made["dirs"]:  # v1 memory and pids may share one hierarchy
                os.mkdir(path, 0o755)
                made["dirs"].append(path)
                made["procs"].append(os.open(f"{path}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
            if controller == "v2":
                _write_text(f"{path}/memory.max", str(int(memory_bytes)))
                if os.path.exists(f"{path}/memory.swap.max"):
                    _write_text(f"{path}/memory.swap.max", "0")
                    made["swap"] = "limited"
                elif _swap_on():
                    made["swap"] = "unlimited"
                _write_text(f"{path}/memory.oom.group", "1")  # an OOM kill takes the whole job
                _write_text(f"{path}/pids.max", str(int(max_processes)))
                made["events"] = (f"{path}/memory.events", "oom_kill")
                made["peak"] = f"{path}/memory.peak"  # kernels 5.19 and later
            elif controller == "memory":
                _write_text(f"{path}/memory.limit_in_bytes", str(int(memory_bytes)))
                if os.path.exists(f"{path}/memory.memsw.limit_in_bytes"):
                    _write_text(f"{path}/memory.memsw.limit_in_bytes", str(int(memory_bytes)))
                    made["swap"] = "limited"
                elif _swap_on():
                    made["swap"] = "unlimited"
                made["events"] = (f"{path}/memory.oom_control", "oom_kill")
                made["peak"] = f"{path}/memory.max_usage_in_bytes"
            else:
                _write_text(f"{path}/pids.max", str(int(max_processes)))
        return made
    except OSError:
        _remove_cgroup(made)
        raise


def _read_fd(fd):
    """A cgroup file, read again from its start ("" when it cannot be)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 65536).decode("ascii", "replace")
    except OSError:
        return ""


def _remove_cgroup(made, wait_s=5.0):
    """Kill whatever is left in the job's cgroups (weak mode has no pid namespace to end it)
    and remove them. Returns the directories that could not be removed."""
    for fd in made["procs"]:
        os.close(fd)
    made["procs"] = []
    deadline = time.monotonic() + wait_s
    left = list(made["dirs"])
    while left:
        for path in list(left):
            try:
                for pid in _read_text(f"{path}/cgroup.procs").split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                os.rmdir(path)
                left.remove(path)
            except FileNotFoundError:
                left.remove(path)
            except OSError:
                pass  # exiting processes still in it: again shortly
        if left and time.monotonic() > deadline:
            break
        if left:
            time.sleep(0.01)
    made["dirs"] = left
    return left


def _sweep_stale(parents):
    """Remove the empty cgroups of sandbox workers that died in the middle of a job."""
    for parent in parents.values():
        try:
            names = [n for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            continue
        for name in names:
            pid = name[len(CGROUP_PREFIX) :].split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


def _describe_cgroups():
    """What the Sandbox says about the memory limit: the cgroup version and where, or why
    none."""
    if CGROUPS and CGROUPS["version"]:
        return {"version": CGROUPS["version"], "parents": CGROUPS["parents"]}
    return {"version": None, "why": (CGROUPS or {}).get("why", "not detected")}


def _memory_mode(job):
    """ "cgroup", "polled" or "process" for this job, from its memory_limit and what the worker
    found: "job" takes a cgroup where one can be made, else polls."""
    asked = job.get("memory_limit", "job")
    if asked == "job":
        return "cgroup" if CGROUPS and CGROUPS["version"] else "polled"
    if asked == "cgroup" and not (CGROUPS and CGROUPS["version"]):
        why = (CGROUPS or {}).get("why", "not detected")
        raise SetupError(f"make a cgroup for the job's memory ({why})", errno.EPERM)
    return asked


def _judge(status, rusage, timed_out, codes, job):
    passed, failed, crashed = codes
    report = {"exit_code": None, "signal": None, "error": None}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit_code"] = os.WEXITSTATUS(status)
    if timed_out:
        return {**report, "status": "timed_out", "error": f"wall-clock limit {job['timeout_s']} s"}
    cpu = rusage.ru_utime + rusage.ru_stime
    sig = report["signal"]
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= job["cpu_s"] - 0.05):
        return {**report, "status": "timed_out", "error": f"CPU-time limit {job['cpu_s']} s"}
    if sig is not None:
        return {**report, "status": "crashed", "error": f"killed by {signal.Signals(sig).name}"}
    code = report["exit_code"]
    if code == passed:
        return {**report, "status": "passed", "error": ""}
    if code in (failed, crashed):  # the text is on stderr, after ERROR_MARK
        return {**report, "status": "failed" if code == failed else "crashed"}
    return {
        **report,
        "status": "crashed",
        "error": f"exited early with code {code} (os._exit or exec) before the program finished",
    }


def _kill_uid(uid):
    """Weak mode as root: kill every process left running under the slot's uid."""
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


# ---------------------------------------------------------------------------------------------
# Worker: one job


def _run_job(job):
    """Make the job's cgroup (where it has one), run the job, remove the cgroup."""
    try:
        job["memory_mode"] = _memory_mode(job)
        if job["memory_mode"] == "cgroup":
            name = f"{CGROUP_PREFIX}{os.getpid()}-{next(_JOB_NUMBERS)}"
            try:
                made = _make_cgroup(CGROUPS, name, job["memory_bytes"], job["max_processes"])
            except OSError as exc:
                raise SetupError("make the job's cgroup", exc.errno) from None
            job["cgroup"] = made
    except SetupError as exc:
        text = os.strerror(exc.errno)
        return {
            "status": "crashed",
            "error": f"sandbox set-up failed: {exc.step}: {text}",
            "setup_error": {"step": exc.step, "errno": exc.errno, "strerror": text},
            "stdout": "",
            "stderr": "",
            "seconds": 0.0,
            "exit_signal": None,
            "isolation": [],
        }
    made = job.get("cgroup")
    if made is None:
        return _run_launcher(job)
    made["events_fd"] = os.open(made["events"][0], os.O_RDONLY | os.O_CLOEXEC)
    try:
        made["peak_fd"] = os.open(made.get("peak", "/nonexistent"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        made["peak_fd"] = None
    try:
        reply = _run_launcher(job)
        peak = _read_fd(made["peak_fd"]) if made["peak_fd"] is not None else ""
        if peak.strip().isdigit():
            reply["memory_peak_bytes"] = int(peak)  # the most the job held at once
    finally:
        os.close(made["events_fd"])
        if made["peak_fd"] is not None:
            os.close(made["peak_fd"])
        left = _remove_cgroup(made)
    if left:  # never leave one behind silently
        reply["cgroup_left"] = left
    return reply


def _run_launcher(job):
    t0 = time.monotonic()
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    r_rep, w_rep = os.pipe()  # the launcher's report: never open in the program
    r_res, w_res = os.pipe() if "calls" in job else (None, None)  # a call job's outputs
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (r_out, r_err, r_rep, r_res, PROTOCOL_FDS[0], PROTOCOL_FDS[1]):
                if fd is not None:
                    os.close(fd)
            try:
                report = _launcher(job, w_out, w_err, w_res)
            except SetupError as exc:
                report = {"setup_error": {"step": exc.step, "errno": exc.errno}}
            _write_all(w_rep, json.dumps(report).encode())
        except BaseException:  # noqa: BLE001
            try:
                _write_all(w_rep, json.dumps({"launcher_error": traceback.format_exc()}).encode())
            finally:
                os._exit(70)
        os._exit(0)
    for fd in (w_out, w_err, w_rep, w_res):
        if fd is not None:
            os.close(fd)
    pidfd = os.pidfd_open(pid)
    streams = {
        r_out: _Capture(job["max_output_bytes"]),
        r_err: _Capture(job["max_output_bytes"]),
        r_rep: _Capture(1 << 20),
    }
    if r_res is not None:
        streams[r_res] = _Capture(job["max_result_bytes"])
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    # Backstop only: the launcher enforces the wall clock itself.
    deadline = t0 + job["timeout_s"] + 10.0
    backstop_kill = False
    exited = False
    while not exited:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            backstop_kill = True
            break
        for key, _ in sel.select(timeout=remaining):
            if key.fd == pidfd:
                exited = True
            else:
                streams[key.fd].drain(key.fd, sel)
    os.waitpid(pid, 0)
    os.close(pidfd)
    # Anything still buffered in the pipes (writers are all dead now, or orphaned and killed).
    for fd, capture in streams.items():
        try:
            capture.drain(fd, sel, until_empty=True)
        except OSError:
            pass
        os.close(fd)
    sel.close()
    seconds = time.monotonic() - t0
    reply = _reply(streams[r_rep], streams[r_out], streams[r_err], backstop_kill, seconds)
    if r_res is not None:
        res = streams[r_res]
        reply["outputs"] = bytes(res.head).decode("utf-8", "replace")
        reply["outputs_truncated"] = res.total > res.limit
    return reply


class _Capture:
    """The first ``limit`` bytes of a stream, and its last few KiB (where the error text is)."""

    TAIL = 16 << 10

    def __init__(self, limit):
        self.limit, self.total = limit, 0
        self.head, self.tail = bytearray(), bytearray()

    def drain(self, fd, sel, until_empty=False):
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
            self.total += len(chunk)
            room = self.limit - len(self.head)
            if room > 0:
                self.head += chunk[:room]
            self.tail = (self.tail + chunk)[-self.TAIL :]
            if not until_empty:
                return

    def split_error(self):
        """(the stream before the last ERROR_MARK, the error text after it)."""
        complete = self.total <= self.limit
        end = (self.head if complete else self.tail).rfind(ERROR_MARK)
        error = b""
        if end >= 0:
            error = bytes((self.head if complete else self.tail)[end + len(ERROR_MARK) :])
        cut = self.head.rfind(ERROR_MARK)
        return bytes(self.head[:cut] if cut >= 0 else self.head), error


def _reply(rep, out, err, backstop_kill, seconds):
    stderr, error_text = err.split_error()
    result = {
        "stdout": bytes(out.head).decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "seconds": seconds,
        "exit_signal": None,
        "isolation": [],
    }
    try:
        report = json.loads(bytes(rep.head).decode("utf-8"))
    except ValueError:
        report = None
    if not isinstance(report, dict) or "launcher_error" in report:
        if backstop_kill:
            return {**result, "status": "timed_out", "error": "killed by the worker's backstop"}
        detail = report["launcher_error"] if isinstance(report, dict) else "launcher died"
        return {**result, "status": "crashed", "error": f"sandbox failure: {detail}"}
    if "setup_error" in report:
        step, err_no = report["setup_error"]["step"], report["setup_error"]["errno"]
        return {
            **result,
            "status": "crashed",
            "error": f"sandbox set-up failed: {step}: {os.strerror(err_no)}",
            "setup_error": {**report["setup_error"], "strerror": os.strerror(err_no)},
        }
    result["isolation"] = report["isolation"]
    result["exit_signal"] = report["signal"]
    error = report["error"]
    if error is None:
        error = error_text.decode("utf-8", "replace") or "(no error text)"
    return {**result, "status": report["status"], "error": error}


CAP_LAST, PYTHON_DIRS, PYTHON_ALIASES, SITE_DIRS = 40, [], [], []
_JOB_NUMBERS = itertools.count()
PROTOCOL_FDS = (0, 1)
RESULTS_FD = 3


def _load_plain_data():
    """mergelab/eval/plain_data.py, the codec shared with the trusted side (stdlib only)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plain_data.py")
    spec = importlib.util.spec_from_file_location("_mergelab_plain_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAIN = _load_plain_data()


def main():
    global CAP_LAST, CGROUPS, PROTOCOL_FDS, PYTHON_DIRS, PYTHON_ALIASES, SITE_DIRS
    # Programs (and in weak mode, other processes of our uid) may not read our memory or fds.
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    PYTHON_DIRS, SITE_DIRS = _python_dirs(), _site_dirs()
    PYTHON_ALIASES = _python_aliases(PYTHON_DIRS)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        CAP_LAST = int(f.read())
    CGROUPS = _detect_cgroups()
    # Keep the protocol pipes off fds 0/1 so nothing a program does can write into them.
    PROTOCOL_FDS = proto_in, proto_out = os.dup(0), os.dup(1)
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
            reply = {"cgroups": _describe_cgroups()} if job.get("describe") else _run_job(job)
        except Exception:  # noqa: BLE001 - never let one job take the worker down
            reply = {"status": "crashed", "error": "worker error: " + traceback.format_exc()}
        data = json.dumps(reply).encode("utf-8")
        _write_all(proto_out, struct.pack(">I", len(data)) + data)


if __name__ == "__main__":
    main()
