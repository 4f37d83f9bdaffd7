"""Shared test helpers: the repository root and the example RLRuns."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture
def tiny_rlrun() -> dict:
    """A fresh copy of examples/rlrun-tiny.yaml (the embedded default run) as a dict."""
    return copy.deepcopy(yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text()))
