"""The merge methods: each method's maths as plain torch, the specification of every merge.

* :mod:`.steps` — the steps methods are built from (task vectors, magnitude trims, DARE's drop
  and rescale, sign election, disjoint merge, ...), each a function you can test alone;
* :mod:`.interpolation` — spherical and Model Stock interpolation;
* :mod:`.standard` — linear, task arithmetic, TIES, DARE, breadcrumbs, slerp, Model Stock;
* :mod:`.mergekit` — the further methods mergekit users reach for (DELLA, SCE, nuslerp, ...).

Importing this package registers every method (:func:`mergelab.merge.registry.merge_method`).
Nothing here imports the engines or the accelerator.
"""

from . import interpolation, mergekit, standard, steps  # noqa: F401  (importing registers them)
from .standard import (
    breadcrumbs,
    dare_linear,
    dare_ties,
    linear,
    model_stock,
    slerp,
    task_arithmetic,
    ties,
)
from .steps import task_vectors

__all__ = [
    "breadcrumbs",
    "dare_linear",
    "dare_ties",
    "linear",
    "model_stock",
    "slerp",
    "task_arithmetic",
    "ties",
    "task_vectors",
]
