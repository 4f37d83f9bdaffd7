"""Context parallelism's pure parts: rank coordinates, row shards and the shard's masks (the gathering
attention runs in tests/integration/test_trainer_multinode.py, two torchrun ranks against one)."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun_runtime.context_parallel import get_cp_coords, get_shard_positions, shard_micro_batch
from rlrun_runtime.packed_attention import get_block_document_mask, get_dense_document_mask, get_model_inputs
from rlrun_runtime.packing import get_micro_batch, get_packed_micro_batch, get_packed_micro_batches


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
    row = _row(pad_multiple=8)
    width = row.input_ids.shape[1]
    shards = [shard_micro_batch(row, r, cp) for r in range(cp)]
    order = torch.cat([s.query_positions for s in shards])
    assert sorted(order.tolist()) == list(range(width))  # every position in exactly one shard
    for name in ("input_ids", "attention_mask", "target_ids", "loss_mask", "inference_logprobs", "advantages",
                 "on_policy_mask", "position_ids", "doc_ids"):
        assert torch.equal(torch.cat([getattr(s, name) for s in shards], dim=1), getattr(row, name)[:, order]), name
    for s in shards:  # the keys in the order the all-gather delivers them: the shards in rank order
        assert torch.equal(s.key_positions, order) and torch.equal(s.kv_doc_ids, row.doc_ids[:, order])
    assert sum(s.num_loss_tokens for s in shards) == row.num_loss_tokens == 12
    assert width == 32
    with pytest.raises(ValueError, match="does not split into 6"):
        shard_micro_batch(row, 0, 3)
    with pytest.raises(ValueError, match="packed rows only"):
        shard_micro_batch(get_micro_batch([_sample([1], [2])]), 0, 2)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_each_rank_takes_chunks_i_and_2cp_minus_1_minus_i_so_causal_work_is_equal(cp):
    """Llama 3's layout: for one causal document over the row, the attention work of a position is its index + 1,
    so every rank's sum is the same."""
    width = 2 * cp * 16
    shares = [get_shard_positions(width, r, cp) for r in range(cp)]
    assert shares[0][:16].tolist() == list(range(16)) and shares[0][16:].tolist() == list(range(width - 16, width))
    assert sorted(torch.cat(shares).tolist()) == list(range(width))
    assert len({int((share + 1).sum()) for share in shares}) == 1
    with pytest.raises(ValueError):
        get_shard_positions(width + 2, 0, cp) if cp > 1 else get_shard_positions(width, 1, cp)


def _random_row(rng, width):
    """A packed row of documents of random lengths (4-300 tokens) filling ``width`` up to a padding tail."""
    samples, used = [], 0
    while True:
        size = rng.randint(4, 300)
        if used + size > width - 8:
            break
        samples.append(_sample([rng.randint(2, 50) for _ in range(size - 2)], [rng.randint(2, 50) for _ in range(2)]))
        used += size - 1
    return get_packed_micro_batch(samples, pad_multiple=width)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [2, 4])
def test_a_shards_masks_are_its_rows_of_the_whole_rows_mask(cp):
    """Queries of a shard against every key of the row, real documents in every shard and several query blocks
    each: the dense mask is exactly the shard's rows of the unsharded mask; the FlexAttention block mask lists
    exactly its blocks (any true) and marks exactly its full ones (all true); FlexAttention through it equals
    SDPA through the dense mask, and the unsharded row's attention at the shard's positions. Dropping the
    positions anywhere fails them."""
    import random

    from torch.nn.attention.flex_attention import flex_attention

    rng = random.Random(cp)
    cpu = torch.device("cpu")
    for _ in range(2):
        row = _random_row(rng, 1024)
        full = get_dense_document_mask(row.doc_ids)[0, 0]
        q, k, v = (torch.randn(1, 2, 1024, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        size = 1024 // cp
        for rank in range(cp):
            shard = shard_micro_batch(row, rank, cp)
            assert shard.num_tokens > 0  # real documents in every shard
            rows, keys = shard.query_positions, shard.key_positions
            dense = get_model_inputs(shard, cpu, "sdpa")["attention_mask"]
            assert torch.equal(dense[0, 0], full[rows][:, keys])
            block = get_model_inputs(shard, cpu, "rlrun_cp_flex_attention")["attention_mask"]
            assert block.shape[-2:] == (size, 1024)
            tiles = dense[0, 0].view(size // 128, 128, 8, 128).permute(0, 2, 1, 3).flatten(2)
            kv_num, kv_idx, full_num, full_idx = (t[0, 0] for t in block.as_tuple()[2:6])
            listed, whole = torch.zeros(size // 128, 8, dtype=torch.bool), torch.zeros(size // 128, 8, dtype=torch.bool)
            for i in range(size // 128):
                listed[i, kv_idx[i, :kv_num[i]]] = True
                whole[i, full_idx[i, :full_num[i]]] = True
            assert torch.equal(whole, tiles.all(-1)), rank
            assert torch.equal(listed | whole, tiles.any(-1)), rank
            got = flex_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], block_mask=block)
            want = torch.nn.functional.scaled_dot_product_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                                                    attn_mask=dense)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # and both equal the unsharded row's attention at the shard's positions
            whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full)
            torch.testing.assert_close(got, whole[:, :, rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world,cp", [(2, 2), (4, 2), (6, 3), (8, 4)])
def test_data_parallel_times_context_parallel_shares(world, cp):
    """Every rank runs as many micro-batches; the shards of a group join back into the group's rows, and the
    groups' loss tokens add up to the batch's (each token's loss computed exactly once)."""
    import random

    from rlrun_runtime.packing import count_loss_tokens
    from rlrun_runtime.trainer import get_step_micro_batches
    from rlrun_api.views import TrainerView

    rng = random.Random(world * 10 + cp)
    samples = [_sample([rng.randint(2, 50) for _ in range(rng.randint(1, 40))],
                       [rng.randint(2, 50) for _ in range(rng.randint(1, 30))]) for _ in range(37)]
    cfg = TrainerView(model_name="m", model_revision=None, max_steps=1, micro_batch_size=None, learning_rate=1e-3,
                      weight_decay=0.0, max_grad_norm=1.0, lr_schedule="constant", lr_warmup_steps=0,
                      temperature=1.0, ratio_low=0.1, ratio_high=10.0, kl_coef=0.0, checkpoint_interval=1,
                      checkpoint_keep=1, dtype="float32", use_gpu=False, nodes=world, gpus_per_node=0, fsdp=-1, ep=1,
                      cp=cp, lora_rank=0, quantization="none", micro_batch_tokens=96)
    for device in (torch.device("cpu"), torch.device("cuda")):
        shares = [get_step_micro_batches(samples, cfg, r, world, 0, 0, device) for r in range(world)]
        assert len({len(share) for share in shares}) == 1
        loss_tokens = 0
        for group in range(world // cp):
            ranks = shares[group * cp:(group + 1) * cp]
            for shards in zip(*ranks):
                width = sum(s.input_ids.shape[1] for s in shards)
                assert sorted(torch.cat([s.query_positions for s in shards]).tolist()) == list(range(width))
                # on GPU each of the 2 cp chunks is whole 128-token blocks, the row a multiple of 1024
                assert width % (math.lcm(1024, 256 * cp) if device.type == "cuda" else 2 * cp) == 0
                assert torch.equal(shards[0].kv_doc_ids, torch.cat([s.doc_ids for s in shards], dim=1))
                loss_tokens += sum(s.num_loss_tokens for s in shards)
        assert loss_tokens == count_loss_tokens(samples)


@pytest.mark.timeout(600)
def test_compiled_flex_attention_through_shard_masks_at_two_row_lengths():
    """The fused (compiled) FlexAttention, as the trainer runs it on GPU, through each shard's block mask at two
    row lengths (the second compile is the dynamic-shape one) equals SDPA through the dense mask. Forward only:
    compiled FlexAttention has no backward on CPU. A shard mask_mod reading several captured tensors by q and by
    k failed to compile here (torch 2.13, CPU) at the second length."""
    import random

    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention)
    rng = random.Random(5)
    for width in (1024, 2048):
        row = _random_row(rng, width)
        for rank in range(2):
            shard = shard_micro_batch(row, rank, 2)
            args = (shard.doc_ids, shard.kv_doc_ids, shard.query_positions, shard.key_positions)
            gen = torch.Generator().manual_seed(width + rank)
            q = torch.randn(1, 2, width // 2, 16, generator=gen)
            k, v = (torch.randn(1, 2, width, 16, generator=gen) for _ in range(2))
            got = compiled(q, k, v, block_mask=get_block_document_mask(*args))
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=get_dense_document_mask(*args))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
