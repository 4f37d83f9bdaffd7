"""Packing rollouts into micro-batches: alignment, loss mask on completion tokens only, no attention across
samples (checked through a real Qwen3 forward), rank shares, validation; packed rows with document masks
against padded rows and an HF reference forward."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrun_runtime.logprobs import install_logprob_head
from rlrun_runtime.loss import token_logprobs
from rlrun_runtime.packed_attention import get_block_document_mask, get_dense_document_mask
from rlrun_runtime.packing import (
    MicroBatch,
    count_loss_tokens,
    count_on_policy_tokens,
    get_micro_batch,
    get_micro_batches,
    get_packed_micro_batch,
    get_packed_micro_batches,
    num_micro_batches,
    pack_lengths,
    sample_input_tokens,
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


# --- packed rows (algorithm.microBatchTokens) -------------------------------------------------------------


def _packed_samples():
    return [_sample([5, 6, 7], [8, 9, 10]), _sample([11] * 12, [12, 13]), _sample([14], [15]),
            _sample([3, 4], [20, 21, 22, 23, 24, 25])]


def test_pack_lengths_first_fit_longest_first_within_the_budget():
    assert pack_lengths([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]  # 5 + 2, then 4 + 3
    assert pack_lengths([9, 2, 2], 4) == [[0], [1, 2]]  # longer than the budget: a row of its own
    assert pack_lengths([], 4) == []
    for lengths, budget in (([3, 1, 4, 1, 5, 9, 2, 6], 10), ([7] * 5, 14)):
        bins = pack_lengths(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    with pytest.raises(ValueError, match="token_budget"):
        pack_lengths([1], 0)


def test_packed_row_restarts_positions_and_matches_the_padded_rows_per_document():
    samples = _packed_samples()
    padded = get_micro_batch(samples, pad_id=0, on_policy_version=None)
    packed = get_packed_micro_batch(samples, pad_id=0, pad_multiple=8)
    lengths = [sample_input_tokens(s) for s in samples]
    assert packed.input_ids.shape == (1, 32)  # 5 + 13 + 1 + 7 = 26 tokens, padded to a multiple of 8
    at = 0
    for doc, n in enumerate(lengths):
        assert packed.position_ids[0, at:at + n].tolist() == list(range(n))
        assert packed.doc_ids[0, at:at + n].tolist() == [doc] * n
        for name in ("input_ids", "target_ids", "loss_mask", "inference_logprobs", "advantages", "attention_mask"):
            assert getattr(packed, name)[0, at:at + n].tolist() == getattr(padded, name)[doc, :n].tolist(), name
        at += n
    assert packed.doc_ids[0, at:].tolist() == [-1] * (32 - at)
    assert not packed.loss_mask[0, at:].any() and not packed.attention_mask[0, at:].any()
    assert packed.num_tokens == padded.num_tokens == sum(lengths)
    assert packed.num_loss_tokens == count_loss_tokens(samples)


_token = st.integers(0, 1000)
_packed_sample = st.builds(
    lambda prompt, completion, adv, version, lps: {
        "prompt_ids": prompt, "completion_ids": completion, "advantage": adv, "policy_version": version,
        "inference_logprobs": (lps * len(completion))[:len(completion)]},
    st.lists(_token, min_size=1, max_size=6), st.lists(_token, max_size=6),
    st.floats(-3, 3, allow_nan=False), st.sampled_from([None, 0, 1]),
    st.lists(st.floats(-20, 0, allow_nan=False), min_size=1, max_size=3))


@settings(max_examples=200, deadline=None)
@given(samples=st.lists(_packed_sample, min_size=1, max_size=6), multiple=st.sampled_from([1, 4, 16]),
       version=st.sampled_from([None, 0, 1]))
def test_every_packed_row_equals_the_padded_rows_per_document(samples, multiple, version):
    """One-token samples without a completion, empty completions, on-policy mixes: the packed row's tensors are
    the padded layout's (an independent per-sample construction) at each document's positions."""
    padded = get_micro_batch(samples, pad_id=7, on_policy_version=version)
    packed = get_packed_micro_batch(samples, pad_id=7, on_policy_version=version, pad_multiple=multiple)
    lengths = [sample_input_tokens(s) for s in samples]
    used = sum(lengths)
    assert packed.input_ids.shape == (1, -(-used // multiple) * multiple)
    at = 0
    for doc, n in enumerate(lengths):
        assert packed.position_ids[0, at:at + n].tolist() == list(range(n))
        assert packed.doc_ids[0, at:at + n].tolist() == [doc] * n
        for name in ("input_ids", "target_ids", "loss_mask", "inference_logprobs", "advantages", "attention_mask",
                     "on_policy_mask"):
            got, want = getattr(packed, name)[0, at:at + n], getattr(padded, name)[doc, :n]
            assert got.dtype == want.dtype and got.tolist() == want.tolist(), (name, doc)
        at += n
    tail = packed.input_ids.shape[1] - used
    assert packed.doc_ids[0, used:].tolist() == [-1] * tail and packed.input_ids[0, used:].tolist() == [7] * tail
    assert packed.target_ids[0, used:].tolist() == [7] * tail and not packed.loss_mask[0, used:].any()
    assert packed.num_loss_tokens == count_loss_tokens(samples)


def test_non_finite_inference_logprobs_and_advantages_beyond_float32_are_named():
    for bad in (float("inf"), float("-inf"), float("nan")):
        sample = _sample([1], [2, 3])
        sample["inference_logprobs"] = [-1.0, bad]
        with pytest.raises(ValueError, match="sample 1: non-finite inference_logprobs"):
            get_packed_micro_batch([_sample([1], [2]), sample])
    huge = _sample([1], [2], adv=1e39)  # finite, but not as float32
    with pytest.raises(ValueError, match="sample 0: advantage 1e.39 is beyond float32's range"):
        get_packed_micro_batch([huge])
    mixed = _sample([1], [2, 3])
    mixed["inference_logprobs"] = [float("inf"), float("-inf")]  # a sum of nan
    with pytest.raises(ValueError, match="sample 0: non-finite inference_logprobs"):
        get_packed_micro_batch([mixed])


def test_packed_micro_batches_respect_the_budget_and_keep_ranks_in_step():
    samples = [_sample([1] * (1 + i), [2] * (1 + i % 3)) for i in range(9)]
    for world in (1, 2, 3):
        shares = [get_packed_micro_batches(samples, 12, rank=r, world_size=world) for r in range(world)]
        assert len({len(s) for s in shares}) == 1
        assert sum(mb.num_loss_tokens for s in shares for mb in s) == count_loss_tokens(samples)
        for share in shares:
            for mb in share:
                assert mb.input_ids.shape[0] == 1 and mb.num_tokens <= 12
                assert mb.doc_ids is not None and mb.position_ids is not None
    filler = get_packed_micro_batches(samples[:1], 12, rank=1, world_size=2)
    assert len(filler) == 1 and filler[0].num_loss_tokens == 0 and filler[0].doc_ids is not None


def test_dense_document_mask_is_block_diagonal_causal():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = get_dense_document_mask(docs)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0],
                    [0, 0, 1, 0, 0, 0],
                    [0, 0, 1, 1, 0, 0],
                    [0, 0, 1, 1, 1, 0],
                    [0, 0, 0, 0, 0, 1]]


@pytest.mark.timeout(300)
def test_block_document_mask_matches_the_dense_mask_for_every_layout():
    """The compiled ``create_block_mask`` gives, for two different layouts in turn, exactly the dense mask's
    blocks: a block is listed iff any position in it may attend and is full iff all may; FlexAttention through it
    equals SDPA through the dense mask. A dynamic graph or two serve every layout, row length and query shard
    (Dynamo's recompile limit would otherwise send it back to the eager, [T, T] version)."""
    from torch import _dynamo
    from torch.nn.attention.flex_attention import flex_attention

    graphs = _dynamo.utils.counters["stats"]["unique_graphs"]

    length, block = 512, 128
    for sizes in ([100, 300, 50], [128, 128, 200, 10, 1]):
        ids = torch.full((1, length), -1)
        start = 0
        for doc, size in enumerate(sizes):
            ids[0, start:start + size] = doc
            start += size
        dense = get_dense_document_mask(ids)[0, 0]
        mask = get_block_document_mask(ids)
        tiles = dense.view(length // block, block, length // block, block).permute(0, 2, 1, 3).flatten(2)
        listed = mask.to_dense()[0, 0].bool()
        kv_num, kv_idx, full_num, full_idx = (t[0, 0] for t in mask.as_tuple()[2:6])
        full = torch.zeros_like(listed)
        for row in range(length // block):
            full[row, full_idx[row, :full_num[row]]] = True
        assert torch.equal(listed, tiles.any(-1)), sizes
        assert torch.equal(full, tiles.all(-1)), sizes
        q, k, v = (torch.randn(1, 2, length, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=mask), want, rtol=1e-5, atol=1e-5)
    from rlrun_runtime.context_parallel import get_shard_positions

    for width in (1024, 2048):  # rows
        get_block_document_mask((torch.arange(width) // 300)[None])
    for width, cp, rank in ((2048, 2, 1), (4096, 2, 0), (4096, 4, 3)):  # context-parallel shards
        doc = (torch.arange(width) // 300)[None]
        keys = torch.cat([get_shard_positions(width, r, cp) for r in range(cp)])
        queries = get_shard_positions(width, rank, cp)
        get_block_document_mask(doc[:, queries], doc[:, keys], queries, keys)
    # 7 shapes (2 above): one graph for rows, one for shards, one more for eager FlexAttention's own trace above;
    # static shapes: 7 mask graphs
    assert _dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 3


def _reference_logprobs(model, sample, temperature):
    """HF reference: the sample alone through the unmodified model, log-softmax in float64."""
    seq = torch.tensor([sample["prompt_ids"] + sample["completion_ids"]])
    with torch.no_grad():
        logits = model(input_ids=seq[:, :-1]).logits.double() / temperature
    lp = torch.log_softmax(logits, dim=-1).gather(-1, seq[:, 1:].unsqueeze(-1)).squeeze(-1)[0]
    return lp[len(sample["prompt_ids"]) - 1:].tolist()


@pytest.mark.timeout(120)
def test_packed_logprobs_and_gradients_equal_unpacked_and_the_hf_reference():
    """Trainer logprobs (LogprobHead, packed row, dense document mask through SDPA) equal each document alone
    through the unmodified HF model (float32 model, float64 reference: within 2e-5 nats), and the gradients of
    the packed row equal those of padded rows (atol 2e-6 times the gradient's largest magnitude, at least 1)."""
    from rlrun_runtime.trainer import get_micro_batch_logprobs

    reference = make_model(seed=2)
    model = make_model(seed=2)
    assert install_logprob_head(model)
    samples = _packed_samples()
    cpu = torch.device("cpu")

    def per_document(mb, lp):
        if mb.doc_ids is None:
            return [lp[row][mb.loss_mask[row]].tolist() for row in range(lp.shape[0])]
        return [lp[0][mb.loss_mask[0] & (mb.doc_ids[0] == d)].tolist() for d in range(len(samples))]

    def run(mb):
        model.zero_grad(set_to_none=True)
        lp = get_micro_batch_logprobs(model, mb, 0.7, cpu)
        (lp * torch.where(mb.loss_mask, 1.0 + mb.advantages, 0.0)).sum().backward()
        return per_document(mb, lp.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_lp, packed_grads = run(get_packed_micro_batch(samples, pad_multiple=16))
    padded_lp, padded_grads = run(get_micro_batch(samples))
    for doc, sample in enumerate(samples):
        expected = _reference_logprobs(reference, sample, 0.7)
        assert packed_lp[doc] == pytest.approx(expected, abs=2e-5)
        assert padded_lp[doc] == pytest.approx(expected, abs=2e-5)
    for name, grad in packed_grads.items():
        # float32 sums in another order: the absolute error grows with the gradient's scale (the embedding's
        # reaches ~12, where one element differed by 6.7e-6 on an AMD EPYC); a missing mask differs by >1e-2
        scale = max(1.0, float(padded_grads[name].abs().max()))
        torch.testing.assert_close(grad, padded_grads[name], atol=2e-6 * scale, rtol=1e-4, msg=name)
    # the check can fail: without the document mask, later documents attend to earlier ones
    row = get_packed_micro_batch(samples)
    with torch.no_grad():
        leaky = get_micro_batch_logprobs(model, MicroBatch(**{**row.__dict__, "doc_ids": None}), 0.7, cpu)
    assert per_document(row, leaky)[1] != pytest.approx(packed_lp[1], abs=1e-3)
