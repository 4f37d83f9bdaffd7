"""The environment protocol every task source implements (pure data types, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Task:
    """One prompt of an environment.

    Attributes:
        index: position in the environment's task stream (0-based); the same (seed, index) gives the
            same task.
        prompt: plain text (sent to the completions API) or chat messages
            ``[{"role": "user", "content": "..."}]`` (sent to the chat completions API).
        answer: whatever the environment's ``score`` needs (a reference answer, a dataset entry, ...).
    """

    index: int
    prompt: str | list[dict[str, Any]]
    answer: Any


@runtime_checkable
class Environment(Protocol):
    """What the orchestrator needs from a task source.

    ``task(index)`` must be deterministic in the environment's seed and ``index`` (a resumed run asks for
    the same indices again and must get the same prompts). ``score(task, completion)`` returns the
    reward of one completion (the generated text only, without the prompt), a float in [0, 1].
    """

    name: str

    def task(self, index: int) -> Task: ...

    def score(self, task: Task, completion: str) -> float: ...


class EnvironmentSpecError(ValueError):
    """``spec.environment`` names something that cannot be loaded.

    The message names the field (``spec.environment.<field>``) and says how to fix it; ``rlrun`` turns it
    into exit code 2 before anything starts.
    """
