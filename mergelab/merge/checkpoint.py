"""Merging Hugging Face checkpoint folders, streamed tensor by tensor.

    merge_checkpoints("ties", "base/", ["math/", "code/"], output="merged/",
                      params={"density": 0.2, "lambda": 1.0})

Inputs are model folders as ``save_pretrained`` writes them: ``config.json`` plus
``model.safetensors`` or sharded ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``. The output is such a folder too (always sharded, with an index),
with ``config.json``, ``generation_config.json`` and the tokenizer files copied from the base, so
``AutoModelForCausalLM.from_pretrained(output)`` loads it.

How memory stays bounded by a few tensors, not by the model, and the merge near the I/O limit:

* every input tensor is memory-mapped on its own, just its pages (the offsets come from the
  shard's safetensors header, which ``safe_open`` also validates), populated at once and
  unmapped when the tensor is done: nothing is copied to read it, no shard is mapped whole
  (mapped pages count toward the resident memory while mapped), and a shard shorter than its
  header says is an error, checked before mapping;
* methods with a fast path that takes stored inputs (the accelerator's: linear, task
  arithmetic, TIES, DARE, breadcrumbs) get the inputs in their stored dtype and cast them chunk
  by chunk, in cache, on every core (``ctx.dtype``), writing the rounded result straight into
  the output buffer (``ctx.out``): no float32 copy of a whole tensor exists. Other methods get
  the inputs cast to the compute dtype in reused buffers;
* each output shard's header is known before any tensor is merged (names, shapes and dtypes are
  fixed by the inputs), so shards are written front to back, one merged tensor at a time, with
  ordinary writes, each shard flushed to the disk when complete (:class:`PlainIO`); where the
  accelerator runs, with ``O_DIRECT`` where the file system allows it (its ``io.DirectStream``:
  the kernel neither copies the output into its page cache, which cost more CPU than a linear
  merge's arithmetic, nor keeps it there), from buffers in huge pages;
* with more than one core, such a fast path's tensors are merged whole, one per core, the
  next ones while the writer waits for the current one (the accelerator's ``scheduler.LookAhead``;
  a tensor over 1/(``WHOLE_SHARE`` · cores) of the model is merged in its turn on every core):
  at most the inputs of one tensor per core (and one large one) and ``OUTPUT_SLOTS`` + cores
  outputs are alive, each buffer the size of the largest tensor it has held. Otherwise each tensor
  is merged on every core in turn while a background thread maps (or reads, casts and checks)
  the next tensor's inputs (``PREFETCH_MAX_BYTES``): about two tensors' inputs and three outputs.
  Another thread writes the results behind the merge (``WRITE_BEHIND``);
* methods with a whole-model first pass (e.g. TIES with one global top-k threshold) get a
  ``make_iter()`` that streams the inputs again, as often as they need.

Everything is validated before anything is written: the same architecture, tensor names, shapes
and dtypes in every model, every shard present and readable (a truncated shard is named), every
shard an index names inside its model folder. NaN/Inf are checked per tensor while streaming; the
merge writes into a temporary folder that is moved into place only when complete (see
:mod:`mergelab.outputs`), so an error, Ctrl-C or SIGTERM leaves no folder that looks finished and
``--force`` never replaces a folder mergelab did not write. ``mergelab_merge.json`` records the
inputs' absolute paths (and the paths as given).

Embedding rows that differ only by vocabulary padding (``vocab_padding``):

* ``"error"`` (default) — refuse, naming the tensor and the row counts;
* ``"truncate"`` — merge the rows all models share (the first ``min(rows)``); rows beyond that are
  taken from the base unchanged (an expert's extra rows are dropped), so the output keeps the
  base's shape and vocabulary size (its config is copied). A tensor qualifies only if its shapes
  differ in dimension 0 alone and its name is an embedding or output head
  (:data:`mergelab.merge.validation.VOCAB_TENSOR_PATTERN`); the rule and its checks are shared
  with the in-memory engine (:mod:`mergelab.merge.validation`).

Tied embeddings: a model with ``tie_word_embeddings`` that stores no ``lm_head.weight`` is read as
if its ``lm_head.weight`` were its input embedding; the output stores what the base stores.

Recipes (:class:`TensorRecipe`, built by :mod:`mergelab.merge.mergekit_dialect`): an output tensor
may instead name its own inputs (any tensor of any model, so layers can be stacked and renamed),
its own parameters (gradients across layers, per-name filters) and a vocabulary alignment of its
rows (a tokenizer whose vocabulary differs from the models'). The streaming, buffers and checks
are the same.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import mmap
import os
import shutil
import struct
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from mergelab import vocabulary
from mergelab.outputs import atomic_output_dir, check_output_path

from ..progress import progress_bar
from . import accelerator
from .accelerator import io as accelerator_io
from .accelerator import kernels
from .accelerator.scheduler import OUTPUT_SLOTS, WRITE_BEHIND, LookAhead
from .model_card import MODEL_CARD_NAME, model_card
from .registry import (
    FastPath,
    MergeMethod,
    TensorContext,
    fast_path,
    get_merge_method,
    result_finite,
)
from .validation import (
    VOCAB_PADDING_RULES,
    MergeInputError,
    check_same_architecture,
    check_same_dtype,
    common_vocab_rows,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MERGE_RECORD_NAME = "mergelab_merge.json"
DEFAULT_SHARD_SIZE = 5 * 2**30  # bytes; transformers' default max_shard_size is "5GB" too

# Files a saved tokenizer consists of, with its chat template (copied beside a merge).
TOKENIZER_FILES = (*vocabulary.TOKENIZER_FILES, "chat_template.jinja", "chat_template.json")
# Files copied from the base folder into the output (besides the weights we write ourselves).
COPIED_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# (output head, input embedding) pairs that tie_word_embeddings makes one tensor.
TIED_PAIRS = (
    ("lm_head.weight", "model.embed_tokens.weight"),
    ("lm_head.weight", "transformer.wte.weight"),
)


def parse_size(size: int | str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000`` (bytes) -> bytes. Decimal units as transformers."""
    if isinstance(size, bool):
        raise ValueError(f"cannot read size {size!r}; use e.g. 5GB, 500MB or a byte count")
    if isinstance(size, int):
        nbytes = size
    else:
        text = str(size).strip().upper().replace(" ", "")
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
        factor = 1
        for unit, unit_factor in units.items():
            if text.endswith(unit):
                text, factor = text[: -len(unit)], unit_factor
                break
        else:
            text = text.removesuffix("B")
        try:
            value = float(text) * factor
            nbytes = int(value)
        except (ValueError, OverflowError):
            raise ValueError(
                f"cannot read size {size!r}; use e.g. 5GB, 500MB or a byte count"
            ) from None
    if nbytes <= 0:
        raise ValueError(f"size {size!r} must be positive (e.g. 5GB, 500MB or a byte count)")
    return nbytes


# ----------------------------------------------------------------------------------------------
# Reading: one tensor at a time.


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``file`` bytes ``[offset, offset + nbytes)``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path
    offset: int
    nbytes: int


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map the pages now, in the reader thread

# torch warns, once per process, that a tensor over a read-only buffer (a memory map here) could
# still be written to; the engine never writes to one, so the warning is spent here, silently.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise MergeInputError(f"{path}: not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise MergeInputError(f"{path}: not a safetensors file (header size {n} bytes)")
        header = f.read(n)
    try:
        return json.loads(header), 8 + n
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MergeInputError(f"{path}: not a safetensors file (unreadable header)") from None


class CheckpointFolder:
    """A Hugging Face model folder, read lazily: ``config``, ``tensors`` (name -> TensorInfo)."""

    def __init__(self, path: str | os.PathLike, label: str = "model"):
        self.path = Path(path)
        self.label = label
        if not self.path.is_dir():
            raise MergeInputError(f"{label} {self.path} is not a folder")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise MergeInputError(f"{label} {self.path} has no config.json")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise MergeInputError(f"{config_path}: not valid JSON ({exc})") from None
        self.tensors: dict[str, TensorInfo] = {}
        self._files: dict[Path, Any] = {}
        self._lock = threading.Lock()
        for shard, names in self._shards().items():
            self._read_shard_header(shard, names)

    # The weight files and, for an index, which names each must hold.
    def _shards(self) -> dict[Path, list[str] | None]:
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise MergeInputError(f"{index}: unreadable index ({exc})") from None
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict):
                found = "missing" if weight_map is None else type(weight_map).__name__
                raise MergeInputError(
                    f"{index}: 'weight_map' must map tensor names to shard files ({found})"
                )
            shards: dict[Path, list[str]] = {}
            confined: dict[Any, Path] = {}  # each file checked once (paths resolve slowly)
            for name, file in weight_map.items():
                if not isinstance(file, str) or file not in confined:
                    shard = self._confined_shard(index, name, file)
                    confined[file] = shard
                shards.setdefault(confined[file], []).append(name)
            for shard in shards:
                if not shard.is_file():
                    raise MergeInputError(
                        f"{self.label} {self.path}: shard {shard.name} listed in {INDEX_NAME} "
                        "is missing"
                    )
            return dict(shards)
        single = self.path / SINGLE_NAME
        if single.is_file():
            return {single: None}
        if any(self.path.glob("*.bin")) or any(self.path.glob("*.pt")):
            raise MergeInputError(
                f"{self.label} {self.path} holds PyTorch pickles, not safetensors; "
                "re-save it with save_pretrained(..., safe_serialization=True)"
            )
        raise MergeInputError(f"{self.label} {self.path} has no {SINGLE_NAME} or {INDEX_NAME}")

    def _confined_shard(self, index: Path, name: str, file: Any) -> Path:
        """The shard an index entry names, refused unless it lies in this folder: a plain relative
        path, no "..", no link leading out (except a Hugging Face cache snapshot's links to its
        repository's ``blobs/``)."""
        where = f"{index}: entry {name!r} -> {file!r}"
        if not isinstance(file, str) or not file:
            raise MergeInputError(f"{where}: a shard must be a file name")
        rel = Path(file)
        if rel.is_absolute() or ".." in rel.parts:
            raise MergeInputError(f"{where} points outside the model folder {self.path}")
        shard = self.path / rel
        if shard.exists():
            root = self.path.resolve()
            target = shard.resolve()
            blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
            inside = root in target.parents
            cached = blobs is not None and blobs in target.parents and shard.parent == self.path
            if not (inside or cached):
                raise MergeInputError(
                    f"{where} resolves to {target}, outside the model folder {self.path}"
                )
        return shard

    def _read_shard_header(self, shard: Path, expected: list[str] | None) -> None:
        header, data_start = read_safetensors_header(shard)
        # The library's own check too: it refuses a file its header does not fully describe.
        try:
            with safe_open(shard, framework="pt"):
                pass
        except Exception as exc:  # SafetensorError is not importable under a stable name
            raise MergeInputError(
                f"{self.label} {self.path}: shard {shard.name} is unreadable or truncated ({exc})"
            ) from None
        header.pop("__metadata__", None)
        size = shard.stat().st_size
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if data_start + end > size:
                raise MergeInputError(f"{self.label}: shard {shard.name} is truncated at {name!r}")
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise MergeInputError(
                    f"{shard}: tensor {name!r} has unsupported dtype {entry['dtype']}"
                )
            self.tensors[name] = TensorInfo(
                name, tuple(entry["shape"]), dtype, shard, data_start + begin, end - begin
            )
        missing = sorted(set(expected or ()) - set(header))
        if missing:
            raise MergeInputError(
                f"{self.label} {self.path}: {INDEX_NAME} puts {missing[:3]} in {shard.name}, "
                "which does not hold them"
            )

    @property
    def ties_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def resolve_name(self, name: str) -> str:
        """The stored tensor that plays ``name``: itself, or the embedding for a tied head."""
        if name in self.tensors:
            return name
        if self.ties_embeddings:
            for head, embedding in TIED_PAIRS:
                if name == head and embedding in self.tensors:
                    return embedding
        raise KeyError(name)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[self.resolve_name(name)]

    def read(self, name: str, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor, read from its shard with a positioned read of exactly its bytes; into
        ``buffer`` (uint8, ``nbytes`` long) when given, so the caller can reuse memory."""
        info = self.info(name)
        f = self._files.get(info.file)
        if f is None:
            f = self._files[info.file] = open(info.file, "rb", buffering=0)
        if buffer is None:
            buffer = torch.empty(info.nbytes, dtype=torch.uint8)
        with self._lock:  # the merge reads the next tensor in a background thread
            f.seek(info.offset)
            got = f.readinto(buffer.numpy()) if info.nbytes else 0
        if got != info.nbytes:
            raise MergeInputError(
                f"{self.label}: shard {info.file.name} ended inside tensor {info.name!r}"
            )
        return buffer.view(info.dtype).reshape(info.shape)

    def map(self, name: str, populate: bool = True) -> torch.Tensor:
        """One tensor as a read-only view of its bytes in the page cache: a memory map of just
        its pages, filled by the kernel at once (``MAP_POPULATE``; with ``populate`` off, page by
        page as they are first read, for a pass that reads few of them), so nothing is copied to
        read it. The map is released when the last view of it is dropped; only the engine's casts
        read it, and nothing may write to it."""
        info = self.info(name)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        with self._lock:  # several threads map tensors
            f = self._files.get(info.file)
            if f is None:
                f = self._files[info.file] = open(info.file, "rb", buffering=0)
        # a page past the end of the file would be SIGBUS, not an error: check the size first
        if os.fstat(f.fileno()).st_size < info.offset + info.nbytes:
            raise MergeInputError(
                f"{self.label}: shard {info.file.name} ended inside tensor {info.name!r}"
            )
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY
        length = info.offset + info.nbytes - start
        mapping = kernels.file_mapping()
        if mapping is not None:  # Python's mmap holds the GIL while it maps: the other threads wait
            mapped = mapping(f.fileno(), start, length, populate)
        else:
            mapped = mmap.mmap(
                f.fileno(),
                length,
                flags=mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0),
                prot=mmap.PROT_READ,
                offset=start,
            )
        flat = torch.frombuffer(
            mapped, dtype=torch.uint8, count=info.nbytes, offset=info.offset - start
        )
        return flat.view(info.dtype).reshape(info.shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> CheckpointFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# Writing: shards whose headers are fixed before the first tensor is merged.


@dataclass(frozen=True)
class OutputTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: Sequence[OutputTensor], shard_size: int) -> list[list[OutputTensor]]:
    """Greedy split, in order, into shards of at most ``shard_size`` bytes (a bigger tensor gets
    a shard of its own), as transformers' ``max_shard_size`` does."""
    shards: list[list[OutputTensor]] = [[]]
    used = 0
    for t in tensors:
        if shards[-1] and used + t.nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards if shards[0] else []


def shard_file_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class FileStream:
    """Writes a file front to back with ordinary writes (through the page cache), and flushes
    it to the disk (``fsync``) when closed: the engine's own way, used without the accelerator
    (whose ``DirectStream`` writes the same bytes with ``O_DIRECT``)."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)

    def write(self, data: torch.Tensor | bytes) -> None:
        """Append ``data`` (bytes, or a tensor's bytes)."""
        if isinstance(data, torch.Tensor):
            data = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:  # one write() call writes at most ~2 GiB on Linux
            done += os.write(self._fd, view[done:])

    def close(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PlainIO:
    """The engine's output I/O without the accelerator: ``open(path)`` a :class:`FileStream`,
    ``empty(numel, dtype)`` a flat ``torch.empty`` buffer, and no placement (``align`` None).
    The accelerator's ``io.DirectIO`` has the same three names (``O_DIRECT`` writes, huge-page
    buffers placed at their file position's remainder); the bytes written are the same."""

    align: int | None = None
    open = FileStream

    @staticmethod
    def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)


def output_io() -> type[PlainIO] | type[accelerator_io.DirectIO]:
    """The accelerator's output I/O where it runs (:func:`mergelab.merge.accelerator.enabled`),
    else :class:`PlainIO`."""
    return accelerator_io.DirectIO if accelerator.enabled() else PlainIO


def shard_layout(
    tensors: Sequence[OutputTensor], metadata: dict[str, str]
) -> tuple[bytes, dict[str, int]]:
    """A safetensors file's JSON header for ``tensors`` (in order) and where each tensor's bytes
    start in the file."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": DTYPE_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data start to 8 bytes
    start = 8 + len(raw)
    return raw, {t.name: start + header[t.name]["data_offsets"][0] for t in tensors}


class ShardWriter:
    """Writes one safetensors file front to back: header first, then each tensor as produced
    (through ``io.open``'s stream: :class:`PlainIO`'s, or the accelerator's)."""

    def __init__(
        self,
        path: Path,
        tensors: Sequence[OutputTensor],
        metadata: dict[str, str],
        io: type[PlainIO] | type[accelerator_io.DirectIO] = PlainIO,
    ):
        self.path = path
        self.expected = list(tensors)
        raw, self.positions = shard_layout(self.expected, metadata)
        self._file = io.open(path)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self.expected[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(
                f"shard writer expected {spec.name} {spec.shape} {spec.dtype}, got "
                f"{name} {tuple(tensor.shape)} {tensor.dtype}"
            )
        self._file.write(tensor)
        self._next += 1

    def abort(self) -> None:
        self._file.abort()

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.expected):
            raise RuntimeError(
                f"{self.path.name}: {len(self.expected) - self._next} tensors unwritten"
            )


# Writes run in one background thread, at most this many tensors behind the merge, so disk time
# overlaps compute (WRITE_BEHIND, and the OUTPUT_SLOTS = WRITE_BEHIND + 1 buffers a producer
# that reuses them needs, are the scheduler's: accelerator/scheduler.py).
SHARD_METADATA = {"format": "pt"}  # the header metadata of every output shard
PASS_SLOT = "-pass"  # the buffer set of the inputs of a method's whole-model passes (iter_inputs)


def write_sharded(
    folder: Path,
    tensors: Sequence[OutputTensor],
    produce: Callable[[OutputTensor, int], torch.Tensor],
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
    description: str = "merging",
    expect: Callable[[list[int | None]], None] | None = None,
    io: type[PlainIO] | type[accelerator_io.DirectIO] | None = None,
) -> dict[str, Any]:
    """Write ``produce(t, phase)`` for every ``t`` in order into shards plus
    ``model.safetensors.index.json``, through ``io`` (default :func:`output_io`). ``phase`` is
    ``t``'s position in its file modulo ``io.align`` (None where ``io`` places nothing): a
    result at an address with that remainder is written straight from its memory
    (:meth:`BufferPool.take`). ``expect``, if given, is called once before anything is produced
    with every tensor's phase, in order (so a producer can start on tensors ahead).

    ``produce`` is called in order; when it is called for tensor ``k``, the writes of tensors
    ``≤ k − OUTPUT_SLOTS`` have finished (so it may reuse ``OUTPUT_SLOTS`` rotating buffers). At
    most ``WRITE_BEHIND + 1`` produced tensors are alive at once. Returns the index dict.
    """
    io = io or output_io()

    def phase(position: int) -> int | None:
        return position % io.align if io.align else None

    shards = plan_shards(tensors, shard_size)
    names = shard_file_names(len(shards))
    if expect is not None:
        positions = [shard_layout(shard, SHARD_METADATA)[1] for shard in shards]
        expect([phase(where[t.name]) for shard, where in zip(shards, positions) for t in shard])
    weight_map: dict[str, str] = {}
    total = sum(t.nbytes for t in tensors)
    bar = progress_bar(total=len(tensors), desc=description, unit="tensor", enabled=progress)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mergelab-writer")
    pending: deque[Future] = deque()

    def drain(keep: int) -> None:
        while len(pending) > keep:
            pending.popleft().result()  # re-raises a write error here

    try:
        for shard, file_name in zip(shards, names):
            writer = ShardWriter(folder / file_name, shard, SHARD_METADATA, io)
            try:
                for t in shard:
                    drain(WRITE_BEHIND)
                    result = produce(t, phase(writer.positions[t.name]))
                    pending.append(executor.submit(writer.write, t.name, result))
                    weight_map[t.name] = file_name
                    bar.update(1)
                drain(0)
            except BaseException:
                futures_wait(pending)  # let queued writes finish before the file is closed
                pending.clear()
                writer.abort()
                raise
            writer.close()
    finally:
        executor.shutdown(wait=True)
        bar.close()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def copy_model_files(
    source: Path, destination: Path, names: Sequence[str] = COPIED_FILES
) -> list[str]:
    """Copy config, generation config and tokenizer files (those of ``names`` that exist)."""
    copied = []
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)
            copied.append(name)
    return copied


# ----------------------------------------------------------------------------------------------
# The merge plan: everything validated, nothing written.


@dataclass(frozen=True)
class TensorSource:
    """One input of a recipe: the tensor ``name`` of the model folder ``folder``."""

    folder: CheckpointFolder
    name: str


# (input tensors in the input dtype, base first when there is one) -> the same, rows aligned
RowAlignment = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class TensorRecipe:
    """How one output tensor is made when it is not "the tensor of the same name in every model,
    merged with one parameter set": its inputs, its resolved parameters (as
    :meth:`MergeMethod.resolve` returns them) and an optional vocabulary row alignment."""

    base: TensorSource | None
    experts: list[TensorSource]
    params: dict[str, Any]
    per_model: dict[str, list[float]]
    align: RowAlignment | None = None

    @property
    def sources(self) -> list[TensorSource]:
        return ([self.base] if self.base is not None else []) + list(self.experts)


@dataclass
class CheckpointMergePlan:
    """What a merge will do; built by :func:`plan_checkpoint_merge` (which validates the inputs)."""

    method: MergeMethod
    params: dict[str, Any]
    per_model: dict[str, list[float]]
    template: CheckpointFolder  # the base, or the first model when no base is given
    base: CheckpointFolder | None
    experts: list[CheckpointFolder]
    tensors: list[OutputTensor]
    compute_dtype: torch.dtype
    seed: int
    vocab_padding: str
    # name -> number of rows merged, for embedding-like tensors truncated to the common vocabulary
    truncated_rows: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    # Output name -> recipe (see TensorRecipe); None: same name in every model, one parameter set.
    recipes: dict[str, TensorRecipe] | None = None
    # Inputs are rounded to this dtype before the compute cast (mergekit's ``dtype``), if set.
    input_dtype: torch.dtype | None = None
    # The merged tensor is rounded to this dtype before the output cast, if set (mergekit's
    # float32-internal methods hand back the input dtype, then cast to ``out_dtype``).
    round_to: torch.dtype | None = None
    # Entries to set in the output's config.json (e.g. num_hidden_layers after layer stacking).
    config_updates: dict[str, Any] = field(default_factory=dict)
    # Extra entries of mergelab_merge.json (e.g. the dialect and the config as given).
    record: dict[str, Any] = field(default_factory=dict)
    # The config as the user wrote it, quoted in the model card (README.md).
    config_text: str | None = None
    # Writes further files into the output folder after config and tokenizer files are copied
    # (e.g. a rebuilt tokenizer); ``copied_files`` are the files copied from the template.
    finish: Callable[[Path], None] | None = None
    copied_files: tuple[str, ...] = COPIED_FILES
    other_folders: list[CheckpointFolder] = field(default_factory=list)  # recipes' other inputs
    buffers: BufferPool | None = None  # reused across tensors by merge_tensor
    # Each tensor's phase in the output (write_sharded's ``expect``), once known
    phases: list[int] | None = None
    # Which tensor is read and merged when (merge_tensor): made at the first call
    scheduler: LookAhead | InTurn | None = None

    @property
    def fast(self) -> FastPath | None:
        """The method's active fast path (the accelerator's), if any."""
        return fast_path(self.method.name)

    @property
    def fast_stored(self) -> bool:
        """Whether a fast path takes the inputs in their stored dtype (``ctx.dtype``, ``ctx.out``)."""
        fast = self.fast
        return fast is not None and fast.stored_dtype

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def folders(self) -> list[CheckpointFolder]:
        """Every model folder the plan reads (each once)."""
        folders = [self.template, *self.experts, *self.other_folders]
        if self.base is not None:
            folders.append(self.base)
        return list({id(f): f for f in folders}.values())

    def describe(self) -> dict[str, Any]:
        """A JSON-able record of the merge (written into the output as ``mergelab_merge.json``)."""
        return {
            "method": self.method.name,
            "params": self.params,
            "per_model_params": self.per_model,
            "base": str(self.base.path.resolve()) if self.base is not None else None,
            "models": [str(e.path.resolve()) for e in self.experts],
            "as_given": {  # the paths as typed (relative ones to the merge's working folder)
                "base": str(self.base.path) if self.base is not None else None,
                "models": [str(e.path) for e in self.experts],
            },
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "seed": self.seed,
            "vocab_padding": self.vocab_padding,
            "truncated_rows": self.truncated_rows,
            "n_tensors": len(self.tensors),
            "output_bytes": self.output_bytes,
            **self.record,
        }

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
            self.scheduler = None
        for folder in self.folders:
            folder.close()

    # -- reading inputs for one output tensor --------------------------------------------------

    def inputs(
        self,
        name: str,
        pool: BufferPool | None = None,
        slot: str = "",
        *,
        mapped: bool = False,
        populate: bool = True,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(base tensor, expert tensors) for ``name`` as stored (checkpoint dtype), rows cut to
        the common vocabulary where the vocab-padding rule applies. With ``pool`` the tensors
        live in its reusable buffers (valid until the next call); with ``mapped`` they are
        read-only views of the page cache (:meth:`CheckpointFolder.map`, ``populate`` as there),
        which must not be written to."""

        def read(folder: CheckpointFolder, key: str, source: str = name) -> torch.Tensor:
            if mapped:
                return folder.map(source, populate)
            nbytes = folder.info(source).nbytes
            buffer = pool.take(f"read-{key}{slot}", (nbytes,), torch.uint8) if pool else None
            return folder.read(source, buffer)

        recipe = self.recipes.get(name) if self.recipes is not None else None
        if recipe is not None:
            base = read(recipe.base.folder, "base", recipe.base.name) if recipe.base else None
            experts = [read(s.folder, str(i), s.name) for i, s in enumerate(recipe.experts)]
            return base, experts
        rows = self.truncated_rows.get(name)
        base = read(self.base, "base") if self.base is not None else None
        experts = [read(e, str(i)) for i, e in enumerate(self.experts)]
        if rows is not None:
            base = base[:rows] if base is not None else None
            experts = [e[:rows] for e in experts]
        return base, experts

    def iter_inputs(
        self, stored: bool = False, sparse: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None, list[torch.Tensor]]]:
        """Every floating tensor as (name, base, experts) — one pass: in the compute dtype, in
        reused buffers (each valid until the next is yielded), or with ``stored`` in their stored
        dtype as read-only memory maps (for a fast path's prepare pass, which casts
        chunk by chunk), with ``sparse`` not populated ahead (a pass that reads few pages)."""
        for t in self.tensors:
            loaded = self.load(t, PASS_SLOT, check=False, stored=stored, sparse=sparse)
            if loaded is not None:
                yield (t.name, *loaded)

    def streams_stored(self, name: str) -> bool:
        """Whether tensor ``name`` reaches the method in its stored dtype (``ctx.dtype`` set): a
        fast path that takes them so, and no rounding or row alignment of the inputs before the
        merge."""
        if not self.fast_stored:
            return False
        recipe = self.recipes.get(name) if self.recipes is not None else None
        if recipe is not None and recipe.align is not None:
            return False
        return self.input_dtype is None or self._stored_in_input_dtype(name)

    def _stored_in_input_dtype(self, name: str) -> bool:
        """Whether every input of tensor ``name`` is stored in ``input_dtype`` (rounding the
        inputs to it changes nothing)."""
        recipe = self.recipes.get(name) if self.recipes is not None else None
        if recipe is not None:
            sources = [(s.folder, s.name) for s in recipe.sources]
        else:
            sources = [(f, name) for f in self._input_folders(name)]
        return all(f.info(n).dtype == self.input_dtype for f, n in sources)

    def load(
        self,
        t: OutputTensor,
        slot: str = "",
        *,
        check: bool = True,
        stored: bool | None = None,
        sparse: bool = False,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """Inputs of ``t``, memory-mapped (with ``sparse``, stored ones are not populated ahead:
        :meth:`CheckpointFolder.map`); ``None`` for a non-floating tensor. They stay mapped in
        their stored dtype when ``stored`` (default: :meth:`streams_stored`), else they are cast
        to the compute dtype in the pool's buffers (set ``slot``) and checked for NaN/Inf while
        they are copied (unless ``check`` is off). Stored inputs are checked after the merge
        (:meth:`_check_inputs`): the method's compiled loop sees every entry anyway."""
        pool = self._pool
        base, experts = self.inputs(t.name, mapped=True, populate=not (sparse and stored))
        reference = base if base is not None else experts[0]
        if not reference.is_floating_point():
            return None
        if stored is None:
            stored = self.streams_stored(t.name)
        base, experts = self._as_inputs(t.name, base, experts)
        if stored:
            return base, experts
        folders = self._input_folders(t.name)

        def cast(x: torch.Tensor, key: str, folder: CheckpointFolder) -> torch.Tensor:
            buffer = pool.take(f"compute-{key}{slot}", x.shape, self.compute_dtype)
            if not kernels.parallel_copy_(buffer, x, check="dst" if check else None):
                raise _nonfinite_input(t.name, folder)
            return buffer

        if base is not None:
            base = cast(base, "base", folders[0])
            folders = folders[1:]
        experts = [cast(e, str(i), f) for i, (e, f) in enumerate(zip(experts, folders))]
        return base, experts

    def _input_folders(self, name: str) -> list[CheckpointFolder]:
        """The folders tensor ``name``'s inputs come from: the base's (if any), then each
        expert's."""
        recipe = self.recipes.get(name) if self.recipes is not None else None
        if recipe is not None:
            return [s.folder for s in recipe.sources]
        return ([] if self.base is None else [self.base]) + list(self.experts)

    def _check_inputs(
        self,
        t: OutputTensor,
        base: torch.Tensor | None,
        experts: list[torch.Tensor],
        checks: Any,
    ) -> None:
        """NaN/Inf in stored inputs is an error naming the model: from what the method's compiled
        loop saw of these very tensors (``checks``), else by a pass over them; either way each
        input is looked at alone only to name the one at fault."""
        inputs = ([] if base is None else [base]) + list(experts)
        if checks is not None and checks.covers_inputs(inputs) and checks.inputs_finite:
            return
        for x, folder in zip(inputs, self._input_folders(t.name)):
            if not kernels.all_finite(x):
                raise _nonfinite_input(t.name, folder)

    def _as_inputs(
        self, name: str, base: torch.Tensor | None, experts: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Inputs rounded to ``input_dtype`` (if set), then rows aligned (if the recipe says)."""
        if self.input_dtype is not None:
            base = base.to(self.input_dtype) if base is not None else None
            experts = [e.to(self.input_dtype) for e in experts]
        recipe = self.recipes.get(name) if self.recipes is not None else None
        if recipe is not None and recipe.align is not None:
            aligned = recipe.align(([base] if base is not None else []) + experts)
            base, experts = (aligned[0], aligned[1:]) if base is not None else (None, aligned)
        return base, experts

    def expect_phases(self, phases: list[int]) -> None:
        """Every tensor's phase in the output, in plan order (:func:`write_sharded`'s
        ``expect``): with it, :meth:`merge_tensor` may merge tensors ahead."""
        self.phases = list(phases)

    def merge_tensor(self, t: OutputTensor, phase: int | None = None) -> torch.Tensor:
        """The merged tensor ``t``, in its output dtype; NaN/Inf in an input or the result is an
        error naming the tensor and the model. ``phase``: as :func:`write_sharded` passes it,
        the remainder the result's address should have (:meth:`BufferPool.take`).

        Called in plan order (as :func:`write_sharded` does). Which tensor is read and merged
        when, and on which thread, is the scheduler's: the accelerator's look-ahead
        (:class:`mergelab.merge.accelerator.scheduler.LookAhead`) where it runs, else
        :class:`InTurn`. Either way every tensor is merged by the same call
        (:meth:`merge_loaded`), so the results are the same.
        """
        if self.scheduler is None:
            self.scheduler = LookAhead(self) if accelerator.enabled() else InTurn(self)
        return self.scheduler.merge_tensor(t, phase)

    def _context(self, t: OutputTensor) -> TensorContext:
        """Tensor ``t``'s context for the method (``dtype`` set when it gets stored inputs)."""
        ctx = TensorContext(name=t.name, seed=self.seed, stats=self.stats)
        if self.streams_stored(t.name):
            ctx.dtype = self.compute_dtype
        return ctx

    def _params(self, t: OutputTensor) -> dict[str, Any]:
        """The method's parameters for tensor ``t`` (a recipe's own, else the plan's)."""
        recipe = self.recipes.get(t.name) if self.recipes is not None else None
        params, per_model = (
            (recipe.params, recipe.per_model) if recipe else (self.params, self.per_model)
        )
        return {**params, **per_model}

    def merge_loaded(
        self,
        t: OutputTensor,
        loaded: tuple[torch.Tensor | None, list[torch.Tensor]] | None,
        slot: str,
        phase: int | None = None,
        ahead: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Merge the loaded inputs of ``t`` into the pool's buffer ``slot`` (output dtype,
        placed at ``phase``); ``ahead``: the method's statistics of them (:meth:`_load_ahead`)."""
        recipe = self.recipes.get(t.name) if self.recipes is not None else None
        if loaded is None:  # integer buffers: the base's (a recipe's first input's), unchanged
            if recipe is not None:
                first = recipe.sources[0]
                return first.folder.read(first.name).to(t.dtype)
            return self.template.read(t.name).to(t.dtype)
        base, experts = loaded
        pool = self._pool
        ctx = self._context(t)
        if ahead:
            ctx.stats = {**self.stats, **ahead}
        rows = self.truncated_rows.get(t.name)
        stored = self.streams_stored(t.name)
        if stored:  # the inputs are checked after the merge
            whole = rows is None or t.shape[0] <= rows
            if whole and self.round_to in (None, t.dtype):  # rounded straight into the output
                ctx.out = pool.take(slot, t.shape, t.dtype, phase)
        # Finiteness of the result is checked below (while it is copied out, without ctx.out),
        # after the inputs': NaN in an input is reported as the input's.
        try:
            merged = self.method.apply(base, experts, ctx, self._params(t), check_finite=False)
        except Exception:
            if stored:  # NaN in an input may be what the method tripped over: say so first
                self._check_inputs(t, base, experts, None)
            raise
        if stored:
            self._check_inputs(t, base, experts, ctx.checks)
        if ctx.out is not None:
            if not result_finite(merged, ctx):
                raise self.method.nonfinite_error(t.name)
            return ctx.out
        if self.round_to is not None:
            merged = merged.to(self.round_to)
        if rows is not None and t.shape[0] > rows:  # the template's extra vocabulary rows
            if not kernels.all_finite(merged):
                raise self.method.nonfinite_error(t.name)
            return torch.cat([merged.to(t.dtype), self.template.read(t.name)[rows:].to(t.dtype)])
        out = pool.take(slot, merged.shape, t.dtype, phase)
        if not kernels.parallel_copy_(out, merged, check="src"):  # cast and check on every core
            raise self.method.nonfinite_error(t.name)
        return out

    @property
    def _pool(self) -> BufferPool:
        if self.buffers is None:
            self.buffers = BufferPool(output_io())
        return self.buffers


class BufferPool:
    """Reusable flat buffers, one per slot (e.g. "read-0", "compute-base", "output").

    A fresh large tensor costs a page fault per 4 KiB page on first touch, every time (the
    allocator returns big blocks to the OS); reusing buffers made the per-tensor copies ~2x
    faster here. The buffers come from ``io.empty`` (:class:`PlainIO`: ``torch.empty``; the
    accelerator's: huge pages for 2 MiB and more). A tensor taken from a slot is valid until the
    slot is taken again.
    """

    def __init__(self, io: type[PlainIO] | type[accelerator_io.DirectIO] = PlainIO) -> None:
        self.io = io
        self._flat: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._lock = threading.Lock()  # the reader thread takes slots too

    def take(
        self,
        slot: str,
        shape: Sequence[int] | torch.Size,
        dtype: torch.dtype,
        phase: int | None = None,
    ) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` in slot ``slot``'s memory. With ``phase`` (a byte
        offset modulo ``io.align``, where the pool's I/O has one) its address has that remainder
        too, so the accelerator's stream writing it at a file position with that remainder writes
        it straight from this memory (where the dtype's alignment allows)."""
        n = math.prod(shape)
        align = self.io.align
        if phase is None or not align:
            phase = None
            key, size = (slot, dtype), n
        else:  # bytes, with room to start at any remainder
            key, size = (f"{slot}@placed", torch.uint8), n * dtype.itemsize + align
        with self._lock:
            flat = self._flat.get(key)
            if flat is None or flat.numel() < size:
                flat = self._flat[key] = self.io.empty(size, key[1])
        if phase is None:
            return flat[:n].view(tuple(shape))
        start = (phase - flat.data_ptr()) % align
        if start % dtype.itemsize:  # the dtype cannot sit there: an ordinary buffer
            return self.take(slot, shape, dtype)
        return flat[start : start + n * dtype.itemsize].view(dtype).view(tuple(shape))

    def drop(self, suffix: str) -> None:
        """Let go of the buffers of the slots whose names end with ``suffix`` (their memory is
        freed once no tensor taken from them is alive)."""
        with self._lock:
            for key in [k for k in self._flat if k[0].removesuffix("@placed").endswith(suffix)]:
                del self._flat[key]


class InTurn:
    """The plain schedule of :meth:`CheckpointMergePlan.merge_tensor`: each tensor's inputs read
    (mapped, and cast), then merged, one tensor after the other."""

    def __init__(self, plan: CheckpointMergePlan) -> None:
        self.plan = plan
        self.produced = 0

    def merge_tensor(self, t: OutputTensor, phase: int | None = None) -> torch.Tensor:
        # write_sharded may still be writing the last WRITE_BEHIND outputs: rotate buffers
        self.produced += 1
        slot = f"output-{self.produced % OUTPUT_SLOTS}"
        return self.plan.merge_loaded(t, self.plan.load(t, "-0"), slot, phase)

    def close(self) -> None:
        pass


def _nonfinite_input(name: str, folder: CheckpointFolder) -> MergeInputError:
    return MergeInputError(f"tensor {name!r} in {folder.label} ({folder.path}) contains NaN or Inf")


def plan_checkpoint_merge(
    method: str | MergeMethod,
    base: str | os.PathLike | None,
    models: Sequence[str | os.PathLike],
    *,
    params: dict[str, Any] | None = None,
    per_model_params: dict[str, Any] | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    seed: int = 0,
    vocab_padding: str = "error",
) -> CheckpointMergePlan:
    """Open and validate every input; return the plan. Reads headers only, writes nothing.

    Raises :class:`MergeInputError` naming the model, file or tensor at the first problem.
    """
    m = get_merge_method(method) if isinstance(method, str) else method
    if not models:
        raise MergeInputError("merge needs at least one model besides the base")
    if m.needs_base and base is None:
        raise MergeInputError(f"merge method {m.name!r} needs a base model (--base)")
    if vocab_padding not in VOCAB_PADDING_RULES:
        raise ValueError(
            f"vocab_padding must be one of {VOCAB_PADDING_RULES}, not {vocab_padding!r}"
        )
    per_model_params = dict(per_model_params or {})
    if weights is not None:
        per_model_params["weight"] = list(weights)
    resolved, lists = m.resolve(len(models), params, per_model_params)

    base_folder = CheckpointFolder(base, "base") if base is not None else None
    experts = [CheckpointFolder(p, f"model {i}") for i, p in enumerate(models)]
    template = base_folder if base_folder is not None else experts[0]
    others = [f for f in [base_folder, *experts] if f is not None and f is not template]
    labels = [f"{f.label} ({f.path})" for f in [template, *others]]
    check_same_architecture(
        [f.config for f in [template, *others]], labels, vocab_padding=vocab_padding
    )

    # Tensor names: what the template stores (a tied head it omits is omitted in the output).
    names = list(template.tensors)
    for other in others:
        stored = set(other.tensors)
        if other.ties_embeddings:  # a tied head stored anyway is the embedding again
            stored -= {head for head, _ in TIED_PAIRS if head not in template.tensors}
        missing = [n for n in names if n not in other.tensors and _resolves(other, n) is None]
        extra = sorted(stored - set(names))
        if missing or extra:
            raise MergeInputError(
                f"{other.label} {other.path} does not match {template.label} {template.path}: "
                f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"extra tensors {extra[:5]}{'...' if len(extra) > 5 else ''}"
            )

    truncated: dict[str, int] = {}
    for name in names:
        ref = template.tensors[name]
        infos = [other.info(name) for other in others]
        # one dtype rule for every engine (the in-memory one calls the same function)
        check_same_dtype(name, [ref.dtype] + [i.dtype for i in infos], labels)
        # equal shapes, or rows to merge under the vocabulary padding rule (shared with the
        # in-memory engine), or an error naming the tensor and every model's shape
        rows = common_vocab_rows(
            name, [ref.shape] + [i.shape for i in infos], labels, vocab_padding
        )
        if rows is not None:
            truncated[name] = rows

    # Output in the template's storage order: sequential reads of each input shard.
    order = sorted(names, key=lambda n: (str(template.tensors[n].file), template.tensors[n].offset))
    tensors = []
    for name in order:
        ref = template.tensors[name]
        keep = out_dtype if (out_dtype is not None and ref.dtype.is_floating_point) else ref.dtype
        tensors.append(OutputTensor(name, ref.shape, keep))
    return CheckpointMergePlan(
        method=m,
        params=resolved,
        per_model=lists,
        template=template,
        base=base_folder,
        experts=experts,
        tensors=tensors,
        compute_dtype=dtype,
        seed=seed,
        vocab_padding=vocab_padding,
        truncated_rows=truncated,
    )


def plan_recipe_merge(
    method: str | MergeMethod,
    template: CheckpointFolder,
    outputs: Sequence[tuple[OutputTensor, TensorRecipe]],
    *,
    compute_dtype: torch.dtype = torch.float32,
    input_dtype: torch.dtype | None = None,
    round_to: torch.dtype | None = None,
    seed: int = 0,
) -> CheckpointMergePlan:
    """A plan whose output tensors each follow their own :class:`TensorRecipe`, in the order
    given. ``template`` provides config and tokenizer files. Every source must exist; sources
    must agree in shape with the output (unless the recipe aligns rows) and, without
    ``input_dtype``, in dtype. Methods with a whole-model first pass are refused (their one
    statistics pass cannot follow per-tensor parameters)."""
    m = get_merge_method(method) if isinstance(method, str) else method
    if any(m.has_first_pass({**r.params, **r.per_model}) for _, r in outputs):
        raise MergeInputError(
            f"merge method {m.name!r} needs a whole-model first pass, which per-tensor recipes "
            "(slices, gradients, filters) do not support"
        )
    folders = {id(template): template}
    for out, recipe in outputs:
        if not recipe.sources:
            raise MergeInputError(f"tensor {out.name!r} has no inputs")
        infos = []
        for source in recipe.sources:
            folders.setdefault(id(source.folder), source.folder)
            try:
                infos.append(source.folder.info(source.name))
            except KeyError:
                raise MergeInputError(
                    f"{source.folder.label} {source.folder.path} has no tensor {source.name!r} "
                    f"(needed for {out.name!r})"
                ) from None
        labels = [f"{s.folder.label} ({s.folder.path})" for s in recipe.sources]
        if input_dtype is None:
            check_same_dtype(out.name, [i.dtype for i in infos], labels)
        if recipe.align is None and any(i.shape != out.shape for i in infos):
            listing = ", ".join(f"{label} {i.shape}" for label, i in zip(labels, infos))
            raise MergeInputError(f"tensor {out.name!r}: shapes differ ({listing})")
    plan = CheckpointMergePlan(
        method=m,
        params={},
        per_model={},
        template=template,
        base=None,
        experts=[],
        tensors=[out for out, _ in outputs],
        compute_dtype=compute_dtype,
        seed=seed,
        vocab_padding="error",
        recipes={out.name: recipe for out, recipe in outputs},
        input_dtype=input_dtype,
        round_to=round_to,
    )
    plan.other_folders = [f for f in folders.values() if f is not template]
    return plan


def _resolves(folder: CheckpointFolder, name: str) -> str | None:
    try:
        return folder.resolve_name(name)
    except KeyError:
        return None


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Python's cyclic garbage collector ignores the objects that exist now (torch's and
    transformers' modules: hundreds of thousands) while the merge runs: each of its full
    collections walked them all, ~7% of a linear merge's CPU time in a profile."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_checkpoint_merge(
    plan: CheckpointMergePlan,
    output: str | os.PathLike,
    *,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Execute a plan: stream, merge and write into ``output`` (atomically)."""
    inputs = [f.path for f in plan.folders]
    shard_bytes = parse_size(shard_size)
    m = plan.method
    with _gc_frozen(), atomic_output_dir(output, force=force, inputs=inputs, kind="merge") as tmp:
        # Whole-model statistics first (e.g. a global top-k threshold); may stream many passes.
        if plan.recipes is None:  # recipes carry their own parameters, and need no first pass
            params = {**plan.params, **plan.per_model}
            if plan.fast_stored and plan.input_dtype is None:  # a fast path casts in cache
                stored = functools.partial(plan.iter_inputs, stored=True)
                plan.stats = m.compute_stats(
                    params, plan.iter_inputs, stored_iter=stored, dtype=plan.compute_dtype
                )
            else:
                plan.stats = m.compute_stats(params, plan.iter_inputs)
            # the passes' inputs, cast to the compute dtype (iter_inputs), are not needed again
            plan._pool.drop(PASS_SLOT)
        write_sharded(
            tmp,
            plan.tensors,
            plan.merge_tensor,
            shard_size=shard_bytes,
            progress=progress,
            description=f"merging ({m.name})",
            expect=plan.expect_phases,
        )
        copy_model_files(plan.template.path, tmp, plan.copied_files)
        _update_config(tmp, plan.config_updates)
        set_config_dtype(tmp, plan.tensors)
        if plan.finish is not None:
            plan.finish(tmp)
        record = plan.describe()
        (tmp / MERGE_RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
        card = model_card(record, name=Path(output).name, config_text=plan.config_text)
        (tmp / MODEL_CARD_NAME).write_text(card, encoding="utf-8")
    return Path(output)


def _update_config(folder: Path, updates: dict[str, Any]) -> None:
    """Set ``updates`` in the output's config.json (a dotted key sets a nested entry)."""
    config_path = folder / "config.json"
    if not updates or not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    for key, value in updates.items():
        *parents, last = key.split(".")
        entry = config
        for part in parents:
            entry = entry.setdefault(part, {})
        entry[last] = value
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def set_config_dtype(folder: Path, tensors: Sequence[OutputTensor]) -> None:
    """Record the stored floating dtype in config.json (transformers reads ``dtype``)."""
    config_path = folder / "config.json"
    floating = {t.dtype for t in tensors if t.dtype.is_floating_point}
    if not config_path.is_file() or len(floating) != 1:
        return
    config = json.loads(config_path.read_text())
    name = str(floating.pop()).removeprefix("torch.")
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    if config.get(key) != name:
        config[key] = name
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def merge_checkpoints(
    method: str | MergeMethod,
    base: str | os.PathLike | None,
    models: Sequence[str | os.PathLike],
    *,
    output: str | os.PathLike,
    params: dict[str, Any] | None = None,
    per_model_params: dict[str, Any] | None = None,
    weights: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    seed: int = 0,
    shard_size: int | str = DEFAULT_SHARD_SIZE,
    vocab_padding: str = "error",
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Merge checkpoint folders with a registered method, streamed; returns the output folder.

    ``dtype`` is the compute dtype (float32 default); each tensor is stored in its checkpoint
    dtype unless ``out_dtype`` is given. ``shard_size`` bounds each output shard (bytes or
    "2GB"). ``base`` may be ``None`` for methods that do not need one (``linear``); the first
    model's folder then provides config and tokenizer. See the module docstring for
    ``vocab_padding`` and tied embeddings.
    """
    check_output_path(output, force=force, inputs=[p for p in [base, *models] if p is not None])
    plan = plan_checkpoint_merge(
        method,
        base,
        models,
        params=params,
        per_model_params=per_model_params,
        weights=weights,
        dtype=dtype,
        out_dtype=out_dtype,
        seed=seed,
        vocab_padding=vocab_padding,
    )
    try:
        return run_checkpoint_merge(
            plan, output, shard_size=shard_size, force=force, progress=progress
        )
    finally:
        plan.close()
