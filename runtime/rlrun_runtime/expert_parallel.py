"""Expert parallelism (``trainer.parallelism.ep``): each of the ``ep`` ranks holds ``num_experts / ep`` of every
mixture-of-experts layer's experts, and tokens travel to the rank of the expert they were routed to and back
(two all-to-alls per layer), instead of every rank gathering every expert.

Every rank is a data-parallel rank. With ``ep`` equal to the rank count the ranks form one expert-parallel group;
with fewer, consecutive ranks form groups of ``ep``, and each expert shard has ``world / ep`` replicas (each a
whole copy: float32 weights, gradients and AdamW moments of its ``1 / ep`` of the experts, unlike torchtitan,
which shards them further over the replicas with FSDP). The expert weights are ``DTensor`` s sharded along the
expert dimension over a group and replicated over the groups (so checkpoints, the published full state dict,
gradient clipping and the optimizer see the whole tensor), kept out of FSDP2 and in float32, cast to the compute
dtype in the forward. A rank computes its experts with transformers' own grouped-GEMM experts forward on the
tokens its group sends it; routing weights are applied on the token's own rank, as without parallelism. The
gradient an expert receives is the sum over its group's tokens; the trainer sums it over the replicas once per
step (:func:`all_reduce_replica_grads`), so it sums every rank's tokens. The trainer scales each rank's loss by
the world size (FSDP2 averages), so each expert gradient is divided by the world size once (a tensor hook).
Frozen experts (LoRA) stay frozen; the experts' forward runs outside ``torch.compile`` (its split sizes are host
values).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def get_expert_shard(num_experts: int, ep: int, rank: int) -> tuple[int, int]:
    """``(first expert, expert count)`` held by ``rank`` of ``ep``.

    Raises:
        ValueError: ``ep`` does not divide ``num_experts`` or ``rank`` is outside ``[0, ep)``.
    """
    if ep < 1 or num_experts % ep:
        raise ValueError(f"expert-parallel degree {ep} must divide the {num_experts} experts of each layer")
    if not 0 <= rank < ep:
        raise ValueError(f"rank {rank} outside expert-parallel degree {ep}")
    local = num_experts // ep
    return rank * local, local


def plan_dispatch(expert_ids: torch.Tensor, experts_per_rank: int, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, send_counts)`` for the ``[S]`` routed expert ids of one rank: ``order`` sorts the (token, k)
    assignments by expert (so by destination rank, stable), ``send_counts[r]`` (``[ep]``, int64) is how many go
    to rank r (experts ``[r x experts_per_rank, (r + 1) x experts_per_rank)``)."""
    order = torch.argsort(expert_ids, stable=True)
    send = torch.bincount(expert_ids // experts_per_rank, minlength=ep)
    return order, send


def get_experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' stacked-experts modules of ``model`` (3-D ``gate_up_proj`` and ``down_proj``)."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "num_experts", None), int) and getattr(getattr(m, "gate_up_proj", None), "dim",
                                                                          lambda: 0)() == 3
            and getattr(getattr(m, "down_proj", None), "dim", lambda: 0)() == 3]


def get_expert_mesh(device_type: str, world: int, ep: int) -> Any:
    """The experts' device mesh: 1-D over every rank when ``ep == world`` (FSDP2 shards over the same mesh), else
    2-D ``("replica", "ep")`` of shape ``(world / ep, ep)``: consecutive ranks form an expert-parallel group.

    Raises:
        ValueError: ``ep`` does not divide ``world``.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if ep < 1 or world % ep:
        raise ValueError(f"expert-parallel degree {ep} must divide the {world} trainer ranks: pick a divisor of "
                         f"{world}")
    if ep == world:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("replica", "ep"))


def install_expert_parallel(model: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype) -> set[torch.nn.Parameter]:
    """Shard every experts module of ``model`` over ``mesh`` (:func:`get_expert_mesh`: 1-D, every rank one
    expert-parallel group; or 2-D ``("replica", "ep")``, sharded over ``ep`` and replicated over ``replica``) and
    route its tokens with all-to-alls within the rank's group; returns the expert parameters (to keep out of
    FSDP2).

    Raises:
        ValueError: ``model`` has no experts module, its experts do not run transformers' grouped GEMM, or
            ``ep`` does not divide its expert count.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from .moe import EXPERTS_IMPLEMENTATION

    modules = get_experts_modules(model)
    if not modules:
        raise ValueError(f"expert parallelism needs a mixture-of-experts model; {type(model).__name__} has no "
                         "experts")
    world = dist.get_world_size()
    if mesh.ndim == 1:
        if mesh.size() != world:
            raise ValueError(f"a 1-D expert mesh must hold every one of the {world} ranks, not {mesh.size()}")
        ep, rank, placements = mesh.size(), mesh.get_local_rank(), [Shard(0)]
        # the all-to-alls get a group of their own, so they do not queue behind FSDP2's prefetched all-gathers
        # (FSDP2 shards over this very mesh)
        group = dist.new_group(list(range(world)))
    else:  # FSDP2 has a mesh of its own: the "ep" groups serve the all-to-alls alone
        ep, rank, placements = mesh["ep"].size(), mesh["ep"].get_local_rank(), [Replicate(), Shard(0)]
        group = mesh["ep"].get_group()
    params: set[torch.nn.Parameter] = set()
    for module in modules:
        if getattr(module.config, "_experts_implementation", None) != EXPERTS_IMPLEMENTATION:
            raise ValueError(f"expert parallelism runs the experts through {EXPERTS_IMPLEMENTATION!r}")
        if getattr(module, "has_bias", False) or not getattr(module, "has_gate", True):
            raise ValueError(f"expert parallelism supports gated experts without biases (Qwen3-MoE's); "
                             f"{type(module).__name__} has {'biases' if getattr(module, 'has_bias', False) else 'no gate'}")
        start, local = get_expert_shard(module.num_experts, ep, rank)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            shard = full.detach()[start:start + local].clone().to(torch.float32)
            # frozen stays frozen (LoRA trains only its adapters)
            param = torch.nn.Parameter(DTensor.from_local(shard, mesh, placements, run_check=False),
                                       requires_grad=full.requires_grad)
            if param.requires_grad:
                param.register_hook(lambda grad: grad / world)
            setattr(module, name, param)
            params.add(param)
        # not compiled: the split sizes are read on the host, and each new one would recompile the layer
        forward = types.MethodType(_get_forward(group, ep, start, local, compute_dtype), module)
        module.forward = torch.compiler.disable(forward)
    return params


def _get_forward(group: Any, ep: int, start: int, local: int, compute_dtype: torch.dtype) -> Any:
    """The experts module's forward under expert parallelism (same signature as transformers'), for the rank
    holding experts ``[start, start + local)``."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from transformers.integrations.moe import grouped_mm_experts_forward

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = hidden_states.shape[0], top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order, send = plan_dispatch(expert_ids, local, ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        ids = torch.empty(sum(recv_sizes), dtype=expert_ids.dtype, device=expert_ids.device)
        dist.all_to_all_single(ids, expert_ids[order].contiguous(), recv_sizes, send_sizes, group=group)
        received = all_to_all_single_autograd(hidden_states[order // top_k], recv_sizes, send_sizes, group)
        up = self.gate_up_proj.to_local().to(compute_dtype)
        down = self.down_proj.to_local().to(compute_dtype)
        if received.shape[0]:
            view = types.SimpleNamespace(num_experts=local, gate_up_proj=up, down_proj=down, has_gate=True,
                                         has_bias=False, is_transposed=getattr(self, "is_transposed", False),
                                         _is_expert_parallel=False, _apply_gate=self._apply_gate,
                                         act_fn=self.act_fn)
            ones = received.new_ones(received.shape[0], 1)
            out = grouped_mm_experts_forward(view, received, (ids - start).view(-1, 1), ones)
        else:  # no token routed here: zero gradients for the local experts all the same, as without parallelism
            out = received + (up.sum() + down.sum()) * 0
        back = all_to_all_single_autograd(out.to(hidden_states.dtype), send_sizes, recv_sizes, group)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # promoted as transformers does
        # back to (token, k) order, then the sum over k (as transformers sums, not an index_add)
        unsorted = torch.zeros_like(weighted).index_copy(0, order, weighted)
        return unsorted.view(tokens, top_k, hidden_states.shape[-1]).sum(dim=1).to(hidden_states.dtype)

    return forward


def get_param_groups_by_mesh(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` split by the device mesh of each ``DTensor`` (plain tensors together), in order of first
    appearance: one list for one mesh. With expert-parallel replicas the experts live on a 2-D mesh and the rest
    on FSDP2's 1-D one, and DTensor runs no op across meshes, so the optimizer (a param group each) and clipping
    (:func:`clip_grad_norm_by_mesh`) handle the lists one by one."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return list(groups.values())


def get_grad_norm_by_mesh(groups: list[list[torch.nn.Parameter]]) -> torch.Tensor:
    """The total 2-norm of every gradient in the parameter lists of :func:`get_param_groups_by_mesh`: a plain
    0-dim tensor on the gradients' device, the same on every rank (torch's ``get_total_norm`` per list, then the
    norm of those). On a mesh of one rank the local tensors are the whole gradients, and their norm skips
    DTensor's per-call dispatch (2.3 against 0.7 ms of host time for the 0.6B shape's 310 gradients, 2-core CPU).
    """
    norms = []
    for params in groups:
        grads = [p.grad for p in params if p.grad is not None]
        if grads and getattr(grads[0], "device_mesh", None) is not None and grads[0].device_mesh.size() == 1:
            # a mesh of one rank holds whole tensors: their norm without DTensor's dispatch (and without
            # to_local's autograd function: 310 calls took 3 ms of host time on a GPU host)
            grads = [g._local_tensor for g in grads]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def get_clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by so that the result equals ``clip_grad_norm_``'s: ``1 / min(1, max_norm /
    (norm + 1e-6))`` (torch's clip coefficient, its 1e-6 included), a 0-dim float32 tensor on ``norm``'s device.
    Fused AdamW divides by it inside its one kernel (its ``grad_scale``), where clipping in place would be one
    more op over every gradient."""
    coef = torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    return 1.0 / coef


def get_grad_scale(divisor: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    """``divisor`` (0-dim) as fused AdamW's ``grad_scale`` for ``params`` (one mesh's list): replicated over
    their mesh when they are DTensors. A plain tensor among DTensors makes DTensor build a sharding spec for
    every parameter in each step (13 against 7 ms of host time for 310 parameters on a mesh of one, 2-core
    CPU); a replicated DTensor costs nothing over no ``grad_scale``."""
    mesh = getattr(params[0], "device_mesh", None) if params else None
    if mesh is None:
        return divisor
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(divisor, mesh, [Replicate()] * mesh.ndim, run_check=False)


def clip_grad_norm_by_mesh(groups: list[list[torch.nn.Parameter]], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the parameter lists of :func:`get_param_groups_by_mesh`: the total
    2-norm of every gradient (:func:`get_grad_norm_by_mesh`), every gradient scaled in place by
    ``min(1, max_norm / (norm + 1e-6))``."""
    total = get_grad_norm_by_mesh(groups)
    for params in groups:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


REDUCE_BUCKET_BYTES = 256 * 2**20  # one all-reduce per 256 MiB of expert gradients (a bound on the flat copy)


def get_expert_replicas(model: torch.nn.Module) -> tuple[Any, list[torch.nn.Parameter]] | None:
    """``(replica process group, trainable expert parameters in module order)`` when ``model``'s experts have
    replicas (a 2-D expert mesh with more than one replica), else None."""
    params = [p for m in get_experts_modules(model) for p in (m.gate_up_proj, m.down_proj)
              if p.requires_grad and getattr(getattr(p, "device_mesh", None), "ndim", 1) == 2]
    if not params or params[0].device_mesh["replica"].size() == 1:
        return None
    return params[0].device_mesh["replica"].get_group(), params


def all_reduce_replica_grads(group: Any, params: list[torch.nn.Parameter],
                             bucket_bytes: int = REDUCE_BUCKET_BYTES) -> None:
    """Sum the expert gradients over the replicas of each shard (process ``group``), in place; call on every rank
    once per step, after the last backward and before clipping. ``params`` (:func:`get_expert_replicas`) are
    reduced in their order, in buckets of at most ``bucket_bytes`` (one tensor larger than that alone): the same
    collectives in the same order on every rank, whatever autograd's order. A parameter without a gradient gets
    zeros first (every replica then takes part)."""
    from torch.distributed.tensor import DTensor

    grads = []
    for param in params:
        if param.grad is None:
            param.grad = DTensor.from_local(torch.zeros_like(param.to_local()), param.device_mesh, param.placements,
                                            run_check=False)
        grads.append(param.grad._local_tensor)
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if bucket and size + nbytes > bucket_bytes:
            _all_reduce_flat(bucket, group)
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        _all_reduce_flat(bucket, group)


def _all_reduce_flat(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` over ``group`` in place through one flat copy (one collective)."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
