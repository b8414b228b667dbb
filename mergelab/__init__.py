"""mergelab: weight-space merges and logit composition of language models, compared in one harness."""

from .candidate import Candidate, Generation, GenerationSettings
from .model_candidate import ModelCandidate

__version__ = "0.1.0"
__all__ = ["Candidate", "Generation", "GenerationSettings", "ModelCandidate", "__version__"]
