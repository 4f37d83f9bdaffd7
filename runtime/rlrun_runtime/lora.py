"""LoRA for the trainer (``spec.trainer.lora``): PEFT adapters injected in place, merged weights for the engines,
the adapter in PEFT's format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlrun_runtime.role import RoleConfigError

ADAPTER_NAME = "default"  # PEFT's name of the one adapter
# Key prefix of a PEFT adapter file written by ``PeftModel.save_pretrained`` (the PeftModel and its LoraModel).
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Seed of the adapters' initialisation: every rank, rank count and restart draws the same A (the global RNG
# state at that point differs between a 1-rank and a 2-rank run, measured).
INIT_SEED = 0


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, target_modules: tuple[str, ...],
               base_name: str = "") -> Any:
    """Inject LoRA adapters into ``model`` in place (``peft.inject_adapter_in_model``) and freeze the rest.

    Every linear layer whose module name ends with one of ``target_modules`` gets ``A`` ``[rank, in]``
    (Kaiming-uniform, drawn from seed :data:`INIT_SEED` in a forked RNG, so every rank and rank count starts
    from the same adapters and the caller's RNG state is left as it was) and ``B`` ``[out, rank]`` (zeros),
    in the layer's dtype and device, so the model's output is unchanged until B trains; the layer computes
    ``W x + (alpha / rank) B A x`` (no dropout, no bias). Only ``A`` and ``B`` keep ``requires_grad``. The module tree keeps its names, so the state dict
    gains ``<layer>.base_layer.weight`` and ``<layer>.lora_{A,B}.default.weight`` (:func:`merge_lora_state_dict`
    undoes that for publishing).

    Returns:
        The ``peft.LoraConfig`` (``base_model_name_or_path`` set to ``base_name``).

    Raises:
        RoleConfigError: no module matches ``target_modules`` (names the field and the fix).
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", base_model_name_or_path=base_name or None)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(INIT_SEED)
            inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError is a ValueError
        first = str(exc).strip().splitlines()[0]
        raise RoleConfigError(f"spec.trainer.lora.targetModules: {list(target_modules)} ({first}); name linear "
                              "layers of the model's decoder by their suffix, e.g. q_proj, v_proj") from None
    return config


def merge_lora_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The base model's state dict with each adapter merged in, under the base model's names.

    For every ``P.lora_A.default.weight`` (``A`` ``[r, in]``) with its ``P.lora_B.default.weight`` (``B``
    ``[out, r]``) and ``P.base_layer.weight`` (``W`` ``[out, in]``): ``P.weight = W + scale * B @ A``, computed
    in float32 and returned in ``W``'s dtype; ``P.base_layer.bias`` becomes ``P.bias``. Other keys pass
    through. ``state`` is full (unsharded) and is not modified. ``scale`` is ``alpha / rank``.

    Raises:
        ValueError: an adapter without its partner or base weight.
    """
    out: dict[str, torch.Tensor] = {}
    marker_a = f".lora_A.{ADAPTER_NAME}.weight"
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.", 1)
            if leaf == "weight" and f"{prefix}{marker_a}" in state:
                b_key = f"{prefix}.lora_B.{ADAPTER_NAME}.weight"
                if b_key not in state:
                    raise ValueError(f"{prefix}: LoRA A without B in the state dict")
                a, b = state[f"{prefix}{marker_a}"].float(), state[b_key].float()
                value = (value.float() + scale * (b @ a)).to(value.dtype)
            out[f"{prefix}.{leaf}"] = value
            continue
        out[key] = value
    stray = [k for k in state if k.endswith(marker_a) and k.replace(marker_a, ".base_layer.weight") not in state]
    if stray:
        raise ValueError(f"LoRA A without a base weight: {stray[:3]}")
    return out


def get_adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full state dict, under the names of PEFT's adapter file
    (``base_model.model.<layer>.lora_A.weight``: what ``PeftModel.from_pretrained`` loads)."""
    return {PEFT_PREFIX + k.replace(f".{ADAPTER_NAME}.", "."): v for k, v in state.items()
            if ".lora_A." in k or ".lora_B." in k}


def save_adapter(state: dict[str, torch.Tensor], config: Any, directory: Path, dtype: torch.dtype) -> None:
    """Write ``directory/adapter_model.safetensors`` (the adapter of the full ``state``, cast to ``dtype``) and
    ``directory/adapter_config.json`` (``config``, a ``peft.LoraConfig``), creating ``directory``."""
    from huggingface_hub import save_torch_state_dict

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in get_adapter_state_dict(state).items()}
    # one file (adapters are small), named as PEFT names it
    save_torch_state_dict(tensors, directory, filename_pattern=ADAPTER_WEIGHTS.replace(".safetensors",
                                                                                       "{suffix}.safetensors"),
                          max_shard_size="1000GB")
    config.save_pretrained(str(directory))
    # peft writes target_modules as a set: keep the file stable across saves of the same config
    path = directory / ADAPTER_CONFIG
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data.get("target_modules"), list):
        data["target_modules"] = sorted(data["target_modules"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True), encoding="utf-8")
