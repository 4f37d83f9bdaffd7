"""FSDP2 at world size 1: compute-dtype parameters kept gathered between steps, refreshed by one foreach copy.

At world size 1 FSDP2 still re-creates every parameter's compute copy in every forward (a cast and a copy per
parameter, with its host-side bookkeeping: about 1,000 ``copy_`` calls per step on the Qwen3-0.6B shape, the
host time that idled the GPU in benchmarks/README.md's profiles). Here FSDP2 is told not to reshard after
backward, so the copies stay; after the optimizer step they are refreshed from the float32 shards in one
``torch._foreach_copy_`` (the same round-to-nearest cast FSDP2 applies). Publishing reads the float32 masters
directly (:meth:`GatheredParams.full_state_dict`), since a module state dict makes FSDP2 reshard; a checkpoint
still does, and the next forward then gathers the usual way.
"""

from __future__ import annotations

from typing import Any

import torch


class GatheredParams:
    """The trainable parameters of an FSDP2-wrapped ``model`` at world size 1, kept gathered across steps.

    Only parameters that train are refreshed (a frozen LoRA base never changes). Call :meth:`refresh` after
    every optimizer step; without it the next forward would run with the previous step's weights. Between
    steps the modules hold FSDP2's gathered compute copies, so ``model.named_parameters()`` yields those, not
    the float32 masters (keep the sharded parameters from before the first step, as the optimizer does).

    Raises:
        ValueError: the model is not wrapped by FSDP2, or the process group has more than one rank (a rank's
            shard is then not the whole parameter).
    """

    def __init__(self, model: torch.nn.Module, world_size: int):
        if world_size != 1:
            raise ValueError(f"GatheredParams needs a world of one rank, not {world_size}")
        if not hasattr(model, "set_reshard_after_backward"):
            raise ValueError("GatheredParams needs a model wrapped by FSDP2's fully_shard")
        model.set_reshard_after_backward(False)  # every FSDP unit below the root too
        seen: set[int] = set()
        self.slots: list[tuple[torch.nn.Module, str, Any]] = []  # (module, attribute, sharded parameter)
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad and id(param) not in seen:  # a tied weight once
                    seen.add(id(param))
                    self.slots.append((module, name, param))
        # What the module state dict holds, by key: a sharded parameter or a persistent buffer (None when it
        # holds anything else, such as a module's extra state: full_state_dict then defers to torch's).
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        keys = list(model.state_dict().keys())  # sharded now: FSDP2's pre-hook has nothing to reshard
        sources = [(key, params.get(key, buffers.get(key))) for key in keys]
        self.sources: list[tuple[str, Any]] | None = (sources if all(src is not None for _, src in sources)
                                                      else None)

    @torch.no_grad()
    def refresh(self) -> int:
        """Copy the sharded (master) values into the gathered compute copies that FSDP2 holds now.

        Returns:
            The number of parameters refreshed (0 when FSDP2 has resharded them all, e.g. after a state dict).
        """
        dst, src = [], []
        for module, name, sharded in self.slots:
            current = module._parameters.get(name)
            if current is not None and current is not sharded:  # FSDP2 swapped in the gathered copy
                dst.append(current)
                src.append(sharded.to_local() if hasattr(sharded, "to_local") else sharded)
        if dst:
            torch._foreach_copy_(dst, src)
        return len(dst)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The module state dict with the float32 masters, on the CPU: the keys and values of torch's
        ``get_model_state_dict(model, full_state_dict=True, cpu_offload=True)`` at world size 1, read without
        making FSDP2 reshard (a tied weight is one CPU tensor under both keys). None when the state dict holds
        more than parameters and buffers (call torch's then)."""
        if self.sources is None:
            return None
        out: dict[str, torch.Tensor] = {}
        copied: dict[int, torch.Tensor] = {}
        for key, src in self.sources:
            if id(src) not in copied:
                local = src.to_local() if hasattr(src, "to_local") else src  # world size 1: the whole tensor
                copied[id(src)] = local.detach().to("cpu", copy=True)
            out[key] = copied[id(src)]
        return out
