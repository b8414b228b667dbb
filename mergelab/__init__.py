"""mergelab: weight-space merges and logit composition of language models, compared in one harness."""

import gc as _gc

from . import errors as _errors

if _errors.started_as_command():  # Ctrl-C while torch is imported: one line, exit 130
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
