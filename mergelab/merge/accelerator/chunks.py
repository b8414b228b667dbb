"""Running element-wise work over chunks on every core: the accelerator's threads and buffers.

The chunks run on :func:`for_chunks`' worker threads, one per torch thread
(``torch.get_num_threads()``), each running torch single-threaded: every core is busy with
whole chunks, and no op waits at an OpenMP barrier for a thread the OS has given to another
process (on a shared 2-core machine that stall made intra-op threading slower than one thread).
Results never depend on the number of workers: chunk boundaries are fixed and every reduction is
combined in chunk order.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

R = TypeVar("R")

# Entries per chunk in the elementwise loops: 1 MiB of float32, so temporaries stay in the
# (shared) L3 cache, and big enough that the worker threads rarely wait for each other's Python
# (the GIL) between ops: 2¹⁶ was ~2× slower on two workers here.
CHUNK = 1 << 18
# torch runs an op over fewer entries than this on the calling thread (at::internal::GRAIN_SIZE);
# below it, for_chunks does too.
GRAIN = 1 << 15


def chunks(numel: int, size: int | None = None) -> Iterable[slice]:
    """Consecutive slices of ``size`` (default :data:`CHUNK`) entries covering ``range(numel)``."""
    size = size or CHUNK
    return (slice(start, min(start + size, numel)) for start in range(0, numel, size))


# --- running chunks on every core ----------------------------------------------------------------

_workers_lock = threading.Lock()
_workers: tuple[int, ThreadPoolExecutor] | None = None
_on_worker = threading.local()


def _start_worker(barrier: threading.Barrier) -> None:
    # torch reads its thread count into a new thread lazily, on its first parallel op, from the
    # process-wide setting; that must happen before this thread's own setting, or the lazy read
    # (after chunk_workers set the process-wide value back) would undo it.
    torch.get_num_threads()
    torch.set_num_threads(1)  # this thread's ops run on this thread only
    _on_worker.active = True
    barrier.wait()


def _keep_freed_memory() -> None:
    """Ask glibc's malloc to keep freed blocks of up to 32 MiB for reuse instead of returning
    them to the OS: the chunk workers allocate and free chunk-sized temporaries all the time,
    and each block given back had to be faulted in and zeroed again by the kernel (a third of
    a TIES merge's CPU time went to the kernel before). Process-wide; no-op without glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: trim a heap only above 1 GiB free
        libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD: blocks up to 32 MiB come from heaps
    except (OSError, AttributeError):
        pass


def chunk_workers() -> ThreadPoolExecutor | None:
    """The worker threads of :func:`for_chunks`, one per torch thread (``None`` for one thread).

    Each worker runs torch single-threaded. ``torch.set_num_threads(1)`` in a worker also lowers
    the default that threads started later inherit, so it is set back once all workers started.
    """
    global _workers
    n = torch.get_num_threads()
    if n <= 1:
        return None
    with _workers_lock:
        if _workers is None or _workers[0] != n:
            if _workers is not None:
                _workers[1].shutdown(wait=False)
            if _workers is None:
                _keep_freed_memory()
            barrier = threading.Barrier(n + 1)
            pool = ThreadPoolExecutor(n, thread_name_prefix="mergelab-chunks")
            for _ in range(n):  # n blocking tasks: the pool starts n threads
                pool.submit(_start_worker, barrier)
            barrier.wait()
            torch.set_num_threads(n)
            _workers = (n, pool)
        return _workers[1]


def for_chunks(numel: int, fn: Callable[[slice], R], size: int | None = None) -> list[R]:
    """``[fn(part) for part in chunks(numel, size)]``, the chunks spread over every core.

    The chunks run on :func:`chunk_workers` (in a few contiguous runs per worker, taken in
    turn), single-threaded each, so results never depend on the thread count; results come back
    in chunk order. ``fn`` must only write to its own chunk of shared outputs, and must not call
    ``for_chunks`` itself (a nested call runs serially). With one torch thread, or fewer than
    :data:`GRAIN` entries, everything runs on the calling thread.
    """
    return start_chunks(numel, fn, size)()


def start_chunks(
    numel: int, fn: Callable[[slice], R], size: int | None = None
) -> Callable[[], list[R]]:
    """:func:`for_chunks` started: the chunks run on the workers while the caller goes on;
    calling the result waits for them and returns what ``for_chunks`` would. Where
    ``for_chunks`` runs on the calling thread, they have run when this returns."""
    parts = list(chunks(numel, size))
    workers = None if numel < GRAIN or getattr(_on_worker, "active", False) else chunk_workers()
    if workers is None or len(parts) == 1:
        if workers is not None:  # one chunk, still single-threaded: the same results either way
            future = workers.submit(fn, parts[0])
            return lambda: [future.result()]
        done = [fn(part) for part in parts]
        return lambda: done
    n_runs = min(len(parts), 4 * _workers[0])
    bounds = [round(i * len(parts) / n_runs) for i in range(n_runs + 1)]
    runs = [parts[a:b] for a, b in zip(bounds, bounds[1:])]
    futures = [workers.submit(lambda run: [fn(part) for part in run], run) for run in runs]

    def results() -> list[R]:
        out: list[R] = []
        for future in futures:
            out.extend(future.result())
        return out

    return results


_scratch = threading.local()


def scratch(
    key: str, numel: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """A per-thread reusable flat buffer of ``numel`` entries (valid until the same thread asks
    for ``key`` again)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    device = torch.device("cpu") if device is None else device
    buf = buffers.get((key, dtype, device))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, CHUNK), dtype=dtype, device=device)
        buffers[(key, dtype, device)] = buf
    return buf[:numel]


def as_dtype(x: torch.Tensor, dtype: torch.dtype, key: str) -> torch.Tensor:
    """``x`` (a chunk) in ``dtype``: itself, or a copy in this thread's scratch buffer ``key``."""
    if x.dtype == dtype:
        return x
    return scratch(key, x.numel(), dtype, x.device).view(x.shape).copy_(x)
