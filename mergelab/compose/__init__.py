"""Logit (probability-space) composition of a base and experts that share a vocabulary.

* :class:`Composition` — the formula (paper rule, weights, CFG, DExperts, proxy-tuning, PoE).
* :class:`ComposedDecoder` — a composition as a Candidate; ``ComposedDecoder.from_lora`` is the
  batched fast path for LoRA experts.
* :class:`SpeculativeDecoder` — a composition decoded speculatively: a cheap draft (by default
  the task-arithmetic merge) proposes, the composition verifies; same output distribution.
* :mod:`mergelab.compose.diagnostics` — per-token KL, active fractions, co-activity.
"""

from .composed import ComposedDecoder
from .diagnostics import CompositionDiagnostics, composition_diagnostics
from .eos import EOS_POLICIES
from .formula import Composition, Term, compose_logprobs
from .projective import ProjectivityReport, check_projectivity, project_onto_mask
from .speculative import SpeculativeDecoder, task_arithmetic_draft
from .vocab import check_same_tokenizer

__all__ = [
    "EOS_POLICIES",
    "ComposedDecoder",
    "Composition",
    "CompositionDiagnostics",
    "ProjectivityReport",
    "SpeculativeDecoder",
    "Term",
    "check_projectivity",
    "check_same_tokenizer",
    "compose_logprobs",
    "composition_diagnostics",
    "project_onto_mask",
    "task_arithmetic_draft",
]
