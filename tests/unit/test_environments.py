"""rlrun_runtime.environments: real task generation and real scoring (builtin, reasoning-gym, python)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from rlrun_api import constants
from rlrun_runtime.environments import EnvironmentSpecError, ReverseWords, Task, load_environment
from rlrun_runtime.environments.builtin import WORDS, sequence_score


def builtin(seed: int = 0, **args) -> ReverseWords:
    return load_environment({"type": "builtin", "name": "reverse-words", "seed": seed, "args": args})


# --- builtin reverse-words ---------------------------------------------------------------------------

def test_every_builtin_name_in_constants_loads():
    for name in constants.BUILTIN_ENVIRONMENTS:
        env = load_environment({"type": "builtin", "name": name, "seed": 0})
        assert env.name == name


def test_reverse_words_task_shape():
    env = builtin(seed=3, min_words=4, max_words=4)
    task = env.task(7)
    assert isinstance(task, Task) and task.index == 7
    words = task.prompt.removeprefix("reverse: ").removesuffix("\nanswer:").split()
    assert len(words) == 4 and all(word in WORDS for word in words)
    assert task.answer == list(reversed(words))
    assert len(set(words)) == 4  # distinct by default


def test_reverse_words_exact_answer_scores_one_and_wrong_scores_lower():
    env = builtin(min_words=5, max_words=5)
    task = env.task(0)
    exact = " " + " ".join(task.answer)
    assert env.score(task, exact) == 1.0
    assert env.score(task, exact + "\nanything after the first line is ignored") == 1.0
    unreversed = " " + " ".join(reversed(task.answer))
    # 5 distinct words in the opposite order: one word of the longest matching block -> 2*1/10
    assert env.score(task, unreversed) == pytest.approx(0.2)
    assert env.score(task, "") == 0.0
    assert env.score(task, " zebra yak") == 0.0


def test_reverse_words_partial_credit_in_between():
    env = builtin(min_words=4, max_words=4)
    task = env.task(1)
    a, b, c, d = task.answer
    assert env.score(task, f" {a} {b} {c}") == pytest.approx(2 * 3 / 7)   # one word missing
    assert env.score(task, f" {a} {b} {c} {d} {d}") == pytest.approx(2 * 4 / 9)  # one word extra
    assert env.score(task, f" {a} {b} {d} {c}") == pytest.approx(2 * 3 / 8)  # last two swapped
    scores = [env.score(task, text) for text in (f" {a} {b} {c}", f" {a}", "")]
    assert scores == sorted(scores, reverse=True) and 0.0 < scores[1] < scores[0] < 1.0


def test_sequence_score_is_symmetric_and_bounded():
    assert sequence_score(["a", "b"], ["b", "a"]) == sequence_score(["b", "a"], ["a", "b"]) == 0.5
    assert sequence_score([], []) == 0.0


def test_reverse_words_is_deterministic_in_seed_and_index():
    first = [builtin(seed=5).task(i) for i in range(50)]
    again = [builtin(seed=5).task(i) for i in range(50)]
    other = [builtin(seed=6).task(i) for i in range(50)]
    assert first == again
    assert sum(a.prompt != b.prompt for a, b in zip(first, other)) > 40
    assert len({task.prompt for task in first}) > 45  # prompts vary with the index


def test_reverse_words_respects_word_count_and_vocab_args():
    env = builtin(min_words=2, max_words=3, vocab_size=4, distinct=False)
    counts, used = set(), set()
    for i in range(200):
        counts.add(len(env.task(i).answer))
        used.update(env.task(i).answer)
    assert counts == {2, 3}
    assert used == set(WORDS[:4])


@pytest.mark.parametrize("args, field", [
    ({"min_words": 0}, "min_words"),
    ({"min_words": 5, "max_words": 3}, "max_words"),
    ({"vocab_size": 1}, "vocab_size"),
    ({"vocab_size": 3, "max_words": 5}, "distinct"),
    ({"colour": "red"}, "spec.environment.args"),
])
def test_reverse_words_bad_args_name_the_field(args, field):
    with pytest.raises(EnvironmentSpecError, match=field):
        builtin(**args)


# --- load_environment errors -------------------------------------------------------------------------

@pytest.mark.parametrize("spec, needle", [
    ({"type": "gym", "name": "x"}, "spec.environment.type"),
    ({"type": "builtin", "name": "sort-words"}, "reverse-words"),
    ({"type": "builtin", "name": ""}, "spec.environment.name"),
    ({"type": "builtin", "name": "reverse-words", "seed": "1"}, "spec.environment.seed"),
    ({"type": "builtin", "name": "reverse-words", "args": [1]}, "spec.environment.args"),
])
def test_load_environment_rejects_bad_specs(spec, needle):
    with pytest.raises(EnvironmentSpecError, match=needle) as info:
        load_environment(spec)
    assert isinstance(info.value, ValueError)


# --- reasoning-gym -----------------------------------------------------------------------------------

def rg(name: str = "basic_arithmetic", seed: int = 0, **args):
    return load_environment({"type": "reasoning-gym", "name": name, "seed": seed, "args": args})


def test_reasoning_gym_uses_the_dataset_and_its_own_scoring():
    env = rg(size=20)
    task = env.task(3)
    assert task.prompt[0]["role"] == "user" and task.prompt[0]["content"] == task.answer["question"]
    answer = task.answer["answer"]
    assert env.score(task, answer) == 1.0
    assert env.score(task, f"Let me think.\n<answer>{answer}</answer>") == 1.0
    assert env.score(task, "<answer>not a number</answer>") == 0.0
    assert env.task(23).prompt == env.task(3).prompt  # index wraps at size


def test_reasoning_gym_partial_credit_comes_from_the_dataset():
    import reasoning_gym

    env = rg("word_sorting", seed=1, size=10)
    task = env.task(0)
    wrong = "zzz"
    expected = reasoning_gym.create_dataset("word_sorting", seed=1, size=10).score_answer(wrong, task.answer)
    assert env.score(task, wrong) == pytest.approx(min(1.0, max(0.0, expected)))
    assert env.score(task, task.answer["answer"]) == 1.0


def test_reasoning_gym_is_deterministic_in_seed():
    assert [rg(seed=4, size=5).task(i).prompt for i in range(5)] == [rg(seed=4, size=5).task(i).prompt for i in range(5)]
    assert [rg(seed=4, size=5).task(i).prompt for i in range(5)] != [rg(seed=5, size=5).task(i).prompt for i in range(5)]


def test_reasoning_gym_unknown_name_says_how_to_list_names():
    with pytest.raises(EnvironmentSpecError) as info:
        rg("basic_arithmatic")
    message = str(info.value)
    assert "spec.environment.name" in message and "basic_arithmetic" in message
    assert "reasoning_gym.factory.DATASETS" in message


def test_reasoning_gym_bad_args_name_the_field():
    with pytest.raises(EnvironmentSpecError, match="spec.environment.args"):
        rg(no_such_option=3)


# --- verifiers ---------------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("verifiers") is not None, reason="verifiers is installed")
def test_verifiers_missing_package_names_the_install():
    with pytest.raises(EnvironmentSpecError) as info:
        load_environment({"type": "verifiers", "name": "wordle", "seed": 0})
    assert "spec.environment.type" in str(info.value) and "pip install verifiers" in str(info.value)


FAKE_VERIFIERS = textwrap.dedent('''
    """A stand-in for the verifiers package with its documented shapes (not installed here)."""
    import types
    import zlib

    class Rows(list):
        def shuffle(self, seed):
            return Rows(sorted(self, key=lambda row: zlib.crc32(f"{seed}:{row['question']}".encode())))

    class KeywordRubric:  # older releases: keyword arguments, returns an object with .reward
        async def score_rollout(self, prompt, completion, answer, state, task="default", info=None, **kwargs):
            text = completion[-1]["content"].strip()
            return types.SimpleNamespace(reward=1.0 if text == answer else 0.25 if answer in text else 0.0)

    class StateRubric:  # newer releases: one state dict, the rubric writes state["reward"]
        async def score_rollout(self, state):
            state["reward"] = 1.0 if state["completion"][-1]["content"].strip() == state["answer"] else 0.0

    def load_environment(env_id, **kwargs):
        if env_id not in ("kw", "state"):
            raise ValueError(f"no environment {env_id}")
        rows = Rows({"question": f"{i}+{kwargs.get('plus', 1)}=?", "answer": str(i + kwargs.get("plus", 1)),
                     "task": "add", "info": {}} for i in range(10))
        return types.SimpleNamespace(dataset=rows, rubric=KeywordRubric() if env_id == "kw" else StateRubric())
''')


@pytest.fixture
def fake_verifiers(tmp_path, monkeypatch):
    (tmp_path / "verifiers.py").write_text(FAKE_VERIFIERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("verifiers", None)
    yield
    sys.modules.pop("verifiers", None)


@pytest.mark.parametrize("env_id", ["kw", "state"])
def test_verifiers_adapter_against_the_documented_api(fake_verifiers, env_id):
    env = load_environment({"type": "verifiers", "name": env_id, "seed": 3, "args": {"plus": 2}})
    task = env.task(4)
    assert env.name == env_id and task.prompt[0]["role"] == "user"
    question = task.prompt[0]["content"]
    answer = str(int(question.split("+")[0]) + 2)
    assert env.score(task, f" {answer} ") == 1.0
    assert env.score(task, "no idea") == 0.0
    assert env.task(14).prompt == task.prompt  # wraps around the 10 rows
    other_seed = load_environment({"type": "verifiers", "name": env_id, "seed": 4, "args": {"plus": 2}})
    assert [env.task(i).prompt for i in range(10)] != [other_seed.task(i).prompt for i in range(10)]


def test_verifiers_unknown_id_names_the_field(fake_verifiers):
    with pytest.raises(EnvironmentSpecError, match="spec.environment.name.*'nope'"):
        load_environment({"type": "verifiers", "name": "nope", "seed": 0})


# --- python import path ------------------------------------------------------------------------------

USER_MODULE = textwrap.dedent('''
    from rlrun_runtime.environments import Task

    class Echo:
        name = "echo"

        def __init__(self, seed=0, word="hi"):
            self.seed, self.word = seed, word

        def task(self, index):
            return Task(index=index, prompt=f"say {self.word} {self.seed + index}", answer=self.word)

        def score(self, task, completion):
            return 1.0 if completion.strip() == task.answer else 0.0

    INSTANCE = Echo(seed=100)

    def make(word):
        return Echo(word=word)

    NOT_AN_ENV = 42

    def make_nothing():
        return object()
''')


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_env_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def python_env(path: str, seed: int = 0, **args):
    return load_environment({"type": "python", "name": path, "seed": seed, "args": args})


def test_python_class_gets_args_and_seed(user_module):
    env = python_env(f"{user_module}:Echo", seed=7, word="yo")
    task = env.task(2)
    assert task.prompt == "say yo 9" and env.score(task, " yo ") == 1.0 and env.score(task, "no") == 0.0


def test_python_instance_and_factory(user_module):
    assert python_env(f"{user_module}:INSTANCE").task(1).prompt == "say hi 101"
    assert python_env(f"{user_module}:make", word="hey").task(0).prompt == "say hey 0"  # no seed parameter


@pytest.mark.parametrize("suffix, needle", [
    ("", "module:attribute"),
    (":Missing", "no attribute"),
    (":NOT_AN_ENV", "int"),
    (":make_nothing", "lacks task"),
])
def test_python_bad_paths_are_clear(user_module, suffix, needle):
    with pytest.raises(EnvironmentSpecError, match=needle):
        python_env(user_module + suffix)


def test_python_missing_module_and_bad_args(user_module):
    with pytest.raises(EnvironmentSpecError, match="cannot import module 'no_such_module_xyz'"):
        python_env("no_such_module_xyz:Env")
    with pytest.raises(EnvironmentSpecError, match="spec.environment.args"):
        python_env(f"{user_module}:Echo", colour="red")
    with pytest.raises(EnvironmentSpecError, match="takes no args"):
        python_env(f"{user_module}:INSTANCE", word="x")


def test_python_module_or_factory_that_raises_is_a_spec_error(tmp_path, monkeypatch):
    name = f"broken_env_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / f"{name}_factory.py").write_text("def make():\n    raise KeyError('dataset')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(EnvironmentSpecError, match=r"spec.environment.name: importing .* RuntimeError: no GPU"):
            python_env(f"{name}:Env")
        with pytest.raises(EnvironmentSpecError, match=r"raised KeyError"):
            python_env(f"{name}_factory:make")
    finally:
        sys.modules.pop(name, None)
        sys.modules.pop(f"{name}_factory", None)
