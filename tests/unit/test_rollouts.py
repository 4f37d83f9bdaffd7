"""The orchestrator's pure logic: staleness and the async gate, completion requests, batch assembly, resume."""

from __future__ import annotations

import math

import pytest

from rlrun_api import constants
from rlrun_runtime.orchestrator import get_resume_point, render_prompt
from rlrun_runtime.rollouts import (Completion, Group, assemble_batch, get_completion_request, get_exact_match_rate,
                                   parse_completion_choice, plan_group_count)
from rlrun_runtime.staleness import is_stale, may_generate, min_version_for_step, staleness

# --- staleness and the async gate ---------------------------------------------------------------------


@pytest.mark.parametrize("step,loaded,async_level,allowed", [
    (1, 0, 0, True),    # the first batch always uses the initial model
    (2, 0, 0, False),   # synchronous: batch 2 waits for version 1
    (2, 1, 0, True),
    (2, 0, 1, True),    # one step ahead: batch 2 with version 0 while step 1 trains
    (3, 0, 1, False),
    (3, 1, 1, True),
    (10, 7, 2, True),   # 10 - 1 - 2 = 7
    (10, 6, 2, False),
])
def test_async_gate(step, loaded, async_level, allowed):
    assert may_generate(step, loaded, async_level) is allowed
    assert min_version_for_step(step, async_level) == step - 1 - async_level


@pytest.mark.parametrize("step,version,max_off,expected_staleness,stale", [
    (1, 0, 0, 0, False),   # on-policy
    (3, 1, 0, 1, True),
    (3, 1, 1, 1, False),
    (5, 1, 2, 3, True),
    (5, 2, 2, 2, False),
])
def test_staleness_definition(step, version, max_off, expected_staleness, stale):
    assert staleness(step, version) == expected_staleness
    assert is_stale(step, version, max_off) is stale


def test_gate_rejects_nonsense():
    with pytest.raises(ValueError):
        min_version_for_step(0, 1)


# --- completions --------------------------------------------------------------------------------------


def choice(ids, logprobs, text="x"):
    return {"text": text, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}}


def test_completion_request_carries_ids_salt_and_sampling():
    body = get_completion_request([1, 2, 3], {"temperature": 0.7, "topP": 1.0}, 12, 4, seed=9)
    assert body["prompt"] == [1, 2, 3] and body["model"] == constants.SERVED_MODEL_NAME
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["n"] == 1
    assert body["cache_salt"] == "policy-4"
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.7, 1.0, 12, 9)



def test_one_request_per_group_asks_for_n_choices():
    body = get_completion_request([1, 2], {"temperature": 1.0, "topP": 0.9}, 8, 3, seed=5, n=8)
    assert (body["n"], body["seed"], body["cache_salt"], body["top_p"]) == (8, 5, "policy-3", 0.9)
    with pytest.raises(ValueError, match="n must be >= 1"):
        get_completion_request([1, 2], {"temperature": 1.0, "topP": 1.0}, 8, 3, n=0)

def test_parse_completion_choice_keeps_server_ids():
    assert parse_completion_choice(choice([5, 0], [-0.5, -1.0], " a")) == Completion([5, 0], [-0.5, -1.0], " a")


@pytest.mark.parametrize("bad", [
    choice([5, 6], [-0.5, float("nan")]),
    choice([5, 6], [-0.5, None]),
    choice([5, 6], [-0.5, float("-inf")]),
    choice([5, 6], [-0.5]),
    choice([], []),
    {"text": "x", "token_ids": [5], "logprobs": None},
])
def test_broken_samples_are_dropped(bad):
    assert parse_completion_choice(bad) is None


def test_missing_token_ids_is_an_error():
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_completion_choice({"text": "x", "logprobs": {"token_logprobs": [-1.0]}})


# --- batch assembly -----------------------------------------------------------------------------------


def group(index, version, rewards):
    completions = [Completion([10 + i, 0], [-0.1, -0.2], f"c{i}") for i in range(len(rewards))]
    return Group(index, [1, 2], "p", version, completions, list(rewards))


def test_batch_of_whole_groups_with_group_baseline():
    groups = [group(0, 0, [1.0, 0.0, 0.5, 0.5]), group(1, 0, [0.2, 0.4, 0.6, 0.8])]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    samples = out.batch["samples"]
    assert len(samples) == 8 and out.leftover == []
    assert [s["advantage"] for s in samples[:4]] == [0.5, -0.5, 0.0, 0.0]
    assert [round(s["advantage"], 9) for s in samples[4:]] == [-0.3, -0.1, 0.1, 0.3]
    assert samples[0] == {"prompt_ids": [1, 2], "completion_ids": [10, 0], "inference_logprobs": [-0.1, -0.2],
                          "reward": 1.0, "advantage": 0.5, "policy_version": 0, "group": 0}
    assert out.batch["policy_versions"] == [0] and out.batch["step"] == 1
    assert out.batch["reward_mean"] == pytest.approx(0.5)


def test_exact_match_rate_counts_full_rewards_only():
    groups = [group(0, 0, [1.0, 1.0, 1.0, 1.0]), group(1, 0, [1.0, 0.99, 0.0, 0.5])]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    assert out.batch["exact_match_rate"] == pytest.approx(5 / 8)  # the dropped all-right group counts too
    assert get_exact_match_rate([]) is None


@pytest.mark.parametrize("missing, group_size, rate, expected", [
    (128, 8, 1.0, 16), (128, 8, 0.8, 20), (128, 8, 0.1, 64), (128, 8, 0.5, 32), (128, 8, 1.7, 16),
    (5, 8, 1.0, 1), (0, 8, 0.5, 0),
    (-3, 8, 1.0, 0), (24, 8, 0.75, 4)])
def test_plan_group_count(missing, group_size, rate, expected):
    assert plan_group_count(missing, group_size, rate) == expected


def test_plan_group_count_rejects_empty_groups():
    with pytest.raises(ValueError, match="group_size"):
        plan_group_count(8, 0, 1.0)


def test_stale_groups_are_dropped_and_counted():
    groups = [group(0, 1, [1, 0]), group(1, 2, [1, 0]), group(2, 4, [0, 1])]
    out = assemble_batch(5, groups, batch_size=8, max_off_policy_steps=2)  # staleness 3, 2, 0
    assert out.dropped_stale_groups == out.batch["dropped_stale_groups"] == 1
    assert [s["group"] for s in out.batch["samples"]] == [1, 1, 2, 2]
    assert out.batch["policy_versions"] == [2, 4]


def test_zero_advantage_groups_are_filtered_but_count_in_the_reward():
    groups = [group(0, 0, [1, 1, 1, 1]), group(1, 0, [0.3, 0.1 + 0.2, 0.3, 0.3]), group(2, 0, [0, 1, 0, 1])]
    out = assemble_batch(1, groups, batch_size=12, max_off_policy_steps=0)
    assert out.dropped_zero_advantage_groups == 2
    assert [s["group"] for s in out.batch["samples"]] == [2, 2, 2, 2]
    assert out.batch["reward_mean"] == pytest.approx((4 + 1.2 + 2) / 12)


def test_groups_that_do_not_fit_are_left_for_the_next_step():
    groups = [group(i, 0, [0, 1]) for i in range(4)]
    out = assemble_batch(1, groups, batch_size=4, max_off_policy_steps=0)
    assert [s["group"] for s in out.batch["samples"]] == [0, 0, 1, 1]
    assert [g.task_index for g in out.leftover] == [2, 3]
    # next step: the leftover is one step staler
    nxt = assemble_batch(2, out.leftover, batch_size=4, max_off_policy_steps=0)
    assert nxt.dropped_stale_groups == 2 and nxt.batch["samples"] == []


def test_nonfinite_rewards_drop_the_sample_not_the_group():
    groups = [group(0, 0, [1.0, math.nan, 0.0]), group(1, 0, [math.nan, 1.0])]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    assert [(s["group"], s["reward"], s["advantage"]) for s in out.batch["samples"]] == [(0, 1.0, 0.5), (0, 0.0, -0.5)]
    assert out.dropped_nonfinite_rewards == 2 and out.dropped_small_groups == 1
    assert all(math.isfinite(s["advantage"]) for s in out.batch["samples"])


def test_std_normalisation_option():
    out = assemble_batch(1, [group(0, 0, [0.0, 0.5])], batch_size=2, max_off_policy_steps=0, std_normalize=True)
    assert [round(s["advantage"], 3) for s in out.batch["samples"]] == [-1.0, 1.0]


@pytest.mark.parametrize("state,last,expected", [
    (None, None, (1, 0)),
    ({"next_step": 4, "prompt_cursor": 12}, {"step": 3, "prompt_cursor": 12}, (4, 12)),
    ({"next_step": 4, "prompt_cursor": 12}, {"step": 4, "prompt_cursor": 16}, (5, 16)),  # crash after the batch
    (None, {"step": 2, "prompt_cursor": 8}, (3, 8)),
])
def test_resume_point(state, last, expected):
    assert get_resume_point(state, last) == expected


def test_prompts_render_with_the_chat_template_when_there_is_one(tmp_path):
    from transformers import AutoTokenizer

    from rlrun_runtime.tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "model"))
    ids, text = render_prompt(tokenizer, "reverse: a b\nanswer:")
    assert text == "reverse: a b\nanswer:" and ids == tokenizer.encode(text)
    ids, text = render_prompt(tokenizer, [{"role": "user", "content": "reverse: a b"}])
    assert text == "user: reverse: a b\nassistant:" and ids == tokenizer.encode(text, add_special_tokens=False)
