"""Expert parallelism's pure parts: which experts a rank holds and how a rank's routed tokens are ordered and
counted per destination (the all-to-alls run in tests/integration/test_trainer_multinode.py, two torchrun
ranks against two data-parallel ones)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlrun_runtime.expert_parallel import get_expert_shard, get_experts_modules, plan_dispatch


def test_each_rank_holds_a_contiguous_equal_share_of_the_experts():
    assert [get_expert_shard(128, 8, r) for r in range(8)] == [(16 * r, 16) for r in range(8)]
    assert get_expert_shard(4, 1, 0) == (0, 4)
    for experts, ep, rank in ((6, 4, 0), (8, 2, 2), (8, 0, 0)):
        with pytest.raises(ValueError):
            get_expert_shard(experts, ep, rank)


@given(ids=st.lists(st.integers(0, 15), min_size=1, max_size=64), ep=st.sampled_from([1, 2, 4, 8]))
def test_dispatch_sorts_by_expert_and_counts_per_destination(ids, ep):
    expert_ids = torch.tensor(ids)
    order, send = plan_dispatch(expert_ids, 16 // ep, ep)
    routed = expert_ids[order]
    assert sorted(order.tolist()) == list(range(len(ids)))  # a permutation: every assignment sent once
    assert routed.tolist() == sorted(ids)
    assert send.tolist() == [sum(1 for i in ids if i // (16 // ep) == r) for r in range(ep)]
    # stable: assignments of one expert keep their token order (the combine after the return relies on order)
    for expert in set(ids):
        positions = order[routed == expert].tolist()
        assert positions == sorted(positions)


def test_the_experts_modules_of_a_moe_model_and_none_of_a_dense_one(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiny_qwen3 import make_model, save_moe_model_dir

    moe = AutoModelForCausalLM.from_pretrained(save_moe_model_dir(tmp_path / "moe"), dtype=torch.float32)
    found = get_experts_modules(moe)
    assert len(found) == 2 and all(m.gate_up_proj.shape[0] == 4 == m.num_experts for m in found)
    assert get_experts_modules(make_model()) == []
