"""reasoning-gym datasets (``spec.environment.type: reasoning-gym``), scored by their own ``score_answer``."""

from __future__ import annotations

import difflib
from typing import Any

from .base import EnvironmentSpecError, Task

DEFAULT_SIZE = 100_000  # procedural datasets: large enough that a run never wraps around
LIST_NAMES_HINT = 'python -c "import reasoning_gym; print(sorted(reasoning_gym.factory.DATASETS))"'


class ReasoningGymEnvironment:
    """A reasoning-gym procedural dataset as an rlrun environment.

    Built with ``reasoning_gym.create_dataset(name, seed=seed, size=size, **args)`` (reasoning-gym's
    documented entry point). ``task(i)`` is entry ``i % size``; the prompt is one user chat message with the
    entry's ``question``; ``score`` extracts the text inside ``<answer>...</answer>`` when present (the
    format of reasoning-gym's own system prompt, ``reasoning_gym.utils.extract_answer``), otherwise the
    whole stripped completion, and returns ``dataset.score_answer(answer, entry)`` (in [0, 1]).

    Args:
        name: a reasoning-gym dataset name (see ``reasoning_gym.factory.DATASETS``).
        seed: dataset seed.
        args: keyword arguments of the dataset's config; ``size`` defaults to 100000.

    Raises:
        EnvironmentSpecError: unknown name (with close matches and how to list them) or bad args.
    """

    def __init__(self, name: str, seed: int = 0, args: dict[str, Any] | None = None):
        import reasoning_gym
        from reasoning_gym import factory

        args = dict(args or {})
        if name not in factory.DATASETS:
            close = difflib.get_close_matches(name, list(factory.DATASETS), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise EnvironmentSpecError(
                f"spec.environment.name: {name!r} is not a reasoning-gym dataset.{hint} List the valid names "
                f"with: {LIST_NAMES_HINT}")
        size = int(args.pop("size", DEFAULT_SIZE))
        try:
            self.dataset = reasoning_gym.create_dataset(name, seed=int(seed), size=size, **args)
        except (TypeError, ValueError, AssertionError) as exc:
            raise EnvironmentSpecError(
                f"spec.environment.args: reasoning-gym rejected the arguments of {name!r} ({exc}); use the fields "
                f"of its config class (reasoning_gym.factory.DATASETS[{name!r}])") from exc
        self.name = name
        self.size = size

    def task(self, index: int) -> Task:
        """Entry ``index % size`` as a one-message chat prompt; the answer is the whole entry."""
        entry = self.dataset[index % self.size]
        return Task(index=index, prompt=[{"role": "user", "content": entry["question"]}], answer=entry)

    def score(self, task: Task, completion: str) -> float:
        """The dataset's own ``score_answer`` of the extracted answer, clamped to [0, 1]."""
        from reasoning_gym.utils import extract_answer

        extracted = extract_answer(completion)
        answer = extracted if extracted is not None else completion.strip()
        value = float(self.dataset.score_answer(answer=answer, entry=task.answer))
        return min(1.0, max(0.0, value))
