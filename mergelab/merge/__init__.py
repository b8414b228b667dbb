"""Weight-space merges in three layers: the methods (``methods/``: plain torch maths, the
specification), the engines that stream checkpoints through them (``state_dict``, ``checkpoint``,
``lora``), and the optional accelerator (``accelerator/``: faster equivalents, the same bits).
docs/architecture.md draws the layers."""

from . import (
    accelerator,  # noqa: F401  (importing registers the fast paths)
    methods,  # noqa: F401  (importing registers the methods)
)
from .registry import (
    MergeMethod,
    TensorContext,
    UnknownMergeMethodError,
    get_merge_method,
    list_merge_methods,
    merge_method,
    unregister_merge_method,
)
from .state_dict import merge_models, merge_state_dicts
from .validation import VOCAB_PADDING_RULES, MergeInputError

__all__ = [
    "MergeInputError",
    "MergeMethod",
    "TensorContext",
    "UnknownMergeMethodError",
    "VOCAB_PADDING_RULES",
    "get_merge_method",
    "list_merge_methods",
    "merge_method",
    "merge_models",
    "merge_state_dicts",
    "unregister_merge_method",
]
