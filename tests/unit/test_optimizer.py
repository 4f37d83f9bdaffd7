"""ShardLocalAdamW against torch's AdamW over FSDP2's DTensor parameters: the same weights, moments and state
dict bit for bit, and torch's own step wherever local shards would not line up."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8, bias=False),
                               torch.nn.Linear(8, 4))


def _sharded(seed: int = 0) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _grads(model: torch.nn.Module, step: int) -> None:
    """Gradients of a fixed loss on step-dependent inputs (real backward through FSDP2)."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, 8, generator=gen)
    model(x).pow(2).sum().backward()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(cls: type, sharded: bool, steps: int = 4, grad_scale: float | None = None, **kwargs):
    from torch.distributed.tensor import DTensor, Replicate

    model = _sharded() if sharded else _model()
    params = list(model.parameters())
    optimizer = cls([{"params": params[:3]}, {"params": params[3:], "lr": 3e-2}], lr=1e-2, weight_decay=0.1,
                    **kwargs)
    for step in range(steps):
        _grads(model, step)
        if step == 1:
            params[-1].grad = None  # a parameter without a gradient is skipped, as by torch
        if grad_scale is not None:
            scale = torch.tensor(grad_scale)
            optimizer.grad_scale = (DTensor.from_local(scale, params[0].device_mesh, [Replicate()], run_check=False)
                                    if sharded else scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights = [_full(p).detach().clone() for p in params]
    state = {k: {n: _full(v).clone() if torch.is_tensor(v) else v for n, v in s.items()}
             for k, s in optimizer.state_dict()["state"].items()}
    return weights, state, optimizer


CASES = [pytest.param({"fused": True}, None, id="fused"),
         pytest.param({"fused": True}, 2.5, id="fused-grad-scale"),
         pytest.param({"foreach": True}, None, id="foreach"),
         pytest.param({"foreach": False}, None, id="single-tensor"),
         pytest.param({"fused": True, "amsgrad": True, "maximize": True}, None, id="fused-amsgrad-maximize")]


@pytest.mark.parametrize("sharded", [True, False], ids=["dtensor", "plain"])
@pytest.mark.parametrize("kwargs, grad_scale", CASES)
def test_the_same_update_and_state_as_torch_adamw_bit_for_bit(world_of_one, monkeypatch, sharded, kwargs,
                                                               grad_scale):
    from rlrun_runtime.optimizer import ShardLocalAdamW

    ref_weights, ref_state, _ = _run(torch.optim.AdamW, sharded, grad_scale=grad_scale, **kwargs)
    torch_steps = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: torch_steps.append(1) or original(self, *a))
    weights, state, optimizer = _run(ShardLocalAdamW, sharded, grad_scale=grad_scale, **kwargs)
    assert torch_steps == [1]  # torch initialised the state in step 1; steps 2-4 ran on the local tensors
    moved = max((w - _full(p0).detach()).abs().max().item() for w, p0 in zip(weights, _model().parameters()))
    assert moved > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        assert state[key].keys() == ref_state[key].keys()
        for name, value in ref_state[key].items():
            assert torch.equal(state[key][name], value), (key, name)
    if sharded:  # the moments stay DTensors: checkpoints (DCP) see what they saw with torch's AdamW
        assert type(optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]).__name__ == "DTensor"


def test_torch_steps_where_a_gradient_is_sharded_unlike_its_parameter(world_of_one, monkeypatch):
    """A gradient replicated where its parameter is sharded (the local tensors would not be the same slices at
    more than one rank): the whole step is torch's own, over the DTensors."""
    from torch.distributed.tensor import DTensor, Replicate

    from rlrun_runtime.optimizer import ShardLocalAdamW

    model = _sharded()
    params = list(model.parameters())
    optimizer = ShardLocalAdamW(params, lr=1e-2, fused=True)
    _grads(model, 0)
    optimizer.step()  # torch's: the state is initialised
    _grads(model, 1)
    odd = params[0].grad
    params[0].grad = DTensor.from_local(odd.full_tensor(), odd.device_mesh, [Replicate()], run_check=False)
    assert optimizer._plan_local() is None
    params[0].grad = odd.full_tensor()  # a plain tensor where a DTensor belongs: no placements, the same fallback
    assert optimizer._plan_local() is None
    params[0].grad = DTensor.from_local(odd.full_tensor(), odd.device_mesh, [Replicate()], run_check=False)
    torch_steps = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: torch_steps.append(1) or original(self, *a))
    optimizer.step()
    assert torch_steps == [1]
    params[0].grad = odd
    assert optimizer._plan_local() is not None
    optimizer.grad_scale = torch.tensor(2.0)  # a plain tensor is the whole value: the local path takes it
    assert optimizer._plan_local() is not None
    from torch.distributed.tensor import Partial

    # a DTensor grad_scale that is not replicated: its local tensor is not the whole value (torch's step
    # redistributes it)
    optimizer.grad_scale = DTensor.from_local(torch.tensor(2.0), odd.device_mesh, [Partial()], run_check=False)
    assert optimizer._plan_local() is None
    optimizer.grad_scale = None
    optimizer.param_groups[0]["differentiable"] = True  # torch's own step handles differentiable groups
    assert optimizer._plan_local() is None


def test_a_closure_runs_torch_step_and_returns_its_loss(world_of_one, monkeypatch):
    """A closure is torch's business (it may re-run the forward): after a first step has set up the state, a step
    with a closure still runs torch's own step and returns the closure's loss, taken before the update."""
    from rlrun_runtime.optimizer import ShardLocalAdamW

    model = _model()
    optimizer = ShardLocalAdamW(model.parameters(), lr=1e-2)

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 8)).sum()
        loss.backward()
        return loss

    closure()
    optimizer.step()  # torch's: the state is set up
    torch_steps = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: torch_steps.append(1) or original(self, *a))
    with torch.no_grad():
        before = float(model(torch.ones(2, 8)).sum())
    assert float(optimizer.step(closure).detach()) == before  # the closure's loss, before the update
    assert torch_steps == [1]
    with torch.no_grad():
        assert float(model(torch.ones(2, 8)).sum()) != before  # and the update happened


TWO_RANKS = r'''
import sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from rlrun_runtime.optimizer import ShardLocalAdamW

dist.init_process_group("gloo")
rank = dist.get_rank()
out = {}
torch_steps = []
original = torch.optim.AdamW.step
torch.optim.AdamW.step = lambda self, *a: torch_steps.append(type(self).__name__) or original(self, *a)
for name, cls in (("torch", torch.optim.AdamW), ("local", ShardLocalAdamW)):
    torch.manual_seed(0)
    # dim 0 of 5 splits 3 + 2 over two ranks, dim 0 of 1 leaves rank 1 an empty shard
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
    fully_shard(model[0])
    fully_shard(model)
    optimizer = cls(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        gen = torch.Generator().manual_seed(10 * step + rank)  # each rank its own data: reduced gradients
        model(torch.randn(4, 3, generator=gen)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    shards = [tuple(p._local_tensor.shape) for p in model.parameters()]
    out[name] = ([p.full_tensor().clone() for p in model.parameters()], shards,
                 [s["exp_avg_sq"].full_tensor().clone() for s in optimizer.state.values()])
out["torch_steps"] = torch_steps
if rank == 1:
    torch.save(out, sys.argv[1])
dist.destroy_process_group()
'''


@pytest.mark.timeout(240)
def test_two_ranks_with_uneven_and_empty_shards_update_like_torch(tmp_path):
    """Two gloo ranks (torchrun), FSDP2 shards of 3 + 2 rows and of 1 + 0: the same weights and moments as
    torch's AdamW bit for bit, on every rank's shard (rank 1's results checked, the one with the empty shard)."""
    import subprocess
    import sys

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = tmp_path / "out.pt"
    from torchrun_env import get_env_without_torchrun

    env = get_env_without_torchrun()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(out)], capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out)
    (ref_weights, shards, ref_sqs), (weights, local_shards, sqs) = result["torch"], result["local"]
    assert shards == local_shards and (2, 3) in shards and (0, 5) in shards  # uneven and empty shards on rank 1
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert all(torch.equal(a, b) for a, b in zip(sqs, ref_sqs))
    # torch's step: all 4 of AdamW's, 1 of ShardLocalAdamW's (the state set-up); its other 3 on the local shards
    assert result["torch_steps"] == ["AdamW"] * 4 + ["ShardLocalAdamW"]
