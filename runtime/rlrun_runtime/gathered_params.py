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
    the float32 masters (keep the sharded parameters from before the first step, as the optimizer does). The
    copies (2 bytes a parameter in bf16) now also live outside forward and backward, through the optimizer
    step and publishing; forward and backward held them already, so the peak does not move.

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
        # The module state dict's keys (in its order) and the sharded parameter behind each parameter key.
        # full_state_dict defers to torch's (returns None) when a module saves more than its parameters and
        # persistent buffers (its own _save_to_state_dict, extra state, a state-dict post-hook).
        self.model = model
        self.keys = list(model.state_dict().keys())  # sharded now: FSDP2's pre-hook has nothing to reshard
        self.masters = dict(model.named_parameters(remove_duplicate=False))
        base = torch.nn.Module
        self.plain = all(type(m)._save_to_state_dict is base._save_to_state_dict
                         and type(m).get_extra_state is base.get_extra_state and not m._state_dict_hooks
                         for m in model.modules())

    @torch.no_grad()
    def refresh(self) -> int:
        """Copy the sharded (master) values into the gathered compute copies that FSDP2 holds now.

        Returns:
            The number of parameters refreshed: all of :attr:`slots` after a forward and backward, 0 when FSDP2
            has resharded them (after a state dict, e.g. a checkpoint).
        """
        dst, src = [], []
        for module, name, sharded in self.slots:
            current = module._parameters.get(name)
            if current is not None and current is not sharded:  # FSDP2 swapped in the gathered copy
                dst.append(current)
                # the local tensor itself: torch 2.13's to_local makes a view per call even under no_grad
                # (310 calls: 0.33 against 0.01 ms, 2-core CPU)
                src.append(getattr(sharded, "_local_tensor", sharded))
        if dst:
            torch._foreach_copy_(dst, src)
        return len(dst)

    def _persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers now, by state-dict key."""
        out = {}
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    out[f"{prefix}.{name}" if prefix else name] = buffer
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The module state dict with the float32 masters, on the CPU: the keys (in order) and values of
        torch's ``get_model_state_dict(model, full_state_dict=True, cpu_offload=True)`` at world size 1, read
        without making FSDP2 reshard (a tied weight is one CPU tensor under both keys). None, to call torch's
        instead, when a module saves more than parameters and persistent buffers, or when the parameter and
        buffer names no longer match the keys recorded at construction."""
        if not self.plain:
            return None
        buffers = self._persistent_buffers()
        names = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        if names | buffers.keys() != set(self.keys) or names != self.masters.keys():
            return None
        out: dict[str, torch.Tensor] = {}
        copied: dict[int, torch.Tensor] = {}
        for key in self.keys:
            src = self.masters[key] if key in self.masters else buffers[key]
            if id(src) not in copied:
                local = src.to_local() if hasattr(src, "to_local") else src  # world size 1: the whole tensor
                copied[id(src)] = local.detach().to("cpu", copy=True)
            out[key] = copied[id(src)]
        return out
