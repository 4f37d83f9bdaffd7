"""Shared fixtures: `tiny_example`, a fresh copy of examples/rlrun-tiny.yaml (tests/support/example_runs.py)."""

from __future__ import annotations

import pytest

from example_runs import ROOT, load_example

# ROOT stays importable from here for tests/unit/test_bad_input.py; new code imports it from example_runs.
__all__ = ["ROOT", "tiny_example"]


@pytest.fixture
def tiny_example() -> dict:
    """A fresh copy of examples/rlrun-tiny.yaml (the embedded default run) as a dict, not defaulted."""
    return load_example("rlrun-tiny.yaml")
