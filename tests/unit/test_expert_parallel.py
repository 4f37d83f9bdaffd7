"""Expert parallelism's pure parts: which experts a rank holds and how a rank's routed tokens are ordered and
counted per destination (the all-to-alls run in tests/integration/test_trainer_multinode.py, two torchrun
ranks against two data-parallel ones)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrun_runtime.expert_parallel import get_expert_shard, get_experts_modules, plan_dispatch


def test_each_rank_holds_a_contiguous_equal_share_of_the_experts():
    assert [get_expert_shard(128, 8, r) for r in range(8)] == [(16 * r, 16) for r in range(8)]
    assert get_expert_shard(4, 1, 0) == (0, 4)
    for experts, ep, rank in ((6, 4, 0), (8, 2, 2), (8, 0, 0)):
        with pytest.raises(ValueError):
            get_expert_shard(experts, ep, rank)


@settings(deadline=None)
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


def test_one_rank_dispatch_equals_transformers_and_frozen_experts_stay_frozen(tmp_path, world_of_one):
    """On a mesh of one rank the dispatch path (sort, all-to-alls, grouped GEMM over the local experts, return,
    routing weights, sum over k) gives transformers' own experts output and gradients; experts frozen before
    (LoRA) stay frozen, trainable ones keep training."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from rlrun_runtime.expert_parallel import install_expert_parallel
    from rlrun_runtime.moe import get_load_kwargs
    from tiny_qwen3 import save_moe_model_dir

    path = save_moe_model_dir(tmp_path / "moe")
    load = dict(dtype=torch.float32, **get_load_kwargs(AutoModelForCausalLM.from_pretrained(path).config))
    ids = torch.randint(2, 60, (1, 24), generator=torch.Generator().manual_seed(0))

    def run(model):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        (logits.square().mean()).backward()
        grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                 for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads

    want, want_grads = run(AutoModelForCausalLM.from_pretrained(path, **load))
    model = AutoModelForCausalLM.from_pretrained(path, **load)
    params = install_expert_parallel(model, init_device_mesh("cpu", (1,)), torch.float32)
    assert len(params) == 4  # 2 layers x (gate_up_proj, down_proj)
    got, got_grads = run(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)

    frozen = AutoModelForCausalLM.from_pretrained(path, **load)
    frozen.requires_grad_(False)
    assert all(not p.requires_grad for p in install_expert_parallel(frozen, init_device_mesh("cpu", (1,)),
                                                                     torch.float32))


def test_clipping_over_parameter_groups_equals_one_clip_over_all_of_them():
    from rlrun_runtime.expert_parallel import clip_grad_norm_by_mesh, get_param_groups_by_mesh

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(5)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    reference = [p.grad.clone() for p in params]
    assert get_param_groups_by_mesh(params) == [params]  # plain tensors: one group
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in reference]))
    norm = clip_grad_norm_by_mesh([params[:2], params[2:]], 1.0)  # two groups, as two meshes give
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6) and norm.item() > 1  # so it clipped
    scale = 1.0 / (expected.item() + 1e-6)
    for p, g in zip(params, reference):
        torch.testing.assert_close(p.grad, g * scale)
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("norm,max_norm,divisor", [(0.5, 1.0, 1.0), (1.0, 1.0, 1.0), (4.0, 1.0, 4.000001),
                                                     (3.0, 0.5, 6.000002), (float("inf"), 1.0, float("inf"))])
def test_clip_divisor_undoes_torchs_clip_coefficient(norm, max_norm, divisor):
    from rlrun_runtime.expert_parallel import get_clip_divisor

    got = get_clip_divisor(torch.tensor(norm, dtype=torch.float64), max_norm)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(divisor, rel=1e-6)
    param = torch.nn.Parameter(torch.zeros(7))
    grad = torch.randn(7)
    param.grad = grad.clone()
    torch.nn.utils.clip_grads_with_norm_([param], max_norm, torch.tensor(norm))  # torch's clip, in place
    torch.testing.assert_close(grad / got, param.grad, rtol=1e-6, atol=0)


def test_replica_gradients_are_summed_in_order_in_bounded_buckets(world_of_one, monkeypatch):
    """One process stands for two replicas holding equal gradients: the fake all-reduce doubles each bucket, and
    every gradient must come back doubled, in buckets within the bound, in the parameters' order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from rlrun_runtime.expert_parallel import all_reduce_replica_grads

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replica", "ep"))
    shapes = [(4, 6, 3), (4, 3, 3), (4, 6, 3), (4, 3, 3), (4, 8, 8)]
    params = [torch.nn.Parameter(DTensor.from_local(torch.randn(s), mesh, [Replicate(), Shard(0)], run_check=False))
              for s in shapes]
    for p in params[:-1]:
        p.grad = DTensor.from_local(torch.randn(p.shape), mesh, p.placements, run_check=False)
    before = [p.grad.to_local().clone() for p in params[:-1]]
    sizes = []

    def fake_all_reduce(tensor, group=None):
        sizes.append(tensor.numel())
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    all_reduce_replica_grads(None, params, bucket_bytes=4 * 120)  # 120 float32 values a bucket
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad.to_local(), 2 * b)
    assert torch.equal(params[-1].grad.to_local(), torch.zeros(4, 8, 8))  # no gradient: zeros took part
    assert sizes == [72 + 36, 72 + 36, 256]  # in order; the 256-value tensor alone, over the bound
