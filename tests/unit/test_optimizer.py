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
    torch_steps = []
    original = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a: torch_steps.append(1) or original(self, *a))
    optimizer.step()
    assert torch_steps == [1]
    params[0].grad = odd
    assert optimizer._plan_local() is not None


def test_a_closure_runs_torch_step_and_returns_its_loss(world_of_one):
    from rlrun_runtime.optimizer import ShardLocalAdamW

    model = _model()
    optimizer = ShardLocalAdamW(model.parameters(), lr=1e-2)

    def closure():
        optimizer.zero_grad()
        loss = model(torch.ones(2, 8)).sum()
        loss.backward()
        return loss

    with torch.no_grad():
        before = float(model(torch.ones(2, 8)).sum())
    assert float(optimizer.step(closure).detach()) == before  # the closure's loss, before the update
    with torch.no_grad():
        assert float(model(torch.ones(2, 8)).sum()) != before  # and the update happened
