"""rlrun's own procedural tasks (``spec.environment.type: builtin``).

``reverse-words``: the prompt lists a few words, the answer is the same words in reverse order. The
reward is the similarity of the predicted word sequence to the reversed sequence, as computed by
``difflib.SequenceMatcher.ratio()`` (``2 * matches / (len(predicted) + len(target))``, Python standard
library): 1.0 for the exact answer, partial credit for a partly right order, lower for missing or extra
words, 0.0 for nothing of it. No length or format bonus: only the words and their order count.
"""

from __future__ import annotations

import difflib
import random
from typing import Any

from .base import EnvironmentSpecError, Task

# The word list of reverse-words. The tiny model's tokenizer is trained on these words so that each is
# one token; changing it changes the tiny model (bump tiny_model.MODEL_VERSION).
WORDS: tuple[str, ...] = (
    "red", "blue", "green", "gold", "pink", "gray", "cat", "dog",
    "fox", "owl", "bee", "cow", "sun", "moon", "star", "rain",
    "snow", "wind", "tree", "leaf", "rock", "sand", "lake", "hill",
    "one", "two", "six", "ten", "cup", "pen", "box", "key",
)

PROMPT_PREFIX = "reverse:"
ANSWER_MARKER = "\nanswer:"


def render_prompt(words: list[str]) -> str:
    """The prompt text of a reverse-words task: ``"reverse: a b c\\nanswer:"``."""
    return f"{PROMPT_PREFIX} {' '.join(words)}{ANSWER_MARKER}"


def render_answer(words: list[str]) -> str:
    """The ideal completion for ``words``: a space, the reversed words, nothing else."""
    return " " + " ".join(reversed(words))


def sequence_score(predicted: list[str], target: list[str]) -> float:
    """``difflib.SequenceMatcher(None, predicted, target).ratio()``: 2*M/T over word sequences, in [0, 1].

    M is the number of words in matching blocks, T the total number of words in both sequences; two
    empty sequences score 0.0 here (there is nothing to reverse).
    """
    if not predicted and not target:
        return 0.0
    return difflib.SequenceMatcher(None, predicted, target, autojunk=False).ratio()


class ReverseWords:
    """Reverse a sequence of ``min_words``..``max_words`` words drawn from ``WORDS[:vocab_size]``.

    Args:
        seed: seed of the generator; ``task(i)`` depends only on (seed, i).
        min_words, max_words: inclusive range of the number of words per prompt (1 <= min <= max <= 16).
        vocab_size: how many words of ``WORDS`` are used (2..len(WORDS)).
        distinct: draw words without repetition (needs vocab_size >= max_words).

    Raises:
        EnvironmentSpecError: an argument is out of range (message names ``spec.environment.args.<arg>``).
    """

    name = "reverse-words"

    def __init__(self, seed: int = 0, min_words: int = 3, max_words: int = 5, vocab_size: int = len(WORDS),
                 distinct: bool = True):
        if not 1 <= int(min_words) <= int(max_words) <= 16:
            raise EnvironmentSpecError(
                f"spec.environment.args.min_words/max_words: need 1 <= min_words <= max_words <= 16, got "
                f"{min_words} and {max_words}; change them")
        if not 2 <= int(vocab_size) <= len(WORDS):
            raise EnvironmentSpecError(
                f"spec.environment.args.vocab_size: must be between 2 and {len(WORDS)}, got {vocab_size}")
        if distinct and int(vocab_size) < int(max_words):
            raise EnvironmentSpecError(
                "spec.environment.args.distinct: distinct words need vocab_size >= max_words; raise "
                "vocab_size or set distinct: false")
        self.seed = int(seed)
        self.min_words = int(min_words)
        self.max_words = int(max_words)
        self.vocab = WORDS[: int(vocab_size)]
        self.distinct = bool(distinct)

    def words(self, index: int) -> list[str]:
        """The words of task ``index`` (deterministic: a generator seeded by the string (name, seed, index))."""
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        count = rng.randint(self.min_words, self.max_words)
        if self.distinct:
            return rng.sample(self.vocab, count)
        return [rng.choice(self.vocab) for _ in range(count)]

    def task(self, index: int) -> Task:
        """Task ``index``: plain-text prompt, answer = the reversed word list."""
        words = self.words(index)
        return Task(index=index, prompt=render_prompt(words), answer=list(reversed(words)))

    def score(self, task: Task, completion: str) -> float:
        """Sequence similarity of the completion's first line (split on whitespace) to ``task.answer``."""
        lines = completion.strip().splitlines()
        predicted = lines[0].split() if lines else []
        return sequence_score(predicted, list(task.answer))


BUILTINS: dict[str, Any] = {ReverseWords.name: ReverseWords}
