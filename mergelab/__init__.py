"""mergelab: weight-space merges and logit composition of language models, compared in one harness."""

from .candidate import Candidate, Generation, GenerationSettings

__version__ = "0.1.0"
__all__ = ["Candidate", "Generation", "GenerationSettings", "__version__"]
