"""Run Python code as an unprivileged user, for the tests and the benchmark that show what a
non-root user of the sandbox gets. Stdlib only; not a test module.

    proc = run_python(code, user="unprivileged", stdin="...", binds={host_dir: "/srv"})

As root (CI runs as root, in a clone at any path): a child enters a private mount namespace,
applies ``binds`` (host directory -> existing directory, writable), makes the Python installation
and this repository reachable for uid/gid 65534 (each ancestor that uid cannot enter is covered
with a tmpfs holding read-only binds of what is needed, as the sandbox does for its programs),
drops to 65534 and execs Python running ``code``. Nothing outside the child's mount namespace
changes: no chmod, no files. ``user="root"`` does the same without dropping, so both variants of
a test see the same filesystem. ``block_userns=True`` additionally runs ``code`` in a user
namespace whose user.max_user_namespaces is 0: a machine where user namespaces are refused.

When the tests already run as a non-root user, "unprivileged" runs Python as that user and "root"
is unavailable (:func:`available` says why).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

UID = GID = 65534
REPO = Path(__file__).resolve().parents[1]
SANDBOX_PY = REPO / "mergelab" / "eval" / "sandbox.py"

CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18

# Loads mergelab/eval/sandbox.py by path: importing the package would import torch (seconds).
IMPORT_SANDBOX = f"""
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("mergelab_sandbox", {str(SANDBOX_PY)!r})
sandbox = importlib.util.module_from_spec(_spec)
sys.modules["mergelab_sandbox"] = sandbox
_spec.loader.exec_module(sandbox)
"""


def available(user: str) -> str | None:
    """None when ``user`` ("root" | "unprivileged") can be run, else the reason it cannot."""
    if user == "root" and os.geteuid() != 0:
        return "the tests run as a non-root user"
    if os.geteuid() != 0:
        return None
    probe = run_python("print('ok')", user=user, timeout=60)
    if probe.returncode != 0 or probe.stdout.strip() != "ok":
        return f"cannot set up a private mount namespace as root: {probe.stderr.strip()[-300:]}"
    return None


def run_python(
    code: str,
    *,
    user: str,
    stdin: str = "",
    env: dict[str, str] | None = None,
    binds: dict[str, str] | None = None,
    block_userns: bool = False,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run ``python -c code`` as ``user`` ("root" | "unprivileged"); text in, text out."""
    if user not in ("root", "unprivileged"):
        raise ValueError(f"user must be 'root' or 'unprivileged', got {user!r}")
    config = {"user": user, "binds": binds or {}, "block_userns": block_userns}
    base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(
        [sys.executable, "-I", __file__, json.dumps(config), code],
        input=stdin,
        capture_output=True,
        text=True,
        env={**base_env, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})},
        timeout=timeout,
        cwd="/",
    )


# ---------------------------------------------------------------------------------------------
# The child side (runs as this file's __main__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = [s.encode() if isinstance(s, str) else s for s in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def _enterable(path: str, uid: int, gid: int) -> bool:
    st = os.stat(path)
    if st.st_uid == uid:
        return bool(st.st_mode & 0o100)
    if st.st_gid == gid:
        return bool(st.st_mode & 0o010)
    return bool(st.st_mode & 0o001)


def _expose(needed: list[str], uid: int, gid: int) -> None:
    """Cover each ancestor of ``needed`` that uid cannot enter with a tmpfs holding read-only
    binds of the needed paths below it."""
    needed = sorted({os.path.realpath(p) for p in needed})
    needed = [p for p in needed if not any(p.startswith(q + "/") for q in needed)]
    covers: dict[str, list[str]] = {}
    for path in needed:
        parts = path.split(os.sep)
        for i in range(2, len(parts) + 1):
            ancestor = os.sep.join(parts[:i])
            if ancestor != path and not _enterable(ancestor, uid, gid):
                covers.setdefault(ancestor, []).append(path)
                break
    for ancestor in sorted(covers, key=len):
        if any(ancestor.startswith(c + "/") for c in covers if c != ancestor):
            continue  # inside another cover: its paths are bound there
        inner = [p for p in needed if p.startswith(ancestor + "/")]
        fds = [os.open(p, os.O_PATH) for p in inner]  # before the ancestor is covered
        _mount("tmpfs", ancestor, "tmpfs", 0, "size=1m,mode=0755")
        for path, fd in zip(inner, fds):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            os.close(fd)


def _block_user_namespaces() -> None:
    """Enter a user namespace in which no further user namespace may be created."""
    uid, gid = os.geteuid(), os.getegid()
    _libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: setuid made /proc/self root's
    if _libc.unshare(CLONE_NEWUSER) != 0:
        return  # user namespaces are unavailable already
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1")):
        Path(f"/proc/self/{name}").write_text(text)
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    Path("/proc/sys/user/max_user_namespaces").write_text("0")


def _child_main() -> None:
    config, code = json.loads(sys.argv[1]), sys.argv[2]
    if os.geteuid() == 0:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _mount("none", "/", None, MS_REC | MS_PRIVATE)
        for host, target in config["binds"].items():
            _mount(host, target, None, MS_BIND | MS_REC)
        if config["user"] == "unprivileged":
            prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix]
            _expose([*prefixes, str(REPO), *config["binds"].values()], UID, GID)
            os.setgroups([])
            os.setgid(GID)
            os.setuid(UID)
    elif config["user"] == "root":
        sys.exit("the root variant needs root")
    if config["block_userns"]:
        _block_user_namespaces()
    os.execv(sys.executable, [sys.executable, "-c", code])


if __name__ == "__main__":
    _child_main()
