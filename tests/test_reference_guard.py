"""A missing reference implementation skips a developer's run but fails CI."""

import pytest
from _reference import require


def test_missing_reference_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ModuleNotFoundError, match="no_such_reference_module"):
        require("no_such_reference_module")


def test_missing_reference_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        require("no_such_reference_module")


def test_present_reference_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require("json").dumps([1]) == "[1]"
