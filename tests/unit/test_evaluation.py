"""Held-out evaluation (rlrun_runtime.evaluation): task selection apart from training, the schedule, the
summary, and the Evaluator's handling of weight updates, against a stand-in host (no servers)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from rlrun_api import constants
from rlrun_api.views import EvaluationView
from rlrun_runtime.environments import ReverseWords, Task
from rlrun_runtime.evaluation import (EvalSettings, EvaluationSpecError, Evaluator, HeldOutTasks, get_eval_file,
                                      get_eval_sampling, get_held_out_indices, get_next_due, get_prompt_key,
                                      summarize)
from rlrun_runtime.orchestrator import render_prompt
from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics
from rlrun_runtime.storage import RunStorage


class Rows:
    """A dataset environment taken modulo its size (as reasoning-gym and verifiers environments are)."""

    name = "rows"

    def __init__(self, size: int):
        self.size = size

    def task(self, index: int) -> Task:
        row = index % self.size
        return Task(index=index, prompt=f"row {row}", answer=str(row))

    def score(self, task: Task, completion: str) -> float:
        return 1.0 if completion.strip() == task.answer else 0.0


class Finite(Rows):
    """A list that refuses indices beyond its end."""

    def task(self, index: int) -> Task:
        if index >= self.size:
            raise IndexError("list index out of range")
        return super().task(index)


def test_held_out_indices_lie_far_beyond_what_training_draws():
    indices = get_held_out_indices(5)
    assert indices == [constants.HELD_OUT_TASK_INDEX_BASE + i for i in range(5)]
    assert min(indices) == 2**40


def test_a_procedural_environment_keeps_its_training_stream_and_never_trains_on_a_held_out_prompt():
    env = ReverseWords(seed=0, min_words=1, max_words=1, vocab_size=8)  # 8 distinct prompts in all
    held = HeldOutTasks(env, prompts=3)
    held_keys = {get_prompt_key(t.prompt) for t in held.tasks}
    # the held-out tasks are the environment's tasks at the held-out indices, prompt for prompt
    assert [t.prompt for t in held.tasks] == [env.task(constants.HELD_OUT_TASK_INDEX_BASE + i).prompt for i in range(3)]
    indices, cursor, skipped = held.training_indices(0, 40)
    assert len(indices) == 40 and cursor == 40 + skipped and skipped > 0
    assert all(get_prompt_key(env.task(i).prompt) not in held_keys for i in indices)
    # every index not skipped is kept, in order: the stream is the one without evaluation minus the skips
    assert indices == [i for i in range(cursor) if get_prompt_key(env.task(i).prompt) not in held_keys]
    # deterministic from the cursor (a resumed orchestrator draws the same tasks)
    again, cursor2, _ = held.training_indices(0, 40)
    assert (again, cursor2) == (indices, cursor)
    nxt, _, _ = held.training_indices(cursor, 5)
    assert nxt[0] >= cursor


def test_a_dataset_that_wraps_skips_exactly_the_held_out_rows():
    env = Rows(size=10)
    held = HeldOutTasks(env, prompts=3)
    base_row = constants.HELD_OUT_TASK_INDEX_BASE % 10
    held_rows = {(base_row + i) % 10 for i in range(3)}
    assert {t.answer for t in held.tasks} == {str(r) for r in held_rows}
    indices, cursor, skipped = held.training_indices(0, 14)
    assert {i % 10 for i in indices} == set(range(10)) - held_rows
    assert skipped == cursor - 14 and skipped >= 3


def test_an_environment_without_enough_tasks_or_refusing_large_indices_is_refused_naming_the_field():
    with pytest.raises(EvaluationSpecError, match=r"^spec\.evaluation\.prompts: .*lower spec\.evaluation\.prompts"):
        HeldOutTasks(Rows(size=3), prompts=3).training_indices(0, 1)
    with pytest.raises(EvaluationSpecError, match=r"^spec\.evaluation: .*IndexError.*index % len"):
        HeldOutTasks(Finite(size=100), prompts=2)


@pytest.mark.parametrize("evaluated, every, max_steps, due", [
    (None, 10, 100, 0), (0, 10, 100, 10), (9, 10, 100, 10), (10, 10, 100, 20), (13, 10, 100, 20),
    (95, 10, 100, 100), (100, 10, 100, None), (0, 10, 7, 7), (7, 10, 7, None), (3, 1, 5, 4),
])
def test_next_due_version(evaluated, every, max_steps, due):
    assert get_next_due(evaluated, every, max_steps) == due


def test_summary_and_sampling():
    summary = summarize([1.0, 0.5, math.nan, 0.0], completion_tokens=[3, 5, 4], truncated=1, too_long=2,
                        scorer_errors=1)
    assert summary["reward_mean"] == pytest.approx(0.5) and summary["scored"] == 3
    assert summary["reward_std"] == pytest.approx(math.sqrt(((0.5) ** 2 + 0 + 0.5 ** 2) / 3))
    assert summary["exact_match_rate"] == pytest.approx(1 / 3)
    assert (summary["truncated"], summary["skipped_long_prompts"], summary["scorer_errors"]) == (1, 2, 1)
    assert summary["completion_tokens_mean"] == pytest.approx(4.0)
    assert summarize([], completion_tokens=[], truncated=0, too_long=0, scorer_errors=0)["reward_mean"] is None
    greedy = EvaluationView(every_steps=1, prompts=1, sampling="greedy", max_tokens=4)
    sampled = EvaluationView(every_steps=1, prompts=1, sampling="sampled", max_tokens=4)
    assert get_eval_sampling(greedy, 0.7, 0.9) == {"temperature": 0.0, "topP": 1.0}
    assert get_eval_sampling(sampled, 0.7, 0.9) == {"temperature": 0.7, "topP": 0.9}


class WordTokenizer:
    """One token per character: enough for prompt lengths."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) % 256 for ch in text]


class Host:
    """A stand-in orchestrator: answers each request with the task's reversed words (its reward is 1.0) or
    nothing, and can run a 'weight update' while the first requests are in flight."""

    def __init__(self, env: ReverseWords, metrics: OrchestratorMetrics, right: bool = True):
        self.env, self.metrics, self.right = env, metrics, right
        self.loaded_version = 0
        self.weights_stable = asyncio.Event()
        self.weights_stable.set()
        self.tokenizer = WordTokenizer()
        self.bodies: list[dict] = []
        self.update_during_first = False
        self.fail = False

    async def engines(self) -> list[str]:
        return ["http://engine"]

    async def _complete(self, body: dict, engines) -> list[dict]:
        self.bodies.append(body)
        if self.fail:
            raise RuntimeError("completion request failed after 4 attempts")
        if self.update_during_first and len(self.bodies) == 1:
            self.weights_stable.clear()   # the update sequence pauses the servers ...
            await asyncio.sleep(0.01)
            self.loaded_version += 1      # ... loads the next version ...
            self.weights_stable.set()     # ... and resumes them
        prompt = "".join(chr(t) for t in body["prompt"])
        words = prompt.split(":", 1)[1].split("\n")[0].split()
        text = " " + " ".join(reversed(words)) if self.right else " nothing"
        return [{"text": text, "token_ids": [1, 2, 3], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]},
                 "finish_reason": "stop"}]


def make_evaluator(tmp_path, host: Host, prompts: int = 4, sampling: str = "greedy", records: list | None = None,
                   max_steps: int = 3) -> Evaluator:
    view = EvaluationView(every_steps=2, prompts=prompts, sampling=sampling, max_tokens=8)
    return Evaluator(host, view, EvalSettings(max_steps=max_steps, max_model_len=128, temperature=1.0, top_p=1.0),
                     HeldOutTasks(host.env, prompts), render_prompt, RunStorage(tmp_path),
                     on_record=records.append if records is not None else None, poll_s=0.001)


def gauge(metrics: OrchestratorMetrics, name: str) -> dict:
    return {s.labels.get("sampling") or s.labels.get("result"): s.value
            for family in metrics.registry.collect() for s in family.samples if s.name == name}


def test_an_evaluation_records_reward_and_version_and_sets_the_gauges(tmp_path):
    metrics = OrchestratorMetrics(max_steps=3)
    host = Host(ReverseWords(seed=0), metrics)
    assert gauge(metrics, constants.METRIC_EVAL_REWARD) == {}  # absent before the first evaluation
    records: list = []
    evaluator = make_evaluator(tmp_path, host, records=records)
    record = asyncio.run(evaluator.evaluate())
    assert record["policy_version"] == 0 and record["consistent"] is True and record["attempts"] == 1
    assert record["reward_mean"] == 1.0 and record["prompts"] == 4 and record["scored"] == 4
    assert len(host.bodies) == 4
    assert all(b["temperature"] == 0.0 and b["n"] == 1 and b["cache_salt"] == "policy-0" for b in host.bodies)
    assert [b["seed"] for b in host.bodies] == sorted({b["seed"] for b in host.bodies})  # one fixed seed per prompt
    lines = [json.loads(x) for x in get_eval_file(RunStorage(tmp_path)).read_text().splitlines()]
    assert lines == [record] == records
    assert gauge(metrics, constants.METRIC_EVAL_REWARD) == {"greedy": 1.0}
    assert gauge(metrics, constants.METRIC_EVAL_POLICY_VERSION) == {"greedy": 0.0}
    assert gauge(metrics, constants.METRIC_EVALUATIONS + "_total") == {"ok": 1.0}


def test_an_update_during_an_evaluation_makes_it_run_again_on_the_new_version(tmp_path):
    metrics = OrchestratorMetrics(max_steps=3)
    host = Host(ReverseWords(seed=0), metrics)
    host.update_during_first = True
    record = asyncio.run(make_evaluator(tmp_path, host).evaluate())
    assert record["policy_version"] == 1 and record["end_policy_version"] == 1 and record["consistent"] is True
    assert record["attempts"] == 2
    assert {b["cache_salt"] for b in host.bodies[:4]} == {"policy-0"}
    assert {b["cache_salt"] for b in host.bodies[4:]} == {"policy-1"} and len(host.bodies) == 8
    assert gauge(metrics, constants.METRIC_EVAL_POLICY_VERSION) == {"greedy": 1.0}


def test_failed_requests_record_nothing_and_the_loop_goes_on_to_the_final_version(tmp_path):
    metrics = OrchestratorMetrics(max_steps=3)
    host = Host(ReverseWords(seed=0), metrics, right=False)
    host.fail = True
    evaluator = make_evaluator(tmp_path, host, max_steps=3)
    assert asyncio.run(evaluator.evaluate()) is None
    assert gauge(metrics, constants.METRIC_EVALUATIONS + "_total") == {"failed": 1.0}
    assert not get_eval_file(RunStorage(tmp_path)).exists()
    host.fail = False

    async def scenario():
        task = evaluator.start()
        for version in (1, 2, 3):       # the weight loop brings new versions
            await asyncio.sleep(0.02)
            host.loaded_version = version
        return await asyncio.wait_for(evaluator.finish(), 10), task

    final, task = asyncio.run(scenario())
    assert task.done() and final["policy_version"] == 3 and final["reward_mean"] == 0.0
    versions = [json.loads(x)["policy_version"] for x in get_eval_file(RunStorage(tmp_path)).read_text().splitlines()]
    assert versions[-1] == 3 and versions == sorted(set(versions))
    # a restarted orchestrator goes on from eval.jsonl: the final version is done, nothing is asked again
    again = make_evaluator(tmp_path, Host(ReverseWords(seed=0), OrchestratorMetrics(max_steps=3)), max_steps=3)
    assert again.evaluated == 3
    assert asyncio.run(asyncio.wait_for(again.finish(), 10))["policy_version"] == 3
