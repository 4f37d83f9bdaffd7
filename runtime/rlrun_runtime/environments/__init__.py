"""Where prompts come from and how completions are scored: ``load_environment(spec.environment)``.

Types (``spec.environment.type``): ``builtin`` (rlrun's procedural tasks, e.g. reverse-words),
``reasoning-gym`` (a reasoning-gym dataset by name), ``verifiers`` (an installed verifiers environment by
id), ``python`` (an import path of an object implementing :class:`Environment`). See docs/environments.md.
"""

from __future__ import annotations

from typing import Any

from rlrun_api import constants

from .base import Environment, EnvironmentSpecError, Task
from .builtin import BUILTINS, ReverseWords

__all__ = ["Environment", "EnvironmentSpecError", "Task", "ReverseWords", "load_environment"]

TYPES = ("builtin", "reasoning-gym", "verifiers", "python")


def load_environment(env_spec: dict[str, Any]) -> Environment:
    """Build the environment described by ``env_spec`` (the defaulted ``spec.environment``).

    Args:
        env_spec: ``{"type": ..., "name": ..., "args": {...}, "seed": int}``.

    Returns:
        an object with ``name``, ``task(index) -> Task`` and ``score(task, completion) -> float in [0, 1]``.

    Raises:
        EnvironmentSpecError: unknown type or name, bad args, missing optional package; the message names
            the ``spec.environment`` field and the fix.
    """
    kind = env_spec.get("type")
    name = env_spec.get("name")
    seed = env_spec.get("seed", 0)
    args = env_spec.get("args") or {}
    if kind not in TYPES:
        raise EnvironmentSpecError(
            f"spec.environment.type: {kind!r} is not one of {', '.join(TYPES)}; pick one of them")
    if not isinstance(name, str) or not name:
        raise EnvironmentSpecError("spec.environment.name: required (a task name, dataset, id or import path)")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise EnvironmentSpecError(f"spec.environment.seed: must be an integer, got {seed!r}")
    if not isinstance(args, dict):
        raise EnvironmentSpecError("spec.environment.args: must be a mapping of keyword arguments")
    if kind == "builtin":
        if name not in constants.BUILTIN_ENVIRONMENTS or name not in BUILTINS:
            raise EnvironmentSpecError(
                f"spec.environment.name: {name!r} is not a builtin task; builtin tasks are "
                f"{', '.join(constants.BUILTIN_ENVIRONMENTS)}")
        try:
            return BUILTINS[name](seed=seed, **args)
        except TypeError as exc:
            raise EnvironmentSpecError(
                f"spec.environment.args: {name} does not take these arguments ({exc}); see docs/environments.md"
            ) from exc
    if kind == "reasoning-gym":
        from .reasoning_gym_env import ReasoningGymEnvironment

        return ReasoningGymEnvironment(name, seed=seed, args=args)
    if kind == "verifiers":
        from .verifiers_env import VerifiersEnvironment

        return VerifiersEnvironment(name, seed=seed, args=args)
    from .python_env import load_python_environment

    return load_python_environment(name, seed=seed, args=args)
