"""Reference implementations the tests compare against (mergekit, PEFT, lm-eval, EvalPlus, math-verify).

Without them a developer's run skips those tests with the reason; under CI (``CI`` set), which
installs the ``dev`` and ``reference`` extras, a missing reference is a failure, never a silent skip.
"""

import importlib
import os

import pytest


def require(module: str):
    """Import ``module``; skip the calling test module without it, unless running under CI."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} (a reference extra) is not installed")
