"""What every role shares at start-up: reading the RLRun config file, reading its env, one error type."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from rlrun_api.spec import apply_defaults


class RoleConfigError(ValueError):
    """Bad input to a role (unreadable config, missing or malformed env var); the message names the fix.

    Every role prints it as ``rlrun-runtime ROLE: <message>`` and exits 2, without a traceback.
    """


def load_rlrun(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the RLRun YAML at ``path`` (the ConfigMap's file) and apply the CRD's defaults.

    Raises:
        RoleConfigError: the file is missing, not YAML, or has no ``spec`` mapping.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RoleConfigError(f"--config {path}: cannot read it ({exc.strerror}); pass the RLRun YAML") from None
    try:
        rlrun = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RoleConfigError(f"--config {path}: not valid YAML ({exc}); fix the file") from None
    if not isinstance(rlrun, dict) or not isinstance(rlrun.get("spec"), dict):
        raise RoleConfigError(f"--config {path}: no `spec` mapping; pass an RLRun YAML (kind: RLRun)")
    return apply_defaults(rlrun)


def load_spec(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The defaulted ``spec`` of the RLRun YAML at ``path`` (see :func:`load_rlrun`)."""
    return load_rlrun(path)["spec"]


def env_required(env: Mapping[str, str], name: str) -> str:
    """The stripped value of ``env[name]``.

    Raises:
        RoleConfigError: unset or blank.
    """
    value = env.get(name, "").strip()
    if not value:
        raise RoleConfigError(f"environment variable {name} is not set; the renderer (or rlrun local) sets it")
    return value


def env_port(env: Mapping[str, str], name: str, default: int) -> int:
    """``env[name]`` as a TCP port, ``default`` when unset.

    Raises:
        RoleConfigError: not an integer in 1..65535.
    """
    raw = env.get(name, "").strip() or str(default)
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise RoleConfigError(f"environment variable {name}={raw!r} is not a TCP port; set it to 1-65535")
    return int(raw)
