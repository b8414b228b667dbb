"""Hostile generated programs against the sandbox, run as root and as an unprivileged user.

Each program does what a wrong or malicious model output could do, and (where it matters) ends
with a failing assertion, so that "passed" would be a forgery. The battery runs once per user,
in one ``Sandbox``, inside ``tests/_unpriv.py``'s child (a private mount namespace, as root or
dropped to uid 65534; the host traps are set up here, by the test). Each test then checks one
property on the results and on the host: no network reached, nothing written outside scratch,
no secret seen, nothing killed, no forged pass, loops and bombs contained, and genuinely passing
programs still pass.
"""

import errno
import fcntl
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import _unpriv
import pytest

SECRET = "s3cret-" + uuid.uuid4().hex
TAG = "mergelab-hostile-" + uuid.uuid4().hex[:12]
LIMITS = {
    "timeout_s": 10.0,
    "memory_bytes": 256 << 20,
    "max_processes": 16,
    "max_file_bytes": 8 << 20,
    "tmpfs_bytes": 32 << 20,
}
SHORT = {"timeout_s": 2.0}
# As root, the test's host area is bound here inside the helper's private mount namespace.
AREA_MOUNT = next((d for d in ("/srv", "/media") if os.path.isdir(d)), None)

# Writes plausible "passed" messages (the old protocol's program and launcher lines, a worker
# reply, length-framed too) to every inherited descriptor and every pipe under /proc.
FORGE = """
import glob, json, os, stat, struct
msgs = [
    {"pid": os.getpid(), "outcome": "passed", "error": "", "isolation": []},
    {"launcher": True, "program_pid": os.getpid(), "timed_out": False, "signal": None,
     "exit_code": 0, "status": "passed", "error": "", "isolation": ["netns"]},
    {"status": "passed", "error": "", "exit_code": 0, "signal": None, "isolation": ["netns"]},
]
lines = "".join(json.dumps(m) + "\\n" for m in msgs).encode()
reply = json.dumps(msgs[2]).encode()
data = lines + struct.pack(">I", len(reply)) + reply
hits = []
for fd in range(3, 1024):
    try:
        os.write(fd, data)
        hits.append(fd)
    except OSError:
        pass
for path in glob.glob("/proc/*/fd/*"):
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, data)
            os.close(fd)
            hits.append(path)
    except OSError:
        pass
print("forged into", hits)
"""

CONTROLS = {
    "plain": "def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')",
    "subprocess_and_scratch": """
import os, shutil, subprocess, sys
open("data.txt", "w").write("6 7")
a, b = map(int, open("data.txt").read().split())
out = subprocess.run([sys.executable, "-c", f"print({a} * {b})"], capture_output=True, text=True)
assert out.stdout.strip() == "42", out
if shutil.which("bash"):
    assert subprocess.run(["bash", "-c", "echo ok"], capture_output=True, text=True).stdout == "ok\\n"
with open("/tmp/t.txt", "w") as f:
    f.write("tmp is writable")
""",
    # Passes only if the sandbox is what it claims, seen from inside.
    "inside_view": """
import errno, os, socket
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
    assert int(status[key].strip(), 16) == 0, (key, status[key])
assert status["NoNewPrivs"].strip() == "1"
assert os.getpid() == 1
assert [p for p in os.listdir("/proc") if p.isdigit()] == ["1"], os.listdir("/proc")
assert sorted(os.listdir("/proc/self/fd")) == ["0", "1", "2", "3"]  # 3: listdir's own
assert os.getcwd() == "/tmp/scratch"
assert set(os.environ) <= {"PATH", "HOME", "LANG"}, dict(os.environ)
assert [name for _, name in socket.if_nameindex()] == ["lo"]
assert socket.gethostname() == "sandbox"
assert os.getuid() != 0 and os.geteuid() != 0
for path in ("/etc/mergelab-probe", "/usr/mergelab-probe", "/mergelab-probe"):
    try:
        open(path, "w")
        raise AssertionError(path + " is writable")
    except OSError as exc:
        assert exc.errno in (errno.EROFS, errno.EACCES), (path, exc)
print("inside view ok")
""",
}


def _hostile_programs(
    area: str, listeners: list[tuple[str, int, int]], pytest_pid: int, abstract: str
):
    """name -> (source, limits override)."""
    home_token = f"{area}/home/token.txt"
    write_targets = [
        f"/tmp/{TAG}",
        f"/var/tmp/{TAG}",
        f"/dev/shm/{TAG}",
        f"/run/{TAG}",
        f"/etc/{TAG}",
        f"/root/{TAG}",
        f"{_unpriv.REPO}/{TAG}",
        f"{area}/writable/{TAG}",
        f"{area}/home/{TAG}",
    ]
    victim = f"{area}/writable/victim.txt"
    unix_path = f"{area}/writable/harness.sock"
    return {
        "loop": ("while True:\n    pass", SHORT),
        "sleep": ("import time\ntime.sleep(60)", SHORT),
        "fork_count": (
            """
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as exc:
    print("forks", n, type(exc).__name__)
assert False, "fork counter must not pass"
""",
            {},
        ),
        "fork_bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            SHORT,
        ),
        "memory_bomb": ("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))", {}),
        "disk_fill": (
            f"TAG = {TAG!r}\n"
            """
import os
def fill(path):
    n = 0
    try:
        with open(path, "wb") as f:
            while n < (1 << 30):
                f.write(b"x" * (1 << 20))
                f.flush()
                n += 1 << 20
    except OSError as exc:
        return [n, exc.errno]
    return [n, 0]
paths = ["big1", "big2", "/tmp/TAG-3", "/dev/shm/TAG-4", "/var/tmp/TAG-5", "/run/TAG-6", "big7"]
print({p: fill(p.replace("TAG", TAG)) for p in paths})
assert False, "disk filler must not pass"
""",
            {},
        ),
        "writes": (
            f"""
import os
res = {{}}
for path in {write_targets!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        res[path] = "wrote"
    except OSError as exc:
        res[path] = exc.errno
for prefix, victim in (("", {victim!r}), ("visible ", "/etc/hosts")):
    ops = {{
        "append": lambda: open(victim, "a").write("x"),
        "truncate": lambda: os.truncate(victim, 0),
        "chmod": lambda: os.chmod(victim, 0o777),
        "utime": lambda: os.utime(victim, (0, 0)),
        "rename": lambda: os.rename(victim, victim + ".moved"),
        "unlink": lambda: os.unlink(victim),
    }}
    for name, op in ops.items():
        try:
            op()
            res[prefix + name] = "done"
        except OSError as exc:
            res[prefix + name] = exc.errno
open("inside.txt", "w").write("fine")
res["scratch"] = open("inside.txt").read()
print(repr(res))
assert False, "writer must not pass"
""",
            {},
        ),
        "network": (
            f"""
import _socket, ctypes, shutil, socket, struct, subprocess, sys
out = {{}}
libc = ctypes.CDLL(None, use_errno=True)
for host, port, udp_port in {listeners!r}:
    r = {{}}
    try:
        socket.create_connection((host, port), timeout=1).sendall(b"x")
        r["socket"] = "CONNECTED"
    except OSError as exc:
        r["socket"] = exc.errno
    try:
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        s.settimeout(1)
        s.connect((host, port))
        r["_socket"] = "CONNECTED"
    except OSError as exc:
        r["_socket"] = exc.errno
    fd = libc.socket(2, 1, 0)
    addr = struct.pack("=H", 2) + struct.pack("!H", port) + socket.inet_aton(host) + bytes(8)
    r["ctypes"] = "CONNECTED" if libc.connect(fd, addr, 16) == 0 else ctypes.get_errno()
    code = f"import socket; socket.create_connection(({{host!r}}, {{port}}), timeout=1)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=8)
    r["subprocess"] = "CONNECTED" if p.returncode == 0 else p.returncode
    if shutil.which("bash"):
        cmd = f"exec 3<>/dev/tcp/{{host}}/{{port}}"
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=8)
        r["bash"] = "CONNECTED" if p.returncode == 0 else p.returncode
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", (host, udp_port))
        r["udp"] = "SENT"
    except OSError as exc:
        r["udp"] = exc.errno
    out[host] = r
# Unix sockets of the harness's user: one in a directory of its own (path-based sockets cross
# network namespaces), one abstract.
for name, address in (("unix_path", {unix_path!r}), ("unix_abstract", "\\0" + {abstract!r})):
    try:
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.settimeout(1)
        u.connect(address)
        u.sendall(b"x")
        out[name] = "CONNECTED"
    except OSError as exc:
        out[name] = exc.errno
print(out)
assert False, "network program must not pass"
""",
            {},
        ),
        "secrets": (
            f"""
import glob, os, sys
seen = [repr(dict(os.environ))]
paths = glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline")
paths += ["/proc/__HARNESS_PID__/environ", "/proc/{pytest_pid}/environ", {home_token!r}]
for path in paths:
    try:
        seen.append(open(path, "rb").read().decode("latin-1"))
    except OSError as exc:
        seen.append(f"{{path}}: {{exc.errno}}")
print("\\n".join(seen))
print("\\n".join(seen), file=sys.stderr)
assert False, "secret reader must not pass"
""",
            {},
        ),
        "kill": (
            f"""
import os, signal, time
out = []
for pid in [os.getppid(), -1, 1, __HARNESS_PID__, {pytest_pid}, *__WORKER_PIDS__]:
    try:
        os.kill(pid, signal.SIGKILL)
        out.append((pid, "sent"))
    except OSError as exc:
        out.append((pid, exc.errno))
time.sleep(0.2)
print(out)
assert False, "killer must not pass"
""",
            {},
        ),
        # Capabilities regained in a user namespace of its own must not undo the sandbox.
        "nested_userns": (
            f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
out = {{}}
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x00020000) != 0:  # CLONE_NEWUSER | CLONE_NEWNS
    out["unshare"] = ctypes.get_errno()
else:
    out["unshare"] = "ok"
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {{uid}} 1"), ("gid_map", f"0 {{gid}} 1")):
        try:
            open(f"/proc/self/{{name}}", "w").write(text)
        except OSError as exc:
            out[name] = exc.errno
    for what, ret in (
        ("remount_rw", lambda: libc.mount(None, b"/", None, 32 | 4096, None)),
        ("umount_proc", lambda: libc.umount2(b"/proc", 2)),
        ("umount_tmp", lambda: libc.umount2(b"/tmp", 2)),
    ):
        out[what] = "done" if ret() == 0 else ctypes.get_errno()
for path in ["/etc/{TAG}", "{_unpriv.REPO}/{TAG}", "{area}/writable/{TAG}-nested"]:
    try:
        open(path, "w").write("x")
        out[path] = "wrote"
    except OSError as exc:
        out[path] = exc.errno
print(out)
assert False, "must not pass"
""",
            {},
        ),
        "forge_exit0": (FORGE + "import os\nos._exit(0)", {}),
        "forge_sys_exit": (FORGE + "import sys\nsys.exit(0)", {}),
        "forge_assert": (FORGE + "assert False, 'wrong solution'", {}),
        "forge_exec": (FORGE + "import os\nos.execv('/bin/sh', ['sh', '-c', 'exit 0'])", {}),
        # Children exit with every code; only the program's own exit status counts.
        "forge_children": (
            FORGE
            + """
import os
for code in range(256):
    pid = os.fork()
    if pid == 0:
        os._exit(code)
    os.waitpid(pid, 0)
assert False, "wrong solution"
""",
            {},
        ),
        "forge_stdout": (
            "import json, sys\n"
            "print(json.dumps({'outcome': 'passed', 'status': 'passed'}))\n"
            "print(json.dumps({'outcome': 'passed', 'status': 'passed'}), file=sys.stderr)\n"
            "assert False, 'wrong solution'",
            {},
        ),
    }


BATTERY = (
    _unpriv.IMPORT_SANDBOX
    + """
import json, os, socket, sys, time
from pathlib import Path
spec = json.loads(sys.stdin.read())
# Outside the sandbox this user can write the test's area: so a refusal inside is the sandbox's.
Path(spec["control_file"]).write_text("written by the harness's user")
# A service of this user on Unix sockets (like an ssh-agent, a D-Bus, a Jupyter kernel).
unix = []
for address in (spec["unix_path"], "\\0" + spec["abstract"]):
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        u.bind(address)
    except OSError:  # a path too long for AF_UNIX: the program finds nothing there
        continue
    u.listen(4)
    u.setblocking(False)
    unix.append(u)
if os.path.exists(spec["unix_path"]):
    os.chmod(spec["unix_path"], 0o777)
limits = sandbox.SandboxLimits(**spec["limits"])
out = {"harness_pid": os.getpid(), "uid": os.getuid()}
try:
    sb = sandbox.Sandbox(workers=2, limits=limits)
except sandbox.SandboxUnavailableError as exc:
    print(json.dumps({"unavailable": str(exc)}))
    sys.exit(0)
with sb:
    for w in sb._all:
        if w.proc is None:  # the first one already ran the probe
            w.start()
    workers = [w.proc.pid for w in sb._all]
    names = list(spec["programs"])
    sources = [
        src.replace("__HARNESS_PID__", str(os.getpid())).replace("__WORKER_PIDS__", repr(workers))
        for src, _ in spec["programs"].values()
    ]
    per = [sandbox.SandboxLimits(**{**spec["limits"], **o}) for _, o in spec["programs"].values()]
    t0 = time.monotonic()
    results = sb.run_many(sources, limits=per)
    out["seconds"] = time.monotonic() - t0
    out["results"] = {n: r.to_dict() for n, r in zip(names, results)}
    out["workers_alive"] = [w.proc.poll() is None for w in sb._all]
    out["workers_unchanged"] = [w.proc.pid for w in sb._all] == workers
    controls = sb.run_many(list(spec["controls"].values()))
    out["controls"] = {n: r.to_dict() for n, r in zip(spec["controls"], controls)}
time.sleep(0.3)
mine = os.getpid()
leftover = []
for status in Path("/proc").glob("[0-9]*/status"):
    try:
        text = status.read_text()
    except OSError:
        continue
    uid = int(next(ln for ln in text.splitlines() if ln.startswith("Uid:")).split()[1])
    zombie = "\\tZ" in next(ln for ln in text.splitlines() if ln.startswith("State:"))
    pid = int(status.parent.name)
    # As root: this Sandbox's own uids only (other test runs on the machine have their own).
    sandbox_uid = uid in {w.uid for w in sb._all} if out["uid"] == 0 else uid == out["uid"]
    if sandbox_uid and pid != mine and not zombie:
        leftover.append([pid, text.splitlines()[0]])
out["leftover"] = leftover
out["unix_connections"] = []
for u in unix:
    try:
        u.accept()
        out["unix_connections"].append(str(u.getsockname()))
    except BlockingIOError:
        pass
print(json.dumps(out))
"""
)


def _interface_addresses() -> list[str]:
    """IPv4 addresses of the host's non-loopback interfaces."""
    addrs = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _, name in socket.if_nameindex():
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            continue  # no IPv4 address
        addr = socket.inet_ntoa(packed[20:24])
        if not addr.startswith("127."):
            addrs.append(addr)
    probe.close()
    return addrs[:1]


class HostTraps:
    """Listeners, a writable area and a secret on the host; what happened to them afterwards."""

    def __init__(self, root: Path):
        self.tcp, self.udp, self.listeners = [], [], []
        for host in ["127.0.0.1", *_interface_addresses()]:
            tcp = socket.socket()
            tcp.bind((host, 0))
            tcp.listen(8)
            tcp.setblocking(False)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((host, 0))
            udp.setblocking(False)
            self.tcp.append(tcp)
            self.udp.append(udp)
            self.listeners.append((host, tcp.getsockname()[1], udp.getsockname()[1]))
        self.area = root
        self.area.chmod(0o755)
        (root / "writable").mkdir()
        (root / "writable").chmod(0o777)  # any uid may write here, outside the sandbox
        self.victim = root / "writable" / "victim.txt"
        self.victim.write_text("original")
        self.victim.chmod(0o666)
        self.victim_stat = self.victim.stat()
        (root / "home").mkdir()
        (root / "home" / "token.txt").write_text("token-" + SECRET)
        for path in (root / "home", root / "home" / "token.txt"):
            path.chmod(0o755 if path.is_dir() else 0o644)

    def connections(self) -> list[str]:
        got = []
        for tcp, udp in zip(self.tcp, self.udp):
            for sock, kind in ((tcp, "tcp"), (udp, "udp")):
                try:
                    sock.accept() if kind == "tcp" else sock.recvfrom(64)
                    got.append(f"{kind} {sock.getsockname()}")
                except BlockingIOError:
                    pass
        return got

    def close(self) -> None:
        for sock in self.tcp + self.udp:
            sock.close()


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def battery(request, tmp_path_factory):
    user = request.param
    reason = _unpriv.available(user)
    if reason:
        pytest.skip(f"{user} variant unavailable: {reason}")
    if os.geteuid() == 0:
        if AREA_MOUNT is None:
            pytest.skip("no /srv or /media directory to bind the test's host area onto")
        # Outside /tmp (private in the sandbox) and writable for the helper's user.
        area = tmp_path_factory.mktemp(f"hostile-{user}")
        area_seen, binds = AREA_MOUNT, {str(area): AREA_MOUNT}
    else:
        # Without root, no bind: a directory of the user's own, as their checkout would be.
        try:
            area = Path(tempfile.mkdtemp(prefix=".sandbox-hostile-", dir=_unpriv.REPO))
        except OSError as exc:
            pytest.skip(f"no directory of this user's own outside /tmp to write into: {exc}")
        area_seen, binds = str(area), {}
    traps = HostTraps(area)
    os.environ["MERGELAB_TEST_SECRET"] = SECRET  # in the test process too
    abstract = f"{TAG}-{user}"
    programs = _hostile_programs(area_seen, traps.listeners, os.getpid(), abstract)
    spec = {
        "limits": LIMITS,
        "programs": programs,
        "controls": CONTROLS,
        "control_file": f"{area_seen}/writable/control-{user}",
        "unix_path": f"{area_seen}/writable/harness.sock",
        "abstract": abstract,
    }
    t0 = time.monotonic()
    try:
        proc = _unpriv.run_python(
            BATTERY,
            user=user,
            stdin=json.dumps(spec),
            env={"MERGELAB_TEST_SECRET": SECRET, "HOME": f"{area_seen}/home"},
            binds=binds,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        if "unavailable" in out:
            pytest.skip(f"namespaces unavailable to the {user} user: {out['unavailable']}")
        out["connections"] = traps.connections()
        out["wall_s"] = time.monotonic() - t0
        out.update(user=user, traps=traps, area=area_seen)
        yield out
    finally:
        traps.close()
        os.environ.pop("MERGELAB_TEST_SECRET", None)
        if not binds:
            shutil.rmtree(area, ignore_errors=True)


def _res(battery, name):
    return battery["results"][name]


def test_genuine_programs_pass(battery):
    controls = battery["controls"]
    assert {n: r["status"] for n, r in controls.items()} == {n: "passed" for n in CONTROLS}, {
        n: r["error"][-500:] for n, r in controls.items()
    }
    assert "inside view ok" in controls["inside_view"]["stdout"]
    expected = {"netns", "pidns", "mountns", "private-proc", "private-tmp", "readonly-root"}
    expected |= {"no-capabilities", "no-new-privs", "closed-fds", "private-home"}
    if battery["user"] == "root":
        expected |= {"unprivileged-uid"}
    else:
        expected |= {"userns", "caller-uid"}
    assert expected <= set(controls["plain"]["isolation"])
    assert "weak" not in controls["plain"]["isolation"]


def test_loops_time_out(battery):
    for name in ("loop", "sleep"):
        res = _res(battery, name)
        assert res["status"] == "timed_out" and "wall" in res["error"], res
        assert res["seconds"] < SHORT["timeout_s"] + 3


def test_fork_bombs_are_contained_and_leave_nothing(battery):
    counter = _res(battery, "fork_count")
    assert counter["status"] == "failed", counter
    forks = int(counter["stdout"].split()[1])
    assert 0 < forks < LIMITS["max_processes"], counter["stdout"]  # RLIMIT_NPROC holds
    bomb = _res(battery, "fork_bomb")
    assert bomb["status"] in ("timed_out", "crashed"), bomb
    assert bomb["seconds"] < SHORT["timeout_s"] + 3
    assert battery["leftover"] == []  # the pid namespace took every child with it


def test_memory_bomb_is_stopped(battery):
    res = _res(battery, "memory_bomb")
    assert res["status"] == "crashed" and "MemoryError" in res["error"], res


def test_disk_fill_is_bounded_and_private(battery):
    res = _res(battery, "disk_fill")
    assert res["status"] == "failed", res
    fills = eval(res["stdout"])  # noqa: S307 - our own program's repr of a dict of lists
    sizes = [n for n, _ in fills.values()]
    assert max(sizes) <= LIMITS["max_file_bytes"]
    assert sum(sizes) <= LIMITS["tmpfs_bytes"]  # one budget for /tmp, /dev/shm, /var/tmp, /run
    assert {e for _, e in fills.values()} <= {errno.EFBIG, errno.ENOSPC}
    for path in (f"/tmp/{TAG}-3", f"/dev/shm/{TAG}-4", f"/var/tmp/{TAG}-5", f"/run/{TAG}-6"):
        assert not Path(path).exists()


def test_writes_outside_scratch_do_not_land(battery):
    traps = battery["traps"]
    res = _res(battery, "writes")
    assert res["status"] == "failed", res
    seen = eval(res["stdout"])  # noqa: S307 - our own program's repr of a dict
    assert seen["scratch"] == "fine"
    # The test's area was writable for this user outside the sandbox; inside, it is not even
    # there (the sandbox's root holds the system, Python and /etc's few files, read-only).
    assert (traps.area / "writable" / f"control-{battery['user']}").exists()
    assert seen[f"{battery['area']}/writable/{TAG}"] == errno.ENOENT
    for op in ("append", "truncate", "chmod", "utime", "rename", "unlink"):
        assert seen[op] == errno.ENOENT, (op, seen[op])
        visible = seen["visible " + op]
        assert visible in (errno.EROFS, errno.EPERM, errno.EACCES), (op, visible)
    for host_path in [
        Path("/tmp", TAG),
        Path("/var/tmp", TAG),
        Path("/dev/shm", TAG),
        Path("/run", TAG),
        Path("/etc", TAG),
        Path("/root", TAG),
        _unpriv.REPO / TAG,
        traps.area / "writable" / TAG,
        traps.area / "home" / TAG,
    ]:
        assert not host_path.exists(), f"{host_path} was written on the host"
    assert traps.victim.read_text() == "original"
    st = traps.victim.stat()
    assert (st.st_mode, st.st_mtime_ns) == (
        traps.victim_stat.st_mode,
        traps.victim_stat.st_mtime_ns,
    )


def test_network_is_unreachable(battery):
    res = _res(battery, "network")
    assert res["status"] == "failed", res
    assert "CONNECTED" not in res["stdout"] and "SENT" not in res["stdout"], res["stdout"]
    tried = eval(res["stdout"])  # noqa: S307 - our own program's repr of a dict
    assert set(tried) - {"unix_path", "unix_abstract"} == {
        h for h, _, _ in battery["traps"].listeners
    }
    assert tried["unix_path"] != "CONNECTED" and tried["unix_abstract"] != "CONNECTED"
    assert battery["connections"] == [] and battery["unix_connections"] == []


def test_secrets_are_not_seen(battery):
    res = _res(battery, "secrets")
    assert res["status"] == "failed", res
    for r in battery["results"].values():
        text = r["stdout"] + r["stderr"] + r["error"]
        assert SECRET not in text and "MERGELAB_TEST_SECRET" not in text
    assert "token.txt: 2" in res["stdout"]  # the caller's home is hidden (ENOENT)


def test_killing_parent_harness_and_workers_is_not_obeyed(battery):
    res = _res(battery, "kill")
    assert res["status"] == "failed", res
    sent = dict(eval(res["stdout"]))  # noqa: S307 - our own program's repr of a list
    assert sent[battery["harness_pid"]] == errno.ESRCH  # not even visible
    assert battery["workers_alive"] == [True, True] and battery["workers_unchanged"]


def test_nested_user_namespace_gives_nothing_back(battery):
    traps = battery["traps"]
    res = _res(battery, "nested_userns")
    assert res["status"] == "failed", res
    out = eval(res["stdout"])  # noqa: S307 - our own program's repr of a dict
    if battery["user"] == "unprivileged":
        assert out["unshare"] == errno.ENOSPC  # max_user_namespaces is 0 inside the sandbox
    assert "done" not in out.values() and "wrote" not in out.values(), out
    assert not (traps.area / "writable" / f"{TAG}-nested").exists()
    assert not Path("/etc", TAG).exists() and not (_unpriv.REPO / TAG).exists()


def test_forged_results_never_pass(battery):
    expected = {
        "forge_exit0": "crashed",
        "forge_sys_exit": "crashed",
        "forge_assert": "failed",
        "forge_exec": "crashed",
        "forge_children": "failed",
        "forge_stdout": "failed",
    }
    got = {name: _res(battery, name)["status"] for name in expected}
    assert got == expected, {n: _res(battery, n)["error"][-300:] for n in expected}
    assert "exited early with code 0" in _res(battery, "forge_exit0")["error"]
    assert "exit(0)" in _res(battery, "forge_sys_exit")["error"]
    # No other descriptor than its own stdout/stderr pipes was there to write to.
    forged = _res(battery, "forge_assert")["stdout"].split("forged into ")[1]
    assert all(p.startswith("/proc/") and p.split("/")[-1] in ("1", "2") for p in eval(forged))  # noqa: S307
    assert all(r["status"] != "passed" for r in battery["results"].values())


def test_battery_is_fast(battery):
    assert battery["seconds"] < 30, battery["seconds"]


REFUSAL_AND_WEAK = (
    _unpriv.IMPORT_SANDBOX
    + """
import json
try:
    sandbox.Sandbox(workers=1).close()
    refusal = None
except sandbox.SandboxUnavailableError as exc:
    refusal = str(exc)
limits = sandbox.SandboxLimits(timeout_s=5)
with sandbox.Sandbox(workers=1, isolation="weak", limits=limits) as sb:
    results = sb.run_many(["assert 1 + 1 == 2", "assert 0", "import socket\\nsocket.socket()"])
print(json.dumps({"refusal": refusal, "results": [r.to_dict() for r in results]}))
"""
)


def test_refuses_without_namespaces_unless_weak_is_asked_for():
    """A machine whose kernel refuses user namespaces (here: user.max_user_namespaces = 0 in a
    user namespace of the test's own) gets a clear refusal; isolation="weak" still runs."""
    simulated = os.geteuid() != 0 or _unpriv.available("unprivileged") is None
    if simulated:
        proc = _unpriv.run_python(
            REFUSAL_AND_WEAK, user="unprivileged", block_userns=True, timeout=120
        )
    else:  # root without a mount namespace of its own: namespaces are refused here for real
        proc = subprocess.run(
            [sys.executable, "-c", REFUSAL_AND_WEAK], capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if out["refusal"] is None:
        assert not simulated, "Sandbox() ran although user namespaces were refused"
        pytest.skip("namespaces work here and cannot be taken away without a mount namespace")
    assert "cannot isolate" in out["refusal"] and "isolation='weak'" in out["refusal"]
    if simulated:
        assert "max_user_namespaces" in out["refusal"]
    statuses = [r["status"] for r in out["results"]]
    assert statuses == ["passed", "failed", "crashed"]
    assert {"weak", "socket-guard"} <= set(out["results"][0]["isolation"])
    assert "netns" not in out["results"][0]["isolation"]
