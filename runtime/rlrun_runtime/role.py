"""What every role shares at start-up: reading the RLRun config file, reading its env, one error type."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from rlrun_api import constants
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


def env_list(env: Mapping[str, str], name: str, what: str) -> list[str]:
    """The non-blank comma-separated items of ``env[name]`` (``what`` says what an item is, for the error).

    Raises:
        RoleConfigError: unset, blank, or only commas.
    """
    items = [item.strip() for item in env.get(name, "").split(",") if item.strip()]
    if not items:
        raise RoleConfigError(f"environment variable {name} is not set; the renderer (or rlrun local) sets it to "
                              f"comma-separated {what}")
    return items


def env_port(env: Mapping[str, str], name: str, default: int, *, allow_off: bool = False) -> int:
    """``env[name]`` as a TCP port, ``default`` when unset; with ``allow_off``, 0 means "do not listen".

    Raises:
        RoleConfigError: not an integer in 1..65535 (0..65535 with ``allow_off``).
    """
    raw = env.get(name, "").strip() or str(default)
    low = 0 if allow_off else 1
    if not raw.isdigit() or not low <= int(raw) < 65536:
        raise RoleConfigError(f"environment variable {name}={raw!r} is not a TCP port; set it to {low}-65535"
                              + (" (0: off)" if allow_off else ""))
    return int(raw)


def env_bind_host(env: Mapping[str, str]) -> str:
    """The address servers listen on: ``RLRUN_BIND_HOST``, or all interfaces (constants.DEFAULT_BIND_HOST)."""
    return env.get(constants.ENV_BIND_HOST, "").strip() or constants.DEFAULT_BIND_HOST
