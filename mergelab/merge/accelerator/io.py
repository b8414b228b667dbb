"""The accelerator's output I/O for the streaming engine (``checkpoint.write_sharded`` and
its ``BufferPool``): shards written with ``O_DIRECT``, reusable buffers in transparent huge
pages. The bytes written are the same as the engine's plain I/O (``checkpoint.PlainIO``:
ordinary writes through the page cache, fsynced, buffers from ``torch.empty``); only the CPU
time differs (docs/merge_performance.md).

The engine takes :class:`DirectIO` (or ``PlainIO``, the same three names) from
``checkpoint.output_io()``: where the accelerator runs, this; switched off, the plain one.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path

import torch

DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and the buffer address in whole blocks


def write_fully(fd: int, data: memoryview) -> None:
    """``os.write`` until all of ``data`` is written (one call writes at most ~2 GiB on Linux)."""
    with memoryview(data).cast("B") as rest:
        done = 0
        while done < rest.nbytes:
            done += os.write(fd, rest[done:])


class DirectStream:
    """Writes a file front to back with ``O_DIRECT`` where the OS and file system allow it.

    Direct writes go from the caller's memory (see :meth:`write`) or a page-aligned staging buffer
    straight to the disk: the kernel does not copy the bytes into its page cache (for a 2 GB output
    that copy took several CPU-seconds here, the most expensive single step of a linear merge) and
    does not keep them there, so the inputs stay cached. Every direct write is a multiple of
    :data:`DIRECT_ALIGN` bytes at an offset that is one too; the last partial block goes through an
    ordinary descriptor, and the caller's ``fsync`` of the file then flushes it. Where ``O_DIRECT``
    is refused (tmpfs, macOS) everything goes through the ordinary descriptor.
    """

    def __init__(self, path: Path, staging: int = 16 << 20):
        self.path = path
        self._file = open(path, "wb", buffering=0)
        self._direct: int | None = None
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                self._direct = os.open(path, os.O_WRONLY | flag)
            except OSError:
                self._direct = None
        self._buffer = mmap.mmap(-1, staging) if self._direct is not None else None
        self._view = memoryview(self._buffer) if self._buffer is not None else None
        # the same memory as a tensor: torch copies into it without holding Python's GIL
        self._staged = torch.frombuffer(self._buffer, dtype=torch.uint8) if self._buffer else None
        self._used = 0  # bytes staged
        self._offset = 0  # bytes already written to the file

    def write(self, data: torch.Tensor | bytes) -> None:
        """Append ``data`` (bytes, or a tensor's bytes). The whole blocks of a tensor whose
        address has the file position's remainder modulo :data:`DIRECT_ALIGN` (see
        ``checkpoint.BufferPool.take``'s ``phase``) go straight from its memory to the disk; the rest
        (a partial block at either end, or all of a tensor placed otherwise) is copied through
        the staging buffer."""
        if not isinstance(data, torch.Tensor):
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
            if data is None:
                return
        data = data.detach().contiguous().reshape(-1).view(torch.uint8)
        if self._staged is None:
            write_fully(self._file.fileno(), data.numpy().data)
            return
        head = min(-self._used % DIRECT_ALIGN, data.numel())  # up to the next block boundary
        if head:
            self._stage(data[:head])
            data = data[head:]
        whole = data.numel() - data.numel() % DIRECT_ALIGN
        if whole and data.data_ptr() % DIRECT_ALIGN == 0:
            # the staged bytes end on a block boundary: all of them, then the tensor's blocks,
            # in one call (each O_DIRECT write waits for the disk: one wait, not two)
            views = [memoryview(data[:whole].numpy())]
            if self._used:
                views.insert(0, self._view[: self._used])
            self._write_all(views)
            self._used = 0
            data = data[whole:]
        self._stage(data)

    def _write_all(self, views: list[memoryview]) -> None:
        """Write ``views`` (whole blocks each) one after the other at the file position."""
        total = sum(v.nbytes for v in views)
        done = 0
        try:
            while done < total:
                rest, skip = [], done
                for v in views:  # what is left of the views after `done` bytes
                    if skip >= v.nbytes:
                        skip -= v.nbytes
                        continue
                    rest.append(v[skip:])
                    skip = 0
                try:
                    if hasattr(os, "pwritev"):
                        done += os.pwritev(self._direct, rest, self._offset + done)
                    else:
                        done += os.pwrite(self._direct, rest[0], self._offset + done)
                finally:
                    for v in rest:
                        v.release()
        finally:
            # A failed write (disk full) keeps this frame in its traceback: views of the
            # staging map left alive here would stop _release from closing the map.
            for v in views:
                v.release()
        self._offset += total

    def _stage(self, data: torch.Tensor) -> None:
        """Copy ``data`` (flat uint8) into the staging buffer, writing it out whenever full."""
        while data.numel():
            n = min(data.numel(), self._staged.numel() - self._used)
            self._staged[self._used : self._used + n].copy_(data[:n])
            self._used += n
            data = data[n:]
            if self._used == self._staged.numel():
                self._flush_blocks()

    def _flush_blocks(self) -> None:
        """Write the staged whole blocks directly; keep the partial last block staged."""
        whole = self._used - self._used % DIRECT_ALIGN
        if whole:
            self._write_all([self._view[:whole]])
        rest = self._used - whole
        if rest:
            self._view[:rest] = self._view[whole : self._used]
        self._used = rest

    def close(self) -> None:
        try:
            if self._view is not None:
                self._flush_blocks()
                if self._used:  # the last partial block, through the page cache
                    os.pwrite(self._file.fileno(), self._view[: self._used], self._offset)
                    self._offset += self._used
                    self._used = 0
        finally:
            self._release()

    def abort(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        if self._view is not None:
            self._view.release()
            self._staged = self._view = None  # the tensor's export must go before close()
            try:
                self._buffer.close()
            except BufferError:  # a view still held by an exception's traceback: the map is
                pass  # freed with it; the exception being raised is the one to report
            self._buffer = None
        self._file.close()


# Buffers of at least this many bytes are asked for in transparent huge pages.
HUGE_PAGE_MIN_BYTES = 2 << 20


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised flat tensor of ``numel`` ``dtype`` entries in its own anonymous map,
    which the kernel is asked to back with transparent huge pages (``MADV_HUGEPAGE``: 2 MiB
    pages where the system allows them, on Linux where THP is set to "madvise" or "always").
    Its first touch then takes one page fault per 2 MiB instead of one per 4 KiB, and the
    ``O_DIRECT`` writes from it pin fewer pages. Small tensors, and systems without
    ``madvise``, get ``torch.empty``. The map lives as long as the tensor."""
    nbytes = numel * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_MIN_BYTES or advice is None:
        return torch.empty(numel, dtype=dtype)
    # a length in whole huge pages: Linux then also places the map on a huge-page boundary
    size = -(-nbytes // HUGE_PAGE_MIN_BYTES) * HUGE_PAGE_MIN_BYTES
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP turned off ("never"): ordinary pages
        region.madvise(advice)
    return torch.frombuffer(region, dtype=dtype, count=numel)


class DirectIO:
    """The output I/O the engine uses while the accelerator runs (``checkpoint.PlainIO``'s
    interface): ``open(path)`` a stream with ``write``/``close``/``abort``; ``empty(numel,
    dtype)`` a flat buffer; ``align``: a tensor whose address has its file position's remainder
    modulo ``align`` is written from its own memory (``BufferPool.take``'s ``phase``)."""

    align = DIRECT_ALIGN
    open = DirectStream
    empty = staticmethod(huge_page_empty)
