"""What every role shares at start-up: reading the RLRun config file, reading its env, one error type and
the one way a role reports it (:func:`role_main`)."""

from __future__ import annotations

import faulthandler
import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from rlrun_api import constants
from rlrun_api.documents import SpecFileError, get_single, parse_documents
from rlrun_api.spec import apply_defaults

EXIT_BAD_INPUT = 2  # the exit code of every role on bad input (docs/runtime-contract.md)


class RoleConfigError(ValueError):
    """Bad input to a role (unreadable config, missing or malformed env var); the message names the fix.

    Every role prints it as ``rlrun-runtime ROLE: <message>`` and exits 2, without a traceback
    (:func:`role_main`).
    """


def print_role_error(role: str, message: object) -> None:
    """Write ``rlrun-runtime ROLE: message`` to stderr (the line ``rlrun local`` shows as a role's cause)."""
    print(f"rlrun-runtime {role}: {message}", file=sys.stderr, flush=True)


def role_main(role: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a role's ``main(argv) -> int``: a :class:`RoleConfigError` escaping it is printed with
    :func:`print_role_error` and becomes exit code ``EXIT_BAD_INPUT`` (2); anything else passes through. A crash
    below Python (SIGSEGV, SIGABRT from a native library such as gloo) prints every thread's Python stack to
    stderr first (:mod:`faulthandler`), so the pod's log says where it died."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args: Any, **kwargs: Any) -> int:
            if not faulthandler.is_enabled():
                try:
                    faulthandler.enable(sys.__stderr__, all_threads=True)
                except (AttributeError, OSError, ValueError):  # no stderr with a file descriptor: no stacks
                    pass
            try:
                return main(*args, **kwargs)
            except RoleConfigError as err:
                print_role_error(role, err)
                return EXIT_BAD_INPUT

        return wrapper

    return decorate


def load_rlrun(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the RLRun YAML at ``path`` (the ConfigMap's file) with the CLI's loader
    (:func:`rlrun_api.documents.parse_documents`: one RLRun mapping, repeated keys refused) and apply the
    CRD's defaults.

    Raises:
        RoleConfigError: the file is missing or unreadable, not YAML, not exactly one RLRun document, or has
            no ``spec`` mapping; the message starts with ``--config PATH:`` and says what to fix.
    """
    where = f"--config {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RoleConfigError(f"{where}: is not UTF-8 text; pass the RLRun YAML") from None
    except OSError as exc:
        raise RoleConfigError(f"{where}: cannot read it ({exc.strerror or exc}); pass the RLRun YAML") from None
    try:
        rlrun = get_single(parse_documents(text, where), where, "a role")
    except SpecFileError as err:
        raise RoleConfigError(str(err)) from None
    if not isinstance(rlrun.get("spec"), dict):
        raise RoleConfigError(f"{where}: no `spec` mapping; pass an RLRun YAML (kind: {constants.KIND}) with a spec")
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
