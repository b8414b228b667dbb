"""Run untrusted programs (model-generated code plus its tests) safely and in parallel.

    with Sandbox(workers=2) as sandbox:
        results = sandbox.run_many([program_a, program_b])
    results[0].status   # "passed" | "failed" | "timed_out" | "crashed"

Every program runs in its own process, never in the harness's. The harness starts ``workers``
small clean Python processes (``_sandbox_worker.py``, started with an empty environment); each
forks a fresh launcher + program process per job. What each program gets, when the harness runs
as root on Linux (the normal case in containers):

* new network namespace (no interfaces but a down loopback: no network at all), pid namespace
  (the program is pid 1; when it ends every process it started is killed by the kernel), mount,
  IPC and UTS namespaces;
* a private, size-limited tmpfs over /tmp, /var/tmp, /dev/shm, /run/lock, with the working
  directory a fresh scratch dir inside it (gone when the job ends);
* an unprivileged uid/gid of its own per worker slot (so it cannot write root's files, signal
  the harness or read other processes' /proc/PID/environ, and RLIMIT_NPROC — which root
  ignores — caps forks), no supplementary groups, no_new_privs;
* rlimits: CPU seconds, address space (memory), process count, file size, no core files;
  a wall-clock timeout enforced by the launcher (and a backstop in the worker);
* a clean environment (PATH, HOME, LANG only) and stdin from /dev/null; stdout/stderr captured
  up to ``max_output_bytes``.

Without root or namespaces (``isolation="basic"`` or when unshare fails) it falls back to rlimits,
a per-job temp dir and a Python-level socket guard; ``ExecutionResult.isolation`` always says
which protections were actually in force.

Not guaranteed: no seccomp syscall filter, so kernel bugs are in scope for an attacker; files
readable by any user stay readable; a program that deliberately forges the result message on
its reporting pipe could fake a pass. It is a guard against accidents and sloppy model output
(the usual threat for code benchmarks), not a hardened jail for adversarial code.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

STATUSES = ("passed", "failed", "timed_out", "crashed")
WORKER_SCRIPT = Path(__file__).with_name("_sandbox_worker.py")
# Sandboxed programs run as uid BASE_UID + slot; high, unnamed uids that own no files.
BASE_UID = 1_500_000
_SANDBOX_COUNTER = itertools.count()


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits. Seconds, bytes and counts."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: float | None = None  # CPU time; None means the same as timeout_s
    memory_bytes: int = 2 << 30  # RLIMIT_AS (virtual address space)
    max_processes: int = 32  # RLIMIT_NPROC for the sandbox's uid
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    tmpfs_bytes: int = 64 << 20  # size of the private /tmp (scratch dir lives there)
    max_output_bytes: int = 64 << 10  # stdout and stderr are each cut to this

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

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Worker:
    """One zygote process, used by one thread at a time."""

    def __init__(self, slot: int, base_uid: int):
        self.slot = slot
        self.uid = base_uid + slot
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # -I: ignore PYTHON* env vars and the user site; env={} : the harness's secrets stay here.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
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
            return json.loads(self.proc.stdout.read(n).decode("utf-8"))
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

    ``workers``: parallel programs (default: number of CPU cores). ``isolation``: ``"auto"``
    (namespaces when possible, else the fallback), ``"strict"`` (fail the job if namespaces are
    unavailable) or ``"basic"`` (never use namespaces).
    """

    def __init__(
        self,
        workers: int | None = None,
        limits: SandboxLimits | None = None,
        isolation: str = "auto",
    ):
        if isolation not in ("auto", "strict", "basic"):
            raise ValueError(f"isolation must be 'auto', 'strict' or 'basic', got {isolation!r}")
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
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

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._all:
            w.close()

    def _job(self, program: str, limits: SandboxLimits) -> dict[str, Any]:
        namespaces = {"auto": True, "strict": "require", "basic": False}[self.isolation]
        return {"program": program, "namespaces": namespaces, **limits.to_job()}

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
        results: list[ExecutionResult | None] = [None] * len(programs)
        bar = tqdm(total=len(programs), desc=desc, disable=not progress, leave=False)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            futures = {
                pool.submit(self.run, prog, lim): i
                for i, (prog, lim) in enumerate(zip(programs, per_program))
            }
            for fut in _as_completed(futures):
                results[futures[fut]] = fut.result()
                bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]


def _as_completed(futures):
    from concurrent.futures import as_completed

    return as_completed(futures)


def run_programs(
    programs: Sequence[str],
    workers: int | None = None,
    limits: SandboxLimits | None = None,
    isolation: str = "auto",
    progress: bool = False,
) -> list[ExecutionResult]:
    """One-shot convenience: start a :class:`Sandbox`, run ``programs``, shut it down."""
    with Sandbox(workers=workers, limits=limits, isolation=isolation) as sandbox:
        return sandbox.run_many(programs, progress=progress)


def with_timeout(limits: SandboxLimits, timeout_s: float) -> SandboxLimits:
    """Copy of ``limits`` with another wall-clock (and CPU) timeout."""
    return replace(limits, timeout_s=timeout_s, cpu_s=None)
