"""mergelab: weight-space merges and logit composition of language models, compared in one harness."""

import gc as _gc

# Importing torch creates about a million objects, and each full collection Python runs while
# they are being created walks all of them: the collector waits until the imports are done.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from .candidate import Candidate, Generation, GenerationSettings
    from .model_candidate import ModelCandidate
finally:
    if _collecting:
        _gc.enable()

__version__ = "0.1.0"
__all__ = ["Candidate", "Generation", "GenerationSettings", "ModelCandidate", "__version__"]
