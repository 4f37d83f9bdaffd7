"""The trainer's AdamW: torch's, with its update run on the local tensors of FSDP2's DTensor parameters.

AdamW is elementwise, so on tensors that share one sharding (a parameter, its gradient and its two moments) the
update of each rank's local shard is the update of the whole tensor. Through DTensor the one fused kernel call
costs host time: its dispatch unwraps and checks every DTensor of the step (about 1,250 for Qwen3-0.6B's 310
parameters: 8.8 ms through DTensor against 2.1-2.2 ms on the local tensors, 2-core CPU, benchmarks/README.md),
time in which a host-bound GPU step idles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (read directly, without ``to_local``'s checks); any other tensor as it is."""
    return getattr(tensor, "_local_tensor", tensor)


class ShardLocalAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (the same constructor, update, state and state dict, so checkpoints do not change)
    whose :meth:`step` passes the local tensors of DTensor parameters, gradients, moments and ``grad_scale`` to
    torch's functional ``adamw``, the function torch's own step calls with the same lists.

    A step falls back to torch's own (over the DTensors) when it is given a closure, when a parameter has no
    state yet (torch initialises it: the first step, and after a state dict without it), when a param group is
    ``differentiable``, or when a gradient or a moment is not sharded like its parameter (a plain tensor, a
    ``Partial`` gradient), where local shards would not line up, or when ``grad_scale`` is a DTensor that is not
    replicated. The local path leaves out the per-step checks of torch's step that the trainer never needs
    (sparse gradients, CUDA-graph capture health). On a fallback step the step hooks and the profiler range run
    twice once any ``torch.optim.Adam`` or ``AdamW`` has been built in the process (torch wraps each class's
    ``step`` for good). ``grad_scale`` (the attribute fused AdamW reads, as torch's) divides every gradient,
    fused only, as in torch.
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
                  capturable=group["capturable"], differentiable=False, fused=group["fused"],
                  grad_scale=None if grad_scale is None else _local(grad_scale),
                  found_inf=None if found_inf is None else _local(found_inf),
                  has_complex=any(p.is_complex() for p in params), amsgrad=group["amsgrad"], beta1=beta1,
                  beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=group["maximize"])
        return None

    def _plan_local(self) -> list[tuple[list[torch.Tensor], ...]] | None:
        """Per param group, the local (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) lists of
        the parameters with a gradient; None when torch's own step must run (see the class docstring)."""
        for extra in (getattr(self, "grad_scale", None), getattr(self, "found_inf", None)):
            if isinstance(extra, DTensor) and not all(p.is_replicate() for p in extra.placements):
                return None  # its local tensor is not the whole value
        plans = []
        states = self.state
        for group in self.param_groups:
            if group["differentiable"]:
                return None
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
                max_sq = state["max_exp_avg_sq"] if amsgrad else exp_avg
                if isinstance(p, DTensor):
                    placements = p.placements
                    # a plain tensor among them has no placements: None differs from every DTensor's
                    if not (getattr(grad, "placements", None) == getattr(exp_avg, "placements", None)
                            == getattr(exp_avg_sq, "placements", None) == getattr(max_sq, "placements", None)
                            == placements):
                        return None
                    params.append(p._local_tensor)
                    grads.append(grad._local_tensor)
                    exp_avgs.append(exp_avg._local_tensor)
                    exp_avg_sqs.append(exp_avg_sq._local_tensor)
                    if amsgrad:
                        max_exp_avg_sqs.append(max_sq._local_tensor)
                else:
                    if any(isinstance(t, DTensor) for t in (grad, exp_avg, exp_avg_sq, max_sq)):
                        return None
                    params.append(p)
                    grads.append(grad)
                    exp_avgs.append(exp_avg)
                    exp_avg_sqs.append(exp_avg_sq)
                    if amsgrad:
                        max_exp_avg_sqs.append(max_sq)
                steps.append(_local(state["step"]))
            plans.append(lists)
        return plans
