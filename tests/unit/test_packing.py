"""Packing rollouts into micro-batches: alignment, loss mask on completion tokens only, no attention across
samples (checked through a real Qwen3 forward), rank shares, validation."""

import pytest
import torch

from rlrun_runtime.loss import token_logprobs
from rlrun_runtime.packing import (
    count_loss_tokens,
    count_on_policy_tokens,
    get_micro_batch,
    get_micro_batches,
    num_micro_batches,
)
from tiny_qwen3 import make_model


def _sample(prompt, completion, adv=0.5):
    return {"prompt_ids": prompt, "completion_ids": completion,
            "inference_logprobs": [-0.1 * (i + 1) for i in range(len(completion))], "advantage": adv}


def test_alignment_and_mask_cover_completion_tokens_only():
    mb = get_micro_batch([_sample([5, 6, 7], [8, 9], adv=0.5), _sample([3], [4, 10, 11, 12], adv=-1.0)], pad_id=0)
    # row 0: seq 5 6 7 8 9 -> inputs 5 6 7 8, targets 6 7 8 9, completion targets at positions 2, 3
    assert mb.input_ids.tolist() == [[5, 6, 7, 8], [3, 4, 10, 11]]
    assert mb.target_ids.tolist() == [[6, 7, 8, 9], [4, 10, 11, 12]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert mb.loss_mask.tolist() == [[False, False, True, True], [True, True, True, True]]
    assert mb.inference_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert mb.advantages.tolist() == [[0, 0, 0.5, 0.5], [-1, -1, -1, -1]]
    # every masked target is a completion token, and every completion token is masked exactly once
    assert mb.target_ids[mb.loss_mask].tolist() == [8, 9, 4, 10, 11, 12]
    assert mb.num_loss_tokens == count_loss_tokens([_sample([5, 6, 7], [8, 9]), _sample([3], [4, 10, 11, 12])])


def test_on_policy_mask_marks_completion_tokens_of_the_held_version_only():
    samples = [dict(_sample([5, 6, 7], [8, 9]), policy_version=3), dict(_sample([3], [4, 10, 11]), policy_version=2),
               _sample([3], [4])]  # no policy_version: never on-policy
    mb = get_micro_batch(samples, pad_id=0, on_policy_version=3)
    assert mb.on_policy_mask.tolist() == [[False, False, True, True], [False] * 4, [False] * 4]
    assert get_micro_batch(samples, on_policy_version=2).on_policy_mask.tolist()[1] == [True, True, True, False]
    assert not get_micro_batch(samples).on_policy_mask.any()
    assert [count_on_policy_tokens(samples, v) for v in (3, 2, 1, None)] == [2, 3, 0, 0]
    assert not get_micro_batches(samples[:1], 1, rank=1, world_size=2)[0].on_policy_mask.any()  # empty filler


def test_right_padding_is_outside_the_loss():
    mb = get_micro_batch([_sample([5, 6], [7]), _sample([5, 6, 7, 8], [9, 10, 11])], pad_id=0)
    assert mb.input_ids.tolist()[0] == [5, 6, 0, 0, 0, 0]
    assert mb.attention_mask.tolist()[0] == [1, 1, 0, 0, 0, 0]
    assert mb.loss_mask.tolist()[0] == [False, True, False, False, False, False]
    assert mb.num_tokens == 2 + 6


@pytest.mark.timeout(60)
def test_no_attention_across_samples():
    """Each sample's logprobs inside a shared micro-batch equal those of the sample alone."""
    model = make_model(seed=1).eval()
    samples = [_sample([5, 6, 7], [8, 9, 10]), _sample([11] * 12, [12, 13]), _sample([14], [15])]

    def completion_logprobs(mb):
        with torch.no_grad():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        lp = token_logprobs(logits, mb.target_ids)
        return [lp[row][mb.loss_mask[row]].tolist() for row in range(lp.shape[0])]

    together = completion_logprobs(get_micro_batch(samples))
    alone = [completion_logprobs(get_micro_batch([s]))[0] for s in samples]
    for got, expected in zip(together, alone):
        assert got == pytest.approx(expected, abs=1e-5)
    # the check can fail: a sample's logprobs do depend on what it attends to
    other = completion_logprobs(get_micro_batch([_sample([6, 6, 7], [8, 9, 10])]))[0]
    assert other != pytest.approx(alone[0], abs=1e-5)


def test_rank_shares_and_equal_micro_batch_counts():
    samples = [_sample([1 + i], [2]) for i in range(5)]
    assert num_micro_batches(5, micro_batch_size=2, world_size=2) == 2
    r0 = get_micro_batches(samples, 2, rank=0, world_size=2)
    r1 = get_micro_batches(samples, 2, rank=1, world_size=2)
    assert len(r0) == len(r1) == 2
    assert [row[0] for mb in r0 for row in mb.input_ids.tolist()] == [1, 3, 5]
    assert r1[0].input_ids[:, 0].tolist() == [2, 4]
    # rank 1 has 2 samples in one micro-batch plus an empty one to stay in step with rank 0
    assert r1[1].num_loss_tokens == 0
    assert sum(mb.num_loss_tokens for mb in r0 + r1) == 5


@pytest.mark.parametrize("bad, message", [
    ({"prompt_ids": [], "completion_ids": [1], "inference_logprobs": [0.0], "advantage": 0.0}, "prompt_ids is empty"),
    ({"prompt_ids": [1], "completion_ids": [1, 2], "inference_logprobs": [0.0], "advantage": 0.0}, "1 inference_logprobs for 2"),
    ({"prompt_ids": [1], "completion_ids": [1], "inference_logprobs": [float("nan")], "advantage": 0.0}, "non-finite"),
    ({"prompt_ids": [1], "completion_ids": [1], "inference_logprobs": [0.0]}, "missing field 'advantage'"),
])
def test_bad_samples_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        get_micro_batch([_sample([1], [2]), bad])
