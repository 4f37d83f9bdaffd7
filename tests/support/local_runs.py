"""Whole `rlrun local` runs for the end-to-end tests: the run file, the console script, what the run leaves
behind, and the bounds every run of the embedded default (examples/rlrun-tiny.yaml) must hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from example_runs import ROOT
from rlrun_api import constants as c
from rlrun_runtime.local.processes import read_process_table

TINY = ROOT / "examples" / "rlrun-tiny.yaml"
RLRUN = [str(Path(sys.executable).parent / "rlrun")]

# Policy-mismatch bounds (docs/local.md explains them), counted per step, so load does not change them.
FIRST_STEP_MISMATCH_KL = 1e-3  # step 1 trains on rollouts of policy 0 with policy 0: numerics only
ON_POLICY_MISMATCH_KL = 1e-3   # every step's mismatch_kl_on_policy (samples of policy step - 1 only; null when none):
                               # numerics only; measured <= 5e-9 on 3 of 60 steps (float32, CPU, 2026-11-29)
MEAN_MISMATCH_KL = 0.15        # whole run, all samples: mostly the drift of rollouts one policy step old
                               # (maxAsyncLevel 1); measured means 0.02-0.05 (2026-11-29, lr 3e-3; lower at lr 2e-3)


def write_run(tmp_path: Path, **changes: Any) -> Path:
    """The tiny example with dotted spec paths changed, written under tmp_path."""
    rlrun = yaml.safe_load(TINY.read_text())
    for dotted, value in changes.items():
        node = rlrun["spec"]
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "rlrun.yaml"
    path.write_text(yaml.safe_dump(rlrun, sort_keys=False))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def processes_of_run(storage_dir: Path) -> dict[int, str]:
    """Live processes whose environment names this run's storage dir: pid -> command line."""
    needle = f"{c.ENV_STORAGE_DIR}={storage_dir}".encode() + b"\0"
    found = {}
    for pid, info in read_process_table().items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in environ and info.state != "Z":
            found[pid] = cmdline
    return found


def run_local(path: Path, out_dir: Path, *extra: str, timeout: float = 850) -> subprocess.CompletedProcess[str]:
    return subprocess.run(RLRUN + ["local", str(path), "--output-dir", str(out_dir), *extra],
                          capture_output=True, text=True, timeout=timeout)
