"""Context parallelism's pure parts: rank coordinates, row shards and the shard's masks (the gathering
attention runs in tests/integration/test_trainer_multinode.py, two torchrun ranks against one)."""

from __future__ import annotations

import pytest
import torch

from rlrun_runtime.context_parallel import get_cp_coords, shard_micro_batch
from rlrun_runtime.packed_attention import get_block_document_mask, get_dense_document_mask, get_model_inputs
from rlrun_runtime.packing import get_micro_batch, get_packed_micro_batch


def _sample(prompt, completion):
    return {"prompt_ids": prompt, "completion_ids": completion, "inference_logprobs": [-1.0] * len(completion),
            "advantage": 0.5, "policy_version": 0}


def _row(pad_multiple=4):
    samples = [_sample([5, 6, 7], [8, 9, 10]), _sample([11] * 12, [12, 13]), _sample([14], [15]),
               _sample([3, 4], [20, 21, 22, 23, 24, 25])]
    return get_packed_micro_batch(samples, pad_multiple=pad_multiple)


def test_groups_are_consecutive_ranks():
    assert [get_cp_coords(r, 8, 2) for r in range(8)] == [(0, 4, 0), (0, 4, 1), (1, 4, 0), (1, 4, 1),
                                                          (2, 4, 0), (2, 4, 1), (3, 4, 0), (3, 4, 1)]
    assert [get_cp_coords(r, 4, 1) for r in range(4)] == [(r, 4, 0) for r in range(4)]
    for rank, world, cp in ((0, 6, 4), (0, 4, 0), (4, 4, 2)):
        with pytest.raises(ValueError):
            get_cp_coords(rank, world, cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_shards_cut_every_position_tensor_and_keep_the_row_for_the_keys(cp):
    row = _row(pad_multiple=4)
    width = row.input_ids.shape[1]
    shards = [shard_micro_batch(row, r, cp) for r in range(cp)]
    for name in ("input_ids", "attention_mask", "target_ids", "loss_mask", "inference_logprobs", "advantages",
                 "on_policy_mask", "position_ids", "doc_ids"):
        assert torch.equal(torch.cat([getattr(s, name) for s in shards], dim=1), getattr(row, name)), name
    assert [s.query_offset for s in shards] == [r * width // cp for r in range(cp)]
    assert all(s.kv_doc_ids is row.doc_ids for s in shards)
    assert sum(s.num_loss_tokens for s in shards) == row.num_loss_tokens == 12
    with pytest.raises(ValueError, match="does not split into 3"):
        shard_micro_batch(row, 0, 3) if width % 3 else shard_micro_batch(_row(pad_multiple=5), 0, 3)
    with pytest.raises(ValueError, match="packed rows only"):
        shard_micro_batch(get_micro_batch([_sample([1], [2])]), 0, 2)


def test_a_shards_masks_are_its_rows_of_the_whole_rows_mask():
    """Queries of a shard against every key of the row: the dense mask is exactly the shard's rows of the
    unsharded mask, and the FlexAttention block mask lists exactly its blocks (any / all true)."""
    row = _row(pad_multiple=256)  # 26 real tokens, then padding: 2 shards of 128 = one block each
    full = get_dense_document_mask(row.doc_ids)[0, 0]
    cpu = torch.device("cpu")
    for rank in range(2):
        shard = shard_micro_batch(row, rank, 2)
        dense = get_model_inputs(shard, cpu, "sdpa")["attention_mask"][0, 0]
        assert torch.equal(dense, full[rank * 128:(rank + 1) * 128])
        block = get_model_inputs(shard, cpu, "rlrun_cp_flex_attention")["attention_mask"]
        tiles = dense.view(1, 128, 2, 128).permute(0, 2, 1, 3).flatten(2)
        assert torch.equal(block.to_dense()[0, 0].bool(), tiles.any(-1)), rank
        assert block.shape[-2:] == (128, 256)
    # the padding shard's queries see only the padding: its own document, causal
    assert int(row.attention_mask.sum()) == 26 and not full[128:, :26].any() and full[200, 26:201].all()
