"""Former home of the merge steps, kept so ``from mergelab.merge.ops import task_vectors`` (the
README's method example) still works: the steps live in :mod:`mergelab.merge.methods.steps`."""

from .methods.steps import *  # noqa: F403
from .methods.steps import task_vectors  # noqa: F401  (named: the README imports it)
