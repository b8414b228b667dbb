"""The optional accelerator: faster equivalents of some merge methods, bit for bit.

What it holds, none of which a method knows about:

* :mod:`.kernels` and ``_loops.c`` — compiled loops (C, built by ``pip install`` /
  ``python setup.py build_ext --inplace``) that fuse a method's per-entry steps into one pass
  per chunk, straight from bfloat16/float32 storage;
* :mod:`.chunks` — worker threads that run chunks on every core, single-threaded each;
* :mod:`.thresholds` and :mod:`.sampling` — exact k-th largest |τ| in fewer passes (a sampled
  first pass, then only the band that holds it);
* :mod:`.fast_paths` — the above registered as fast paths of linear, task arithmetic, TIES,
  DARE and breadcrumbs (:func:`mergelab.merge.registry.register_fast_path`).

It runs where the loops were built, unless switched off: ``MERGELAB_ACCELERATOR=off`` in the
environment, or :func:`set_enabled` (``False``). Off, every merge runs the plain torch methods
of :mod:`mergelab.merge.methods`, which give the same bits (tests/test_merge_kernels.py).
"""

from __future__ import annotations

from . import fast_paths, kernels
from .kernels import ENV_VAR

__all__ = ["ENV_VAR", "available", "enabled", "set_enabled"]


def available() -> bool:
    """Whether the compiled loops were built."""
    return kernels.available()


def enabled() -> bool:
    """Whether the accelerator runs: built, and not switched off."""
    return kernels.active()


def set_enabled(on: bool) -> None:
    """Switch the accelerator on or off for this process (the default comes from
    ``MERGELAB_ACCELERATOR``)."""
    kernels.enabled = bool(on)


fast_paths.register()
