"""verifiers environments (``spec.environment.type: verifiers``), when the ``verifiers`` package is installed.

Written against verifiers' documented API: ``verifiers.load_environment(env_id, **env_args)`` returns an
environment whose ``dataset`` rows carry ``prompt`` (chat messages) or ``question``, plus ``answer``,
``info`` and ``task``; its ``rubric.score_rollout`` scores one rollout. Older releases take keyword
arguments (prompt, completion, answer, state, task, info) and return an object with ``reward``; newer
ones take a ``state`` dict and write ``state["reward"]``. Both are handled. Only single-turn
environments fit rlrun's one-completion protocol.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from .base import EnvironmentSpecError, Task

INSTALL_HINT = ("install it in the runtime image (pip install verifiers) together with the environment "
                "module (e.g. prime env install OWNER/ENV), or use type: reasoning-gym, builtin or python")


def _run(value: Any) -> Any:
    return asyncio.run(value) if inspect.isawaitable(value) else value


class VerifiersEnvironment:
    """A single-turn verifiers environment as an rlrun environment.

    Args:
        env_id: the environment id passed to ``verifiers.load_environment``.
        seed: shuffles the dataset (``dataset.shuffle(seed=seed)``) so that the seed picks the order.
        args: keyword arguments for the environment's ``load_environment``.

    Raises:
        EnvironmentSpecError: verifiers is not installed, or the id cannot be loaded.
    """

    def __init__(self, env_id: str, seed: int = 0, args: dict[str, Any] | None = None):
        try:
            import verifiers
        except ImportError as exc:
            raise EnvironmentSpecError(
                f"spec.environment.type: verifiers needs the 'verifiers' package, which is not installed; "
                f"{INSTALL_HINT}") from exc
        try:
            self.env = verifiers.load_environment(env_id, **(args or {}))
        except Exception as exc:  # verifiers raises whatever the environment module raises
            raise EnvironmentSpecError(
                f"spec.environment.name: verifiers could not load environment {env_id!r} ({exc}); check the id "
                f"and spec.environment.args, and that its module is installed") from exc
        dataset = getattr(self.env, "dataset", None)
        if dataset is None and hasattr(self.env, "get_dataset"):
            dataset = self.env.get_dataset()
        if dataset is None or len(dataset) == 0:
            raise EnvironmentSpecError(
                f"spec.environment.name: verifiers environment {env_id!r} has no training dataset")
        self.dataset = dataset.shuffle(seed=int(seed)) if hasattr(dataset, "shuffle") else dataset
        self.name = env_id

    def task(self, index: int) -> Task:
        """Row ``index % len(dataset)``; prompt = its ``prompt`` messages (or the ``question`` as a user message)."""
        row = dict(self.dataset[index % len(self.dataset)])
        prompt = row.get("prompt")
        if not prompt:
            prompt = [{"role": "user", "content": str(row.get("question", ""))}]
        return Task(index=index, prompt=prompt, answer=row)

    def score(self, task: Task, completion: str) -> float:
        """The rubric's reward for the completion as one assistant message, clamped to [0, 1]."""
        row = task.answer
        messages = [{"role": "assistant", "content": completion}]
        fields = {"prompt": task.prompt, "completion": messages, "answer": row.get("answer", ""),
                  "task": row.get("task", "default"), "info": row.get("info") or {}}
        rubric = self.env.rubric
        params = inspect.signature(rubric.score_rollout).parameters
        if "prompt" in params or "completion" in params:
            result = _run(rubric.score_rollout(state={**fields}, **fields))
            reward = result.get("reward") if isinstance(result, dict) else getattr(result, "reward")
        else:
            state = dict(fields)
            _run(rubric.score_rollout(state))
            reward = state["reward"]
        return min(1.0, max(0.0, float(reward)))
