"""Weight-space merges: a registry of per-tensor methods and engines that apply them."""

from . import methods  # noqa: F401  (registers the built-in methods)
from .registry import (
    MergeMethod,
    TensorContext,
    get_merge_method,
    list_merge_methods,
    merge_method,
    unregister_merge_method,
)
from .state_dict import merge_models, merge_state_dicts
from .validation import MergeInputError

__all__ = [
    "MergeInputError",
    "MergeMethod",
    "TensorContext",
    "get_merge_method",
    "list_merge_methods",
    "merge_method",
    "merge_models",
    "merge_state_dicts",
    "unregister_merge_method",
]
