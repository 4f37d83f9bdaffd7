"""Where prompts come from and how completions are scored: ``load_environment(spec.environment)``.

Types (``spec.environment.type``): ``builtin`` (rlrun's procedural tasks, e.g. reverse-words),
``reasoning-gym`` (a reasoning-gym dataset by name), ``verifiers`` (an installed verifiers environment by
id), ``python`` (an import path of an object implementing :class:`Environment`). See docs/environments.md.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from rlrun_api import constants
from rlrun_api.views import EnvironmentView

from .base import Environment, EnvironmentSpecError, Task
from .builtin import BUILTINS, ReverseWords

__all__ = ["Environment", "EnvironmentSpecError", "Task", "ReverseWords", "load_environment"]

TYPES = ("builtin", "reasoning-gym", "verifiers", "python")


def load_environment(env_spec: EnvironmentView | Mapping[str, Any]) -> Environment:
    """Build the environment described by ``env_spec``.

    Args:
        env_spec: the orchestrator's typed view (``OrchestratorView.environment``), or a ``spec.environment``
            mapping ``{"type": ..., "name": ..., "args": {...}, "seed": int}`` (``rlrun local``'s early check),
            read through :meth:`EnvironmentView.from_mapping`.

    Returns:
        an object with ``name``, ``task(index) -> Task`` and ``score(task, completion) -> float in [0, 1]``.

    Raises:
        EnvironmentSpecError: unknown type or name, bad args, missing optional package; the message names
            the ``spec.environment`` field and the fix.
    """
    if not isinstance(env_spec, EnvironmentView):
        try:
            env_spec = EnvironmentView.from_mapping(env_spec)
        except ValueError as err:
            raise EnvironmentSpecError(str(err)) from None
    kind, name, seed = env_spec.type, env_spec.name, env_spec.seed
    args = copy.deepcopy(dict(env_spec.args))  # the constructor's own copy: the view stays read-only
    if kind not in TYPES:
        raise EnvironmentSpecError(
            f"spec.environment.type: {kind!r} is not one of {', '.join(TYPES)}; pick one of them")
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
