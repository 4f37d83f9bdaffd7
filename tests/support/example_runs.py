"""The repository root and its example RLRuns (examples/*.yaml), each loaded as a fresh dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def load_example(name: str = "rlrun-tiny.yaml") -> dict[str, Any]:
    """A fresh (mutable) dict of examples/``name``, not defaulted; rlrun-tiny.yaml is the embedded default run.

    Raises:
        FileNotFoundError: no such example.
    """
    return yaml.safe_load((ROOT / "examples" / name).read_text(encoding="utf-8"))
