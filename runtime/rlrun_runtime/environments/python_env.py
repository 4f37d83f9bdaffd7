"""A user's own environment (``spec.environment.type: python``): an import path ``module:attribute``."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .base import EnvironmentSpecError

PATH_HELP = ('spec.environment.name must be an import path "package.module:attribute" naming an Environment '
             "object, or a class/function that returns one (see docs/environments.md)")


def _check(env: Any, path: str) -> Any:
    missing = [attr for attr in ("task", "score") if not callable(getattr(env, attr, None))]
    if missing:
        raise EnvironmentSpecError(
            f"spec.environment.name: {path!r} gave {type(env).__name__}, which lacks {' and '.join(missing)}(); "
            f"an environment needs task(index) -> Task and score(task, completion) -> float")
    if not isinstance(getattr(env, "name", None), str):
        try:
            env.name = path
        except AttributeError:
            pass
    return env


def load_python_environment(path: str, seed: int = 0, args: dict[str, Any] | None = None) -> Any:
    """Import ``module:attribute``; return it if it is an environment, else call it with ``**args``.

    A callable (class or factory function) gets ``seed=seed`` too when its signature accepts ``seed`` (or
    ``**kwargs``). The result must have ``task`` and ``score`` methods; a missing ``name`` is set to ``path``.

    Raises:
        EnvironmentSpecError: malformed path, module not importable, attribute missing, the factory
            rejecting the args, or the result not being an environment.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentSpecError(f"{PATH_HELP}; got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentSpecError(
            f"spec.environment.name: cannot import module {module_name!r} ({exc}); install it in the runtime "
            f"image or put it on PYTHONPATH") from exc
    except Exception as exc:  # the user's module failed while importing: report it, no traceback
        raise EnvironmentSpecError(
            f"spec.environment.name: importing {module_name!r} raised {type(exc).__name__}: {exc}; fix that "
            f"module (import it in Python to see the traceback)") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise EnvironmentSpecError(
                f"spec.environment.name: module {module_name!r} has no attribute {attr!r}; check the part after ':'")
        target = getattr(target, part)
    args = dict(args or {})
    if callable(getattr(target, "task", None)) and not inspect.isclass(target):
        if args:
            raise EnvironmentSpecError(
                f"spec.environment.args: {path!r} is an environment object, not a factory; it takes no args")
        return _check(target, path)
    if not callable(target):
        raise EnvironmentSpecError(f"{PATH_HELP}; {path!r} is a {type(target).__name__}")
    try:
        params = inspect.signature(target).parameters
        takes_seed = "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_seed = False
    if takes_seed:
        args.setdefault("seed", seed)
    try:
        env = target(**args)
    except TypeError as exc:
        raise EnvironmentSpecError(
            f"spec.environment.args: {path!r} rejected the arguments {sorted(args)} ({exc}); pass the keyword "
            f"arguments its signature takes") from exc
    except Exception as exc:  # the user's factory failed: report it, no traceback
        raise EnvironmentSpecError(
            f"spec.environment.name: {path!r} raised {type(exc).__name__}: {exc} when called with "
            f"{sorted(args)}; fix the factory or spec.environment.args") from exc
    return _check(env, path)
