"""The look-ahead scheduler of the streaming engine: which tensor is read and merged when, on
which thread, into which reused buffer. The results do not depend on it (every tensor is merged
by the same method call, whichever thread runs it); without the accelerator the engine merges
its tensors one after the other instead (``checkpoint.InTurn``).

With more than one core, when every tensor reaches a fast path in its stored dtype and every
output position is known, tensors are merged whole, one per chunk worker, the next ones while
the writer waits for the current one (:meth:`LookAhead._merge_ahead`); a tensor over
1/(``WHOLE_SHARE`` · cores) of the model is merged in its turn on every core. Otherwise each
tensor is merged on every core in turn while a background thread maps (or reads, casts and
checks) the next tensor's inputs (``PREFETCH_MAX_BYTES``) and computes the fast path's ``ahead``
statistics of them.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch

from . import chunks

# Writes run in one background thread at most this many tensors behind the merge (the engine's
# ``write_sharded``): a producer that reuses output buffers needs OUTPUT_SLOTS of them.
WRITE_BEHIND = 2
OUTPUT_SLOTS = WRITE_BEHIND + 1


# With tensors merged whole, one per chunk worker (LookAhead._merge_ahead), a tensor
# holding more than 1/(WHOLE_SHARE · workers) of the model's entries is merged on every core:
# 16 puts a 1B Llama's embedding and output head (3.3% each) there, which merged whole kept one
# core busy alone at the start and the end of the merge (docs/merge_performance.md).
WHOLE_SHARE = 16
# ... and while the writer wants tensor k, tensors up to k + MERGE_AHEAD · workers are merged or
# queued: with tensors of different sizes (a layer's 4M-entry MLP matrices beside its 0.5M-entry
# key and value projections), a window of one tensor per worker can leave a worker waiting while
# the other finishes a large one (docs/merge_performance.md).
MERGE_AHEAD = 2
# Inputs (all models, compute dtype) of at most this size are read ahead in the background; the
# two read-ahead buffer sets then add at most twice this to the peak memory.
PREFETCH_MAX_BYTES = 2**30


class LookAhead:
    """Merges a plan's tensors ahead of the writer (module docstring). ``plan`` is a
    ``checkpoint.CheckpointMergePlan``: its ``tensors`` in output order, ``phases`` (each
    tensor's position in the output modulo the direct-write alignment, once known),
    ``load(t, slot)``, ``merge_loaded(t, loaded, slot, phase, ahead)``, ``fast`` and
    ``streams_stored(name)``."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self._n_produced = 0
        self._order: dict[str, int] | None = None
        self._largest_numel: int | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._prefetched: tuple[int, Future] | None = None
        # Whether the fast path's ``ahead`` statistics are computed before the merge (on more
        # than one thread only: with one, the reader thread would be a second core working)
        self._ahead = False
        # The merges running ahead, one tensor each on a chunk worker thread: index -> future
        self._jobs: dict[int, Future] = {}
        self._next_job = 0
        self._next_turn = 0
        self._total_numel = 0  # the entries of all tensors (set with _whole_tensors)
        self._whole_tensors = False

    def close(self) -> None:
        futures_wait(list(self._jobs.values()))  # merges running ahead of one that failed
        self._jobs.clear()
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader, self._prefetched, self._order = None, None, None

    def merge_tensor(self, t: Any, phase: int | None = None) -> torch.Tensor:
        """The merged tensor ``t``, in its output dtype; NaN/Inf in an input or the result is an
        error naming the tensor and the model. ``phase``: as :func:`write_sharded` passes it,
        the remainder the result's address should have (:meth:`BufferPool.take`).

        Called in plan order (as :func:`write_sharded` does), on more than one thread, with
        every phase known (:meth:`expect_phases`) and the method taking every tensor in its
        stored dtype (a fast path's ``stored_dtype``): each tensor is read and merged whole on one chunk worker
        thread, the next ones on the others at the same time (:meth:`_merge_ahead`), so the
        cores need not wait for each other between the chunks of a tensor. Otherwise each
        tensor is merged on every core in turn, and the next tensor's inputs are read (mapped;
        cast and checked unless the method takes them in their stored dtype) in a background
        thread while this one is merged (two alternating buffer sets, except for the largest
        tensors, see ``_buffer_set``), and, with more than one thread, the method's ``ahead``
        statistics of them computed there too.
        """
        if self._order is None:
            self._order = {x.name: i for i, x in enumerate(self.plan.tensors)}
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mergelab-reader")
            self._whole_tensors = (
                torch.get_num_threads() > 1
                and self.plan.phases is not None
                and len(self.plan.phases) == len(self.plan.tensors)
                and all(self.plan.streams_stored(x.name) for x in self.plan.tensors)
            )
            self._total_numel = sum(math.prod(x.shape) for x in self.plan.tensors)
            self._ahead = (
                self.plan.fast is not None
                and self.plan.fast.ahead is not None
                and torch.get_num_threads() > 1
                and not self._whole_tensors
            )
        index = self._order[t.name]
        if self._whole_tensors:
            return self._merge_ahead(index, phase)
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == index:
            loaded, ahead = prefetched[1].result()
        else:
            if prefetched is not None:
                futures_wait([prefetched[1]])  # a background read must not outlive its turn
            loaded, ahead = self._load_ahead(t, self._buffer_set(index))
        if index + 1 < len(self.plan.tensors):
            slot = self._buffer_set(index + 1)
            if slot != "-large":  # large inputs are read in turn, not ahead
                future = self._loader.submit(self._load_ahead, self.plan.tensors[index + 1], slot)
                self._prefetched = (index + 1, future)
        # write_sharded may still be writing the last WRITE_BEHIND outputs: rotate buffers
        self._n_produced += 1
        slot = f"output-{self._n_produced % OUTPUT_SLOTS}"
        return self.plan.merge_loaded(t, loaded, slot, phase, ahead)

    def _merge_ahead(self, index: int, phase: int | None) -> torch.Tensor:
        """:meth:`merge_tensor` of tensor ``index`` with tensors merged ahead: the tensors up to
        ``index + MERGE_AHEAD · workers`` are each merged on one chunk worker thread
        (single-threaded, so the same result), in output buffers that rotate over
        ``OUTPUT_SLOTS + MERGE_AHEAD · workers`` slots (those write_sharded may still be writing,
        and those merged ahead). A tensor holding more than 1/(WHOLE_SHARE · workers) of all
        entries is merged in its turn on every core instead, so one large tensor never leaves the
        other cores idle."""
        workers = chunks.chunk_workers()
        n = torch.get_num_threads()
        if index != self._next_turn:  # not called in plan order: merge in turn from now on
            futures_wait(list(self._jobs.values()))
            self._jobs.clear()
            self._whole_tensors = False
            return self.merge_tensor(self.plan.tensors[index], phase)
        self._next_turn = index + 1

        def whole(j: int) -> bool:
            return WHOLE_SHARE * n * math.prod(self.plan.tensors[j].shape) <= self._total_numel

        ahead = MERGE_AHEAD * n
        while self._next_job <= index + ahead and self._next_job < len(self.plan.tensors):
            j = self._next_job
            if not whole(j) and j > index:
                break  # merged in its turn
            if whole(j):
                self._jobs[j] = workers.submit(self._merge_one, j, self.plan.phases[j], ahead)
            self._next_job += 1
        job = self._jobs.pop(index, None)
        if job is None:  # the same slots: one of them is free for it (see _merge_one)
            return self._merge_one(index, phase, ahead)
        return job.result()

    def _merge_one(self, index: int, phase: int | None, ahead: int) -> torch.Tensor:
        """Read and merge tensor ``index`` (inputs mapped in their stored dtype) into output
        slot ``index`` mod (OUTPUT_SLOTS + ``ahead``) (slots of their own: none that merging in
        turn rotates through)."""
        t = self.plan.tensors[index]
        slot = f"whole-output-{index % (OUTPUT_SLOTS + ahead)}"
        return self.plan.merge_loaded(t, self.plan.load(t), slot, phase)

    def _load_ahead(
        self, t: Any, slot: str
    ) -> tuple[tuple[torch.Tensor | None, list[torch.Tensor]] | None, dict[str, Any]]:
        """:meth:`load`, then the method's ``ahead`` statistics of the inputs (``{}`` without the
        hook, on one thread, or if it failed: the method then computes them itself, inside the
        merge, where its error is reported as usual, after the inputs' NaN/Inf check)."""
        loaded = self.plan.load(t, slot)
        if loaded is None or not self._ahead:
            return loaded, {}
        base, experts = loaded
        ctx = self.plan._context(t)
        try:
            return loaded, self.plan.fast.ahead(base, experts, ctx, self.plan._params(t))
        except Exception:
            return loaded, {}

    def _buffer_set(self, index: int) -> str:
        """Which buffers tensor ``index`` is loaded into: one of two alternating sets (so one can
        be read ahead while the other is merged), or a third set, not read ahead, for the
        largest tensors (inputs over half the largest's, e.g. embeddings, or over
        ``PREFETCH_MAX_BYTES``). Each set grows to the largest tensor it holds, so the three
        together hold at most about twice the largest tensor's inputs."""
        if self._largest_numel is None:
            self._largest_numel = max((math.prod(t.shape) for t in self.plan.tensors), default=0)
        numel = math.prod(self.plan.tensors[index].shape)
        recipe = (
            self.plan.recipes.get(self.plan.tensors[index].name)
            if self.plan.recipes is not None
            else None
        )
        n_inputs = (
            len(recipe.sources) if recipe else len(self.plan.experts) + (self.plan.base is not None)
        )
        size = numel * self.plan.compute_dtype.itemsize * n_inputs
        if size <= PREFETCH_MAX_BYTES and 2 * numel <= self._largest_numel:
            return f"-{index % 2}"
        return "-large"
