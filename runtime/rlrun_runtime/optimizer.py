"""The trainer's AdamW: torch's, with its update run on the local tensors of FSDP2's DTensor parameters.

AdamW is elementwise, so on tensors that share one sharding (a parameter, its gradient and its two moments) the
update of each rank's local shard is the update of the whole tensor. Through DTensor the one fused kernel call
costs host time: its dispatch unwraps and checks about 1,250 DTensors a step on the Qwen3-0.6B shape (9.8
against 1.9 ms for plain tensors on a 2-core CPU, benchmarks/README.md), time in which a host-bound GPU step idles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (without ``to_local``'s autograd function); any other tensor as it is."""
    return getattr(tensor, "_local_tensor", tensor)


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (the same arguments, update, state and state dict, so checkpoints do not change)
    whose :meth:`step` passes the local tensors of DTensor parameters, gradients, moments and ``grad_scale`` to
    torch's functional ``adamw``.

    A step falls back to torch's own (over the DTensors) when it is given a closure, when a parameter has no
    state yet (torch initialises it: the first step, and after a state dict without it), or when a gradient or a
    moment is sharded unlike its parameter (a ``Partial`` gradient, say), where local shards would not line up.
    ``grad_scale`` (the attribute fused AdamW reads, as torch's) divides every gradient, fused only as in torch.
    """

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW update of every parameter with a gradient; returns ``closure()``'s loss (None without)."""
        plans = None if closure is not None else self._plan_local()
        if plans is None:
            return super().step(closure)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) in zip(self.param_groups, plans):
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, foreach=group["foreach"],
                  capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
                  grad_scale=None if grad_scale is None else _local(grad_scale),
                  found_inf=None if found_inf is None else _local(found_inf),
                  has_complex=any(p.is_complex() for p in params), amsgrad=group["amsgrad"], beta1=beta1,
                  beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=group["maximize"])
        return None

    def _plan_local(self) -> list[tuple[list[torch.Tensor], ...]] | None:
        """Per param group, the local (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) lists of
        the parameters with a gradient; None when torch's own step must run (see the class docstring)."""
        plans = []
        states = self.state
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists = ([], [], [], [], [], [])
            amsgrad = group["amsgrad"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = states.get(p)
                if not state:
                    return None
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if isinstance(p, DTensor):
                    placements = p.placements
                    if not (grad.placements == exp_avg.placements == exp_avg_sq.placements == placements):
                        return None
                    params.append(p._local_tensor)
                    grads.append(grad._local_tensor)
                    exp_avgs.append(exp_avg._local_tensor)
                    exp_avg_sqs.append(exp_avg_sq._local_tensor)
                else:
                    params.append(p)
                    grads.append(grad)
                    exp_avgs.append(exp_avg)
                    exp_avg_sqs.append(exp_avg_sq)
                if amsgrad:
                    max_exp_avg_sqs.append(_local(state["max_exp_avg_sq"]))
                steps.append(state["step"])
            plans.append(lists)
        return plans
