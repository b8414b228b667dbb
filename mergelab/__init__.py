"""mergelab: weight-space merges and logit composition of language models, compared in one harness."""

import gc as _gc
import importlib as _importlib
from contextlib import nullcontext as _no_change

from . import errors as _errors

# As a command, Ctrl-C while torch is imported waits for the import, then ends the command in
# one line with exit code 130 (raised inside torch's C++ start-up it can abort the process).
_command = _errors.started_as_command()
if _command:
    _errors.exit_quietly_when_interrupted()

__version__ = "0.1.0"
__all__ = ["Candidate", "Generation", "GenerationSettings", "ModelCandidate", "__version__"]

# The protocol and ModelCandidate import torch (seconds): they load on first use, so that
# `mergelab --help` and the other commands' argument errors do not wait for torch.
_LAZY = {
    "Candidate": "mergelab.candidate",
    "Generation": "mergelab.candidate",
    "GenerationSettings": "mergelab.candidate",
    "ModelCandidate": "mergelab.model_candidate",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mergelab' has no attribute {name!r}")
    value = getattr(import_without_collecting(_LAZY[name]), name)
    globals()[name] = value
    return value


def import_without_collecting(module_name: str):
    """Import a module with the garbage collector paused.

    Importing torch creates hundreds of thousands of objects, and each full collection Python
    runs while they are being created walks all of them: the collector waits until the imports
    are done. They are then moved to its oldest generation (freeze, then unfreeze: where two
    collections would have taken them anyway), so that the next two young collections do not
    each walk them all (docs/merge_performance.md); nothing stays frozen, and a process that had
    frozen objects of its own keeps them so."""
    collecting = _gc.isenabled()
    frozen_before = _gc.get_freeze_count()
    _gc.disable()
    try:
        with _errors.interrupts_deferred() if _command else _no_change():
            return _importlib.import_module(module_name)
    finally:
        if not frozen_before:
            _gc.freeze()
            _gc.unfreeze()
        if collecting:
            _gc.enable()
