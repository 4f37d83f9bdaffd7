"""Mixture-of-experts models in the trainer (transformers' Qwen3-MoE and the models sharing its experts layout):
how they are recognised and loaded (experts through grouped GEMM), the HF checkpoint layout they are published
in, and their active parameter count (the benchmark's MFU)."""

from __future__ import annotations

from typing import Any

import torch

# transformers' experts implementation for the trainer: every expert's tokens in one grouped matrix product
# (``torch.nn.functional.grouped_mm``, or ``torch._grouped_mm`` on older torch) instead of one product per
# expert; transformers >= 5 (``transformers.integrations.moe.grouped_mm_experts_forward``).
EXPERTS_IMPLEMENTATION = "grouped_mm"


def get_text_config(config: Any) -> Any:
    """The language model's config of ``config`` (itself for a plain causal LM)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_moe_config(config: Any) -> bool:
    """Whether the model of ``config`` routes tokens to experts (``num_experts`` > 0, Qwen-MoE naming)."""
    return int(getattr(get_text_config(config), "num_experts", 0) or 0) > 0


def get_load_kwargs(config: Any) -> dict[str, Any]:
    """Extra ``from_pretrained`` keyword arguments for the model of ``config``: the grouped-GEMM experts
    (:data:`EXPERTS_IMPLEMENTATION`) for a MoE model, nothing for a dense one (transformers refuses the
    argument for models without experts)."""
    return {"experts_implementation": EXPERTS_IMPLEMENTATION} if is_moe_config(config) else {}


def prepare_moe_model(model: torch.nn.Module) -> None:
    """Set up a loaded MoE model for training; no-op for a dense one.

    The router's load-balancing loss stays off: ``output_router_logits`` is set to False, so the forward
    neither keeps every layer's router logits nor adds transformers' auxiliary loss (which it adds only with
    ``labels=``, never passed here). The router still trains: the policy gradient reaches it through the
    routing weights that scale each expert's output.

    Raises:
        ValueError: the model's experts do not run through :data:`EXPERTS_IMPLEMENTATION` (transformers fell
            back to its per-expert loop: a torch without grouped GEMM).
    """
    if not is_moe_config(model.config):
        return
    for config in {id(c): c for c in (model.config, get_text_config(model.config))}.values():
        if hasattr(config, "output_router_logits"):
            config.output_router_logits = False
    found = getattr(get_text_config(model.config), "_experts_implementation", None)
    if found != EXPERTS_IMPLEMENTATION:
        raise ValueError(f"the model's experts run through {found!r}, not {EXPERTS_IMPLEMENTATION!r}: this torch "
                         f"({torch.__version__}) has no grouped matrix product")


def to_checkpoint_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the model's own names, e.g. ``...mlp.experts.gate_up_proj`` ``[E, 2 I, H]``) in the layout of
    the model's HF checkpoint (``...mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj``),
    which vLLM and transformers load; the inverse of the conversion transformers applied when loading
    (``transformers.core_model_loading.revert_weight_conversion``, what ``save_pretrained`` writes). Dense models
    come back unchanged (the same tensors). Every returned tensor owns its storage (a per-expert slice is
    copied out of the stacked tensor: safetensors refuses to save tensors sharing one).
    """
    if not is_moe_config(model.config):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    out = {}
    for key, tensor in revert_weight_conversion(model, state).items():
        whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        out[key] = tensor if whole else tensor.clone(memory_format=torch.contiguous_format)
    return out


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(total, active)`` parameters of ``model``, each distinct tensor once (tied embeddings too).

    Active: every parameter counts fully except the experts' stacked weights (3-D parameters whose first
    dimension is their module's ``num_experts``), which count ``top_k / num_experts`` of their size: a token
    passes through ``num_experts_per_tok`` experts. For a dense model both are the total.
    """
    text = get_text_config(getattr(model, "config", None))
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    expert_ids: dict[int, float] = {}
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or experts < 1 or not top_k:
            continue
        for p in module.parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == experts:
                expert_ids[id(p)] = min(top_k, experts) / experts
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    active = sum(p.numel() * expert_ids.get(key, 1.0) for key, p in params.items())
    return total, round(active)
