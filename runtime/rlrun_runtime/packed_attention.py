"""Document-aware causal attention masks for packed rows (position ``q`` may attend to ``k`` exactly when
both belong to the same document and ``k <= q``).

Two forms, each handed to a transformers model as its ``attention_mask`` (a 4-D mask is used as given):
an explicit boolean ``[B, 1, T, T]`` tensor for SDPA (CPU, or any device; memory grows with ``T**2``) and a
FlexAttention ``BlockMask`` for ``attn_implementation="flex_attention"`` on GPU (only the blocks on the
diagonal bands are computed).
"""

from __future__ import annotations

from typing import Any

import torch

from . import flash_attention
from .flash_attention import FLASH_VARLEN, get_causal_work, get_cu_seqlens, get_length_bound

FLEX_ATTENTION = "flex_attention"
# transformers attention-implementation names of :func:`rlrun_runtime.context_parallel.install_context_parallel`
# (SDPA and FlexAttention behind a gather of the row's keys and values).
CP_SDPA = "rlrun_cp_sdpa"
CP_FLEX_ATTENTION = "rlrun_cp_flex_attention"


def get_dense_document_mask(doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor | None = None,
                            query_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Boolean ``[B, 1, Tq, Tk]`` mask (True = may attend): same document and not in the future.

    ``doc_ids`` ``[B, Tq]`` (int64, any device) are the queries' documents; without ``kv_doc_ids`` the keys are
    the same row in the same order. A context-parallel shard (:mod:`rlrun_runtime.context_parallel`) passes the
    keys' documents ``kv_doc_ids`` ``[B, Tk]`` and the row positions of its queries (``[Tq]``) and of the keys
    (``[Tk]``), in the order the kernel sees them.

    The padding tail (``doc_ids == -1``) forms one more document of its own, so no row is all False (SDPA
    would return NaN there).
    """
    if kv_doc_ids is None:
        positions = torch.arange(doc_ids.shape[-1], device=doc_ids.device)
        kv_doc_ids, query_positions, key_positions = doc_ids, positions, positions
    causal = query_positions.view(1, -1, 1) >= key_positions.view(1, 1, -1)
    same = doc_ids.unsqueeze(-1) == kv_doc_ids.unsqueeze(-2)
    return (same & causal).unsqueeze(1)


def get_block_document_mask(doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor | None = None,
                            query_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None
                            ) -> Any:
    """FlexAttention ``BlockMask`` of the same pattern as :func:`get_dense_document_mask` (same arguments; any
    device, the trainer uses it on CUDA).

    ``create_block_mask`` runs compiled: eager, it evaluates ``mask_mod`` over the whole ``[T, T]`` grid with
    int64 intermediates, a 32 GiB allocation at T = 65,536 (the out-of-memory error of ``packed64cs`` on an H100,
    2026-12-07; benchmarks/README.md). Compiled, it reduces block by block; one dynamic-shape graph serves every
    ``doc_ids`` and row length, and one more every context-parallel shard.

    Raises:
        ImportError: this torch has no FlexAttention.
    """
    batch, queries = doc_ids.shape
    if kv_doc_ids is None:  # the kernel evaluates this in every partially masked block: no position lookups
        def mask_mod(b, h, q, k):
            return (doc_ids[b, q] == doc_ids[b, k]) & (q >= k)

        keys = queries
    else:
        # One captured table, the keys' codes then the queries', each (doc_id + 1) x 2^32 + row position: equal
        # documents have equal high words, and within one document the codes order as the positions do. (A
        # mask_mod reading several captured tensors by q and by k failed to compile on CPU at the second row
        # length, torch 2.13; this has the access pattern of the unsharded mask.)
        keys = kv_doc_ids.shape[-1]
        table = torch.cat([(kv_doc_ids + 1) * _CODE_BASE + key_positions.view(1, -1),
                           (doc_ids + 1) * _CODE_BASE + query_positions.view(1, -1)], dim=1)

        def mask_mod(b, h, q, k):
            query, key = table[b, q + keys], table[b, k]
            return (query // _CODE_BASE == key // _CODE_BASE) & (query >= key)

    return _get_compiled_create_block_mask()(mask_mod, batch, None, queries, keys, device=doc_ids.device)


_CODE_BASE = 2**32  # above any row position: the document in the high word of a shard mask's codes
_COMPILED_CREATE_BLOCK_MASK: Any = None


def _get_compiled_create_block_mask() -> Any:
    """``torch.compile(create_block_mask)``, built once per process (compiling happens at the first call)."""
    global _COMPILED_CREATE_BLOCK_MASK
    if _COMPILED_CREATE_BLOCK_MASK is None:
        from torch.nn.attention.flex_attention import create_block_mask

        # dynamic: one graph for every row length and query shard (with static shapes each new length compiles
        # again, 7-10 s on an H100, and a changed query length with the same key length fails to compile on CPU)
        _COMPILED_CREATE_BLOCK_MASK = torch.compile(create_block_mask, dynamic=True)
    return _COMPILED_CREATE_BLOCK_MASK


def uses_flex_attention(attn_implementation: str) -> bool:
    """Whether the transformers ``attn_implementation`` runs FlexAttention (and so takes a ``BlockMask``; the
    varlen one for rows below :data:`rlrun_runtime.flash_attention.FLASH_MIN_CAUSAL_WORK`)."""
    return attn_implementation in (FLEX_ATTENTION, CP_FLEX_ATTENTION, FLASH_VARLEN)


def get_model_inputs(mb: Any, device: torch.device, attn_implementation: str) -> dict[str, Any]:
    """Keyword arguments of the model's forward for micro-batch ``mb`` (:class:`rlrun_runtime.packing.MicroBatch`).

    Padded micro-batches pass their 2-D ``attention_mask``; packed ones pass ``position_ids`` (restarting per
    document) and the documents: their bounds (``cu_seq_lens_q``/``_k``, ``max_length_q``/``_k``) when the model
    runs varlen FlashAttention (:mod:`rlrun_runtime.flash_attention`) and the rows hold at least
    ``FLASH_MIN_CAUSAL_WORK`` of causal work (the length bound rounded up: :func:`get_length_bound`), else the
    document mask: a ``BlockMask`` when it runs FlexAttention (or varlen FlashAttention, for less work), else the
    dense mask. A context-parallel shard (``mb.kv_doc_ids`` set) gets the mask of its queries over the whole
    row's keys.

    Raises:
        ValueError: a context-parallel shard for the varlen FlashAttention implementation.
    """
    input_ids = mb.input_ids.to(device, non_blocking=True)
    if mb.doc_ids is None:
        return {"input_ids": input_ids, "attention_mask": mb.attention_mask.to(device, non_blocking=True)}
    position_ids = mb.position_ids.to(device, non_blocking=True)
    if attn_implementation == FLASH_VARLEN:
        if mb.kv_doc_ids is not None:
            raise ValueError(f"{FLASH_VARLEN} attention does not take context-parallel shards; use FlexAttention")
        bounds, longest = get_cu_seqlens(mb.doc_ids)
        if get_causal_work(bounds) >= flash_attention.FLASH_MIN_CAUSAL_WORK:
            bounds = bounds.to(device, non_blocking=True)
            # one compiled layer for every document count (dynamic), and a power-of-two length bound
            torch._dynamo.mark_dynamic(bounds, 0)
            bound = get_length_bound(longest)
            return {"input_ids": input_ids, "position_ids": position_ids, "cu_seq_lens_q": bounds,
                    "cu_seq_lens_k": bounds, "max_length_q": bound, "max_length_k": bound}
    shard = [t if t is None else t.to(device, non_blocking=True)
             for t in (mb.kv_doc_ids, mb.query_positions, mb.key_positions)]
    build = get_block_document_mask if uses_flex_attention(attn_implementation) else get_dense_document_mask
    mask = build(mb.doc_ids.to(device, non_blocking=True), *shard)
    return {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask}
