"""mergelab: weight-space merges and logit composition of language models, compared in one harness."""

import gc as _gc
from contextlib import nullcontext as _no_change

from . import errors as _errors

# As a command, Ctrl-C while torch is imported waits for the import, then ends the command in
# one line with exit code 130 (raised inside torch's C++ start-up it can abort the process).
_command = _errors.started_as_command()
if _command:
    _errors.exit_quietly_when_interrupted()

# Importing torch creates hundreds of thousands of objects, and each full collection Python
# runs while they are being created walks all of them: the collector waits until the imports
# are done.
# They are then moved to its oldest generation (freeze, then unfreeze: where two collections
# would have taken them anyway), so that the next two young collections do not each walk them
# all (docs/merge_performance.md); nothing stays frozen, and a process that had frozen objects
# of its own keeps them so.
_collecting = _gc.isenabled()
_frozen_before = _gc.get_freeze_count()
_gc.disable()
try:
    with _errors.interrupts_deferred() if _command else _no_change():
        from .candidate import Candidate, Generation, GenerationSettings
        from .model_candidate import ModelCandidate
finally:
    if not _frozen_before:
        _gc.freeze()
        _gc.unfreeze()
    if _collecting:
        _gc.enable()

__version__ = "0.1.0"
__all__ = ["Candidate", "Generation", "GenerationSettings", "ModelCandidate", "__version__"]
