"""Shared fixtures: `tiny_example`, a fresh copy of examples/rlrun-tiny.yaml (tests/support/example_runs.py)."""

from __future__ import annotations

import pytest

from example_runs import ROOT, load_example
from torchrun_env import clear_torchrun_env

# ROOT stays importable from here for tests/unit/test_bad_input.py; new code imports it from example_runs.
__all__ = ["ROOT", "tiny_example"]


@pytest.fixture
def tiny_example() -> dict:
    """A fresh copy of examples/rlrun-tiny.yaml (the embedded default run) as a dict, not defaulted."""
    return load_example("rlrun-tiny.yaml")


@pytest.fixture
def world_of_one(monkeypatch):
    """A trainer process group of one rank on CPU (no torchrun variables), destroyed afterwards; yields the
    device."""
    import torch.distributed as dist

    from rlrun_runtime.trainer import init_distributed

    clear_torchrun_env(monkeypatch)  # and what init_distributed sets is removed afterwards: a later subprocess
    _, _, device = init_distributed(False)  # would join this finished world's port
    yield device
    dist.destroy_process_group()
