"""Context parallelism (``trainer.parallelism.cp``): the ``cp`` ranks of a group split every packed row into
``2 cp`` equal chunks of positions, rank i taking chunks i and ``2 cp - 1 - i``, and each attention layer
gathers the whole row's keys and values.

Each rank embeds, projects, applies rotary positions and computes the loss for its own positions only; attention
queries of the shard see every key of the row (an all-gather of keys and values over the group, whose
backward reduce-scatters their gradients back to the owner), under the same document-causal mask as the
unsharded row. The loss is normalised by the step's total loss tokens on every rank, and FSDP2 sums
gradients over all ranks (the trainer multiplies the loss by the world size), so a group's ranks together
give exactly the unsharded row's gradient. This is the all-gather form of context parallelism of Llama 3's
paper (section 3.3.2), with its load balance: under a causal mask a chunk's attention work grows with its
position, and chunks i and ``2 cp - 1 - i`` together do the same work on every rank for one document filling
the row (a padding tail is a causal document of its own and loads the chunks it falls in; rows of many short
documents are balanced by neither layout: a review counted up to 2.4x between ranks at cp 8, either way). It keeps any attention kernel and any mask, and holds every layer's gathered keys and values
for the backward (unless activation checkpointing recomputes the layer). The gathered keys stay in rank order;
the mask, not a copy, puts them back in row order (:class:`rlrun_runtime.packing.MicroBatch`'s positions).

Rank layout: groups are ``cp`` consecutive ranks (rank = dp_rank x cp + cp_rank), so a group shares a node
whenever ``cp`` divides the ranks per node.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .packed_attention import CP_FLEX_ATTENTION, CP_SDPA, FLEX_ATTENTION
from .packing import MicroBatch

_WRAPPED = {"sdpa": CP_SDPA, FLEX_ATTENTION: CP_FLEX_ATTENTION}


def get_cp_coords(rank: int, world: int, cp: int) -> tuple[int, int, int]:
    """``(dp_rank, dp_world, cp_rank)`` of ``rank``: data-parallel rank and world (each data-parallel rank is a
    group of ``cp`` consecutive ranks, which run the same micro-batches) and the rank inside its group.

    Raises:
        ValueError: ``cp < 1``, ``cp`` not dividing ``world``, or ``rank`` outside ``[0, world)``.
    """
    if cp < 1 or world % cp:
        raise ValueError(f"context-parallel degree {cp} must be >= 1 and divide the world size {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world size {world}")
    return rank // cp, world // cp, rank % cp


def get_shard_positions(width: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Row positions (int64 ``[width / cp]``, ascending) of ``cp_rank``'s share of a ``width``-token row: chunks
    ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks (Llama 3's load-balanced layout).

    Raises:
        ValueError: ``width`` not a multiple of ``2 cp``, or ``cp_rank`` outside ``[0, cp)``.
    """
    if width % (2 * cp):
        raise ValueError(f"row of {width} tokens does not split into {2 * cp} equal context-parallel chunks")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} outside degree {cp}")
    size = width // (2 * cp)
    first, second = cp_rank * size, (2 * cp - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


def shard_micro_batch(mb: MicroBatch, cp_rank: int, cp: int) -> MicroBatch:
    """Shard ``cp_rank`` of ``cp`` of a packed micro-batch: its ``[1, T]`` row's positions
    :func:`get_shard_positions`, every per-position tensor cut the same way (``[1, T / cp]``);
    ``query_positions`` holds those positions, ``key_positions`` the row positions of every shard's in rank order
    (the order the gathered keys arrive in), and ``kv_doc_ids`` their ``doc_ids``.

    Raises:
        ValueError: a padded (not packed) micro-batch, a shard already, or T not a multiple of ``2 cp``.
    """
    if mb.doc_ids is None or mb.position_ids is None:
        raise ValueError("context parallelism shards packed rows only (set algorithm.microBatchTokens)")
    if mb.kv_doc_ids is not None:
        raise ValueError("this micro-batch is a context-parallel shard already; shard the whole row")
    width = mb.input_ids.shape[1]
    positions = get_shard_positions(width, cp_rank, cp)
    keys = torch.cat([get_shard_positions(width, r, cp) for r in range(cp)])
    cut = {f.name: getattr(mb, f.name)[:, positions] for f in dataclasses.fields(mb)
           if isinstance(getattr(mb, f.name), torch.Tensor)}
    return dataclasses.replace(mb, **cut, kv_doc_ids=mb.doc_ids[:, keys], query_positions=positions,
                               key_positions=keys)


def install_context_parallel(model: Any, group: Any) -> str:
    """Make every attention layer of the transformers ``model`` gather keys and values over the process
    ``group`` (along the sequence, dimension 2 of ``[B, H, T, D]``) before its kernel, SDPA or FlexAttention;
    returns the new attention-implementation name (:data:`CP_SDPA` or :data:`CP_FLEX_ATTENTION`).

    The registered function holds no group: each attention layer of ``model`` carries its own (attribute
    ``rlrun_cp_group``), so models with different groups coexist in one process. The gather is torch's
    functional ``all_gather_single_autograd`` (``all_gather_tensor_autograd`` before torch 2.13): traceable by
    ``torch.compile``, its backward a reduce-scatter, on gloo and nccl.

    Raises:
        ValueError: the model runs another attention implementation, or has no attention layers.
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base not in _WRAPPED:
        raise ValueError(f"context parallelism wraps {sorted(_WRAPPED)} attention, not {base!r}")
    layers = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]  # transformers' attention layers
    if not layers:
        raise ValueError(f"context parallelism found no attention layer in {type(model).__name__}")
    for layer in layers:
        layer.rlrun_cp_group = group
    name = _WRAPPED[base]
    AttentionInterface.register(name, _get_gathering_attention(ALL_ATTENTION_FUNCTIONS[base]))
    model.config._attn_implementation = name
    return name


def _get_gathering_attention(kernel: Any) -> Any:
    """transformers attention function: ``kernel`` over the row's keys and values, gathered over the calling
    layer's ``rlrun_cp_group``."""
    from torch.distributed import _functional_collectives as collectives

    gather = getattr(collectives, "all_gather_single_autograd", None) or collectives.all_gather_tensor_autograd

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> Any:
        group = module.rlrun_cp_group
        key = gather(key.contiguous(), gather_dim=2, group=group)
        value = gather(value.contiguous(), gather_dim=2, group=group)
        return kernel(module, query, key, value, attention_mask, **kwargs)

    return attention
