"""torchrun's environment variables in tests: cleared for a test (and whatever the test sets removed after it), or
left out of a subprocess's environment."""

from __future__ import annotations

import os

import pytest

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def clear_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset torchrun's variables for this test; at its end monkeypatch removes them again, also the values that
    ``rlrun_runtime.trainer.init_distributed`` writes for a world of one (set, then deleted, so that monkeypatch
    records them as absent before the test)."""
    for key in TORCHRUN_ENV:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def get_env_without_torchrun() -> dict[str, str]:
    """This process's environment without torchrun's variables, for a subprocess that starts its own world."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
