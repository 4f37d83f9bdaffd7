"""``spec.trainer.quantization``: float8 training matmuls through torchao (fp8); mxfp8 is refused."""

from __future__ import annotations

import torch

from rlrun_runtime.role import RoleConfigError

FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) or newer
MXFP8_MIN_CAPABILITY = (10, 0)  # microscaling float8: Blackwell (SM100)


def check_quantization(quantization: str, device: torch.device) -> None:
    """Refuse a ``spec.trainer.quantization`` this device cannot run.

    Raises:
        RoleConfigError: fp8 on CPU or on a GPU below compute capability 8.9; mxfp8 anywhere (it needs
            SM100, Blackwell, and is not implemented); each names the field and the fix (set none).
    """
    if quantization == "none":
        return
    if quantization == "mxfp8":
        raise RoleConfigError("spec.trainer.quantization: mxfp8 needs NVIDIA Blackwell GPUs (SM100, compute "
                              "capability 10.0) and is not implemented yet; set fp8 (Ada/Hopper) or none")
    if quantization != "fp8":
        raise RoleConfigError(f"spec.trainer.quantization: unknown value {quantization!r}; set none or fp8")
    if device.type != "cuda":
        raise RoleConfigError("spec.trainer.quantization: fp8 needs a GPU of compute capability 8.9 or newer "
                              "(Ada, Hopper) and the trainer runs on CPU; set none")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RoleConfigError(f"spec.trainer.quantization: fp8 needs compute capability 8.9 or newer (Ada, Hopper) "
                              f"and {name} has {capability[0]}.{capability[1]}; set none")


ROUTER_SUFFIXES = (".gate", ".router")  # a MoE layer's router (Qwen3-MoE: mlp.gate); dense MLPs name gate_proj


def get_fp8_targets(model: torch.nn.Module) -> list[str]:
    """Names of the linear layers :func:`apply_fp8` converts: every ``nn.Linear`` whose dimensions are multiples
    of 16 (float8 GEMMs need them), except the LM head (a :class:`rlrun_runtime.logprobs.LogprobHead` is not an
    ``nn.Linear`` anyway) and a mixture-of-experts router (``ROUTER_SUFFIXES``): its logits choose each token's
    experts, and float8's rounding of them would change which experts run. A MoE model's experts are stacked
    grouped-GEMM weights, not linear layers, and stay in the compute dtype."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0 and not name.endswith("lm_head")
            and not name.endswith(ROUTER_SUFFIXES)]


def apply_fp8(model: torch.nn.Module) -> int:
    """Convert the linear layers of :func:`get_fp8_targets` to torchao ``Float8Linear`` in place (tensorwise
    dynamic scaling: e4m3 inputs and weights in the forward, e5m2 output gradients in the backward); the
    parameters stay what they were (float32 master weights), only the matmuls run in float8.

    Returns:
        The number of layers converted.
    """
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:  # torchao comes with pyproject's gpu extra (the runtime image), not the CPU install
        raise RoleConfigError("spec.trainer.quantization: fp8 needs torchao, which rlrun[gpu] installs (the runtime "
                              "image has it); install rlrun[gpu] or set quantization: none") from None

    targets = set(get_fp8_targets(model))
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda module, name: name in targets)
    return len(targets)
