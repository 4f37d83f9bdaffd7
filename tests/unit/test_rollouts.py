"""The orchestrator's pure logic: staleness and the async gate, completion requests, batch assembly, resume."""

from __future__ import annotations

import math

import pytest

from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_api.views import OrchestratorView
from rlrun_runtime.orchestrator import get_resume_empty_streak, get_resume_point, render_prompt
from rlrun_runtime.rollouts import (BAD_LOGPROBS, BAD_TOKEN_IDS, Completion, Group, apply_truncation_policy,
                                   assemble_batch, get_choice_problem, get_completion_request,
                                   get_empty_batch_reason, get_exact_match_rate, parse_completion_choice,
                                   plan_group_count)
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


def choice(ids, logprobs, text="x", finish_reason=None):
    out = {"text": text, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}}
    if finish_reason is not None:
        out["finish_reason"] = finish_reason
    return out


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

def test_parse_completion_choice_keeps_server_ids_and_finish_reason():
    assert parse_completion_choice(choice([5, 0], [-0.5, -1.0], " a")) == Completion([5, 0], [-0.5, -1.0], " a")
    cut = parse_completion_choice(choice([5, 6], [-0.5, -1.0], " a b", finish_reason="length"))
    assert cut == Completion([5, 6], [-0.5, -1.0], " a b", "length") and cut.truncated
    done = parse_completion_choice(choice([5, 0], [-0.5, -1.0], finish_reason="stop"))
    assert done.finish_reason == "stop" and not done.truncated


@pytest.mark.parametrize("bad, problem", [
    (choice([5, 6], [-0.5, float("nan")]), BAD_LOGPROBS),
    (choice([5, 6], [-0.5, None]), BAD_LOGPROBS),
    (choice([5, 6], [-0.5, float("-inf")]), BAD_LOGPROBS),
    (choice([5, 6], [-0.5]), BAD_LOGPROBS),
    ({"text": "x", "token_ids": [5], "logprobs": None}, BAD_LOGPROBS),
    (choice([], []), BAD_TOKEN_IDS),
    # issue 11 §2.4: these used to raise out of make_batch and kill the orchestrator
    (choice([5, None], [-0.5, -1.0]), BAD_TOKEN_IDS),
    ({"text": "x", "logprobs": {"token_logprobs": [-1.0]}}, BAD_TOKEN_IDS),      # no token_ids at all
    ({"text": "x", "token_ids": None, "logprobs": {"token_logprobs": [-1.0]}}, BAD_TOKEN_IDS),
    (choice([5, 1.5], [-0.5, -1.0]), BAD_TOKEN_IDS),
    (choice([5, "6"], [-0.5, -1.0]), BAD_TOKEN_IDS),
    (choice([5, -1], [-0.5, -1.0]), BAD_TOKEN_IDS),
])
def test_broken_samples_are_dropped_with_their_reason(bad, problem):
    assert get_choice_problem(bad) == problem
    assert parse_completion_choice(bad) is None  # never raises
    assert get_choice_problem(choice([5, 6], [-0.5, -1.0])) is None


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
                          "reward": 1.0, "advantage": 0.5, "policy_version": 0, "group": 0, "finish_reason": None}
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


# --- truncation (issue 11 §2.3) -------------------------------------------------------------------


def cut_group(index, rewards, finish_reasons, version=0):
    completions = [Completion([10 + i, 11], [-0.1, -0.2], f"c{i}", reason) for i, reason in enumerate(finish_reasons)]
    return Group(index, [1, 2], "p", version, completions, list(rewards))


# rewards 1.0 (finished), 0.5 (cut at maxTokens), 0.0 (finished), 0.5 (finished)
TRUNCATION_GROUP = ([1.0, 0.5, 0.0, 0.5], ["stop", "length", "stop", "stop"])


def test_keep_trains_a_truncated_completion_like_a_finished_one_and_counts_it():
    out = assemble_batch(1, [cut_group(0, *TRUNCATION_GROUP)], batch_size=8, max_off_policy_steps=0, truncation="keep")
    samples = out.batch["samples"]
    assert [s["finish_reason"] for s in samples] == ["stop", "length", "stop", "stop"]
    assert [s["advantage"] for s in samples] == [0.5, 0.0, -0.5, 0.0]  # mean 0.5
    assert out.batch["truncated_rollouts"] == 1 and out.batch["dropped_truncated_samples"] == 0


def test_zero_reward_scores_a_truncated_completion_0_before_the_baseline():
    out = assemble_batch(1, [cut_group(0, *TRUNCATION_GROUP)], batch_size=8, max_off_policy_steps=0,
                         truncation="zeroReward")
    samples = out.batch["samples"]
    # rewards 1, 0, 0, 0.5: mean 0.375
    assert [s["reward"] for s in samples] == [1.0, 0.0, 0.0, 0.5]
    assert [s["advantage"] for s in samples] == [0.625, -0.375, -0.375, 0.125]
    assert out.batch["reward_mean"] == pytest.approx(0.375) and out.batch["truncated_rollouts"] == 1


def test_mask_keeps_a_truncated_completion_in_the_baseline_but_out_of_the_batch():
    out = assemble_batch(1, [cut_group(0, *TRUNCATION_GROUP)], batch_size=8, max_off_policy_steps=0, truncation="mask")
    samples = out.batch["samples"]
    assert [s["completion_ids"][0] for s in samples] == [10, 12, 13]  # choice 1 (cut) is not trained
    assert [s["advantage"] for s in samples] == [0.5, -0.5, 0.0]      # baseline 0.5 still includes its 0.5
    assert out.batch["dropped_truncated_samples"] == 1 and out.batch["truncated_rollouts"] == 1
    assert out.batch["reward_mean"] == pytest.approx(0.5)


def test_mask_of_a_group_cut_everywhere_leaves_nothing_and_says_so():
    out = assemble_batch(1, [cut_group(0, [1.0, 0.0], ["length", "length"])], batch_size=8, max_off_policy_steps=0,
                         truncation="mask")
    assert out.batch["samples"] == [] and out.batch["dropped_truncated_samples"] == 2
    assert "2 truncated completions were masked" in get_empty_batch_reason(out.batch)


def test_truncation_policy_leaves_a_failed_score_failed_and_rejects_unknown_names():
    rewards, trained = apply_truncation_policy([1.0, math.nan, 0.7], [True, True, False], "zeroReward")
    assert rewards[0] == 0.0 and math.isnan(rewards[1]) and rewards[2] == 0.7 and trained == [True, True, True]
    assert apply_truncation_policy([1.0, 0.7], [True, False], "mask") == ([1.0, 0.7], [False, True])
    with pytest.raises(ValueError, match="unknown truncation policy 'drop'"):
        assemble_batch(1, [cut_group(0, *TRUNCATION_GROUP)], batch_size=8, max_off_policy_steps=0, truncation="drop")


# --- empty batches (issue 11 §2.1) ---------------------------------------------------------------


def test_a_batch_emptied_by_a_failing_scorer_names_the_scorer_as_the_reason():
    groups = [group(i, 0, [math.nan] * 4) for i in range(3)]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    assert out.batch["samples"] == [] and out.batch["dropped_small_groups"] == 3
    batch = {**out.batch, "scorer_errors": 12, "generated_rollouts": 12, "last_scorer_error": "KeyError: 'answer'"}
    assert get_empty_batch_reason(batch) == ("the scorer raised for 12 of 12 rollouts (last: KeyError: 'answer'); "
                                             "3 groups were dropped as too small (fewer than 2 finite rewards)")


def test_a_batch_of_zero_advantage_groups_says_so():
    out = assemble_batch(1, [group(i, 0, [0.0] * 4) for i in range(2)], batch_size=8, max_off_policy_steps=0)
    assert get_empty_batch_reason(out.batch).startswith("2 groups had zero advantage")
    assert get_empty_batch_reason({"samples": []}) == "no rollout was generated"


@pytest.mark.parametrize("state,last,expected", [
    (None, None, 0),
    ({"next_step": 4, "empty_batch_streak": 2}, {"step": 3, "empty_batch_streak": 2}, 2),
    ({"next_step": 4, "empty_batch_streak": 2}, {"step": 4, "empty_batch_streak": 0}, 0),  # crash after the batch
    ({"next_step": 4}, {"step": 3}, 0),                                                   # files from before
])
def test_resume_empty_streak(state, last, expected):
    assert get_resume_empty_streak(state, last) == expected


# --- maxAsyncLevel 0 is on-policy (issue 11 §2.2) ---------------------------------------------------


def orchestrator_view(**algorithm):
    rlrun = {"apiVersion": constants.API_VERSION, "kind": constants.KIND, "metadata": {"name": "t"},
             "spec": {"model": {"name": "rlrun-tiny"}, "environment": {"type": "builtin", "name": "reverse-words"},
                      "algorithm": algorithm}}
    return OrchestratorView.from_spec(apply_defaults(rlrun)["spec"])


def test_max_async_level_0_trains_only_groups_of_the_held_policy():
    view = orchestrator_view(maxAsyncLevel=0)  # maxOffPolicySteps keeps its schema default 2
    assert (view.max_async_level, view.max_off_policy_steps) == (0, 0)
    assert orchestrator_view(maxAsyncLevel=0, maxOffPolicySteps=4).max_off_policy_steps == 0
    assert orchestrator_view(maxAsyncLevel=1).max_off_policy_steps == 2
    # the group generated at version 0 for batch 1 that did not fit is dropped at step 2, not trained
    groups = [group(0, 0, [0, 1]), group(1, 0, [0, 1])]
    first = assemble_batch(1, groups, batch_size=2, max_off_policy_steps=view.max_off_policy_steps)
    assert [g.task_index for g in first.leftover] == [1]
    second = assemble_batch(2, first.leftover + [group(2, 1, [1, 0])], batch_size=2,
                            max_off_policy_steps=view.max_off_policy_steps)
    assert second.dropped_stale_groups == 1 and {s["policy_version"] for s in second.batch["samples"]} == {1}


def test_new_algorithm_fields_default_in_the_view_not_the_schema():
    view = orchestrator_view()
    assert (view.max_empty_batches, view.truncation) == (constants.DEFAULT_MAX_EMPTY_BATCHES, "keep")
    assert "maxEmptyBatches" not in apply_defaults({"spec": {"algorithm": {}}})["spec"]["algorithm"]
    assert "truncation" not in apply_defaults({"spec": {"algorithm": {}}})["spec"]["algorithm"]
    custom = orchestrator_view(maxEmptyBatches=0, truncation="mask")
    assert (custom.max_empty_batches, custom.truncation) == (0, "mask")


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


@pytest.mark.parametrize("changes, ok", [
    ({"truncation": "mask", "maxEmptyBatches": 0}, True),
    ({"truncation": "zeroReward", "maxEmptyBatches": 5}, True),
    ({"truncation": "drop"}, False),
    ({"maxEmptyBatches": -1}, False),
])
def test_the_crd_checks_the_new_algorithm_fields(tiny_example, changes, ok):
    from rlrun_api.validation import validate

    tiny_example["spec"]["algorithm"].update(changes)
    errors = validate(tiny_example)
    assert (errors == []) is ok, errors
    if not ok:
        assert [e.path for e in errors] == [f"spec.algorithm.{next(iter(changes))}"]
