"""A testbed where task arithmetic *is* logit composition, and a gauge of how far real nets drift.

Synthetic factorised next-token tasks (:mod:`.tasks`), log-linear / MLP / linearised models
(:mod:`.models`), maximum-likelihood and tangent-space fine-tuning (:mod:`.train`) and the
measurements (:mod:`.measure`). Merges come from :mod:`mergelab.merge`, the composition rule from
:mod:`mergelab.compose`; ``studies/linear_testbed.py`` runs the whole study.
"""

from .measure import (
    context_logprobs,
    max_abs_logprob_difference,
    mean_kl,
    measure_against_composition,
    per_context_kl,
    task_accuracies,
)
from .models import (
    BlendedActivation,
    ContextFeatures,
    LinearizedModel,
    LogLinearModel,
    MLPModel,
    build_model,
)
from .tasks import (
    TaskFamily,
    all_contexts,
    make_task_family,
    next_token_counts,
    sample_sequences,
    task_targets,
)
from .train import finetune, fit_max_likelihood, mean_nll

__all__ = [
    "BlendedActivation",
    "ContextFeatures",
    "LinearizedModel",
    "LogLinearModel",
    "MLPModel",
    "TaskFamily",
    "all_contexts",
    "build_model",
    "context_logprobs",
    "finetune",
    "fit_max_likelihood",
    "make_task_family",
    "max_abs_logprob_difference",
    "measure_against_composition",
    "mean_kl",
    "mean_nll",
    "next_token_counts",
    "per_context_kl",
    "sample_sequences",
    "task_accuracies",
    "task_targets",
]
