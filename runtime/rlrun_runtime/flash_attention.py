"""Varlen FlashAttention for packed rows on Hopper and Blackwell GPUs: FlashAttention-4's CuTe DSL kernels
(PyPI ``flash-attn-4``, module ``flash_attn.cute``) behind two torch custom ops, so compiled decoder layers keep
them as single graph nodes, and a transformers attention function that reads each document's bounds
(``cu_seq_lens_q``) instead of a mask, or runs FlexAttention when it gets a ``BlockMask`` instead.

Optional: the trainer uses it when :func:`get_flash_unavailable_reason` returns None; per micro-batch
(:func:`rlrun_runtime.packed_attention.get_model_inputs`) FlashAttention-4 takes rows of much causal work and
FlexAttention the rest (:data:`FLASH_MIN_CAUSAL_WORK`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# The transformers attention-implementation name registered by install(). Without "flash" in it: transformers
# takes any such name for a FlashAttention request and fails to load the model (5.17, H100, 2026-12-07).
FLASH_VARLEN = "rlrun_varlen_attention"
# FlashAttention-4 for a micro-batch whose causal work, the sum of its segments' squared lengths, reaches this;
# FlexAttention below. One layer's attention forward+backward (benchmarks/varlen_attention_check.py, 16 query
# heads of 128 over 8 KV heads, bf16, H100, 2026-12-07), FlashAttention-4 against FlexAttention: 16 x 1024 tokens
# (16.8M) 0.92x, 16 of 512-1024 (8.5M) 0.64x, 64 x 1024 (67M) 1.15x, one of 65,536 (4.3G) 1.57x.
FLASH_MIN_CAUSAL_WORK = 1 << 25
# The version whose private _flash_attn_fwd / _flash_attn_bwd this module calls (measured above); another
# version is not used (get_flash_unavailable_reason), since private signatures may change.
FLASH_ATTN_VERSION = "4.0.0b36"
# Bound passed as max_seqlen: the longest segment rounded up to a power of two, at least this, so compiled layers
# see few distinct values (each is a compiled variant); FlashAttention-4 only sizes its grid by it.
MIN_LENGTH_BOUND = 1024
FLASH_DTYPES = (torch.bfloat16, torch.float16)
# FlashAttention-4 4.0.0b36 runs its CuTe DSL kernels on these compute capabilities (interface.py's arch checks:
# SM90 forward and backward, SM100/SM110 forward and backward).
FLASH_MAJORS = (9, 10, 11)


def get_flash_unavailable_reason(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                                 model_config: Any = None) -> str | None:
    """None when varlen FlashAttention can run on ``device`` with compute ``dtype`` for a model of
    ``model_config`` (a transformers config, optional), else why not (one line, for logs)."""
    if device.type != "cuda":
        return f"device {device.type} is not a CUDA GPU"
    if dtype not in FLASH_DTYPES:
        return f"compute dtype {dtype} is not bfloat16 or float16"
    for name in ("use_sliding_window", "attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(model_config, name, None):
            return f"the model config sets {name}"
    head_dim = getattr(model_config, "head_dim", None)
    if isinstance(head_dim, int) and not (8 <= head_dim <= 256 and head_dim % 8 == 0):
        return f"head_dim {head_dim} is outside FlashAttention-4's 8-256 (multiples of 8)"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH_MAJORS:
        return f"compute capability {major}.{minor} is not Hopper or Blackwell (9.x-11.x)"
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("flash-attn-4")
    except PackageNotFoundError:
        return "PyPI flash-attn-4 is not installed"
    if found != FLASH_ATTN_VERSION:
        return f"flash-attn-4 {found} is installed; rlrun calls the private functions of {FLASH_ATTN_VERSION}"
    try:
        _get_interface()
    except Exception as exc:  # ImportError, or the CUTLASS DSL failing to load its libraries
        return f"flash_attn.cute (PyPI flash-attn-4) does not import: {type(exc).__name__}: {exc}"
    return None


def _get_interface() -> Any:
    """FlashAttention-4's ``flash_attn.cute.interface`` module (its ``_flash_attn_fwd`` / ``_bwd``; measured with
    flash-attn-4 4.0.0b36, whose private functions these are).

    Raises:
        RuntimeError: PyPI flash-attn-4 is not installed.
    """
    try:
        from flash_attn.cute import interface
    except ImportError as exc:
        raise RuntimeError(f"varlen FlashAttention needs PyPI flash-attn-4: {exc}") from exc
    return interface


def get_cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative document bounds of packed rows, for varlen kernels.

    ``doc_ids`` ``[B, T]`` (int64, CPU; :class:`rlrun_runtime.packing.MicroBatch`) numbers each position's
    document, -1 on the padding tail. The ``B * T`` flattened positions split into segments wherever the
    document or the row changes; the padding tail is a segment of its own (attending causally within itself, as
    in the dense mask). Returns ``(cu_seqlens, max_seqlen)``: int32 ``[segments + 1]`` from 0 to ``B * T``, and
    the longest segment's length.

    Raises:
        ValueError: ``doc_ids`` is not 2-D or is empty.
    """
    if doc_ids.dim() != 2 or doc_ids.numel() == 0:
        raise ValueError(f"doc_ids must be a non-empty [B, T] tensor, not shape {tuple(doc_ids.shape)}")
    rows, length = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    bounds = torch.cat([starts.reshape(-1).nonzero().squeeze(1), torch.tensor([rows * length])])
    return bounds.to(torch.int32), int(bounds.diff().max())


def get_length_bound(longest: int) -> int:
    """The ``max_seqlen`` bound passed for a longest segment of ``longest`` tokens: the next power of two, at least
    :data:`MIN_LENGTH_BOUND`."""
    return max(MIN_LENGTH_BOUND, 1 << max(0, longest - 1).bit_length())


def get_causal_work(cu_seqlens: torch.Tensor) -> int:
    """Sum of the segments' squared lengths (proportional to causal attention's FLOPs) of ``cu_seqlens``."""
    return int((cu_seqlens.diff().long() ** 2).sum())


@torch.library.custom_op("rlrun::flash_varlen_fwd", mutates_args=(), device_types="cuda")
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each segment of ``cu_seqlens``: ``q`` ``[N, H, D]``, ``k``/``v`` ``[N, H_kv, D]``
    (``H`` a multiple of ``H_kv``; all bf16 or all fp16, else FlashAttention-4 raises AssertionError),
    ``cu_seqlens`` int32 ``[S + 1]`` on the same device, ``max_seqlen`` at least the longest segment. Returns
    ``out`` ``[N, H, D]`` and the log-sum-exp ``[H, N]`` (float32) the backward needs. The backward is not
    bitwise deterministic (FlashAttention-4 accumulates dq with atomics)."""
    out, lse, *_ = _get_interface()._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                    max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                                    softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@flash_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("rlrun::flash_varlen_bwd", mutates_args=(), device_types="cuda")
def flash_varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`flash_varlen_fwd` (shapes of ``q``, ``k``, ``v``)."""
    dq, dk, dv = _get_interface()._flash_attn_bwd(q, k, v, out, grad_out, lse, scale, True,
                                                  cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                  max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
    return dq, dk, dv


@flash_varlen_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _backward(ctx: Any, grad_out: torch.Tensor, grad_lse: torch.Tensor | None) -> tuple:
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = flash_varlen_bwd(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


flash_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_varlen_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                           cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``): ``query`` ``[B, H, T, D]``, ``key``/``value``
    ``[B, H_kv, T, D]``; returns ``([B, T, H, D], None)``. The documents come as ``cu_seq_lens_q`` (int32, over
    the ``B * T`` flattened positions) and ``max_length_q`` (:func:`get_cu_seqlens`), and ``attention_mask`` is
    None; or ``attention_mask`` is a FlexAttention ``BlockMask``, and transformers' FlexAttention runs.

    Raises:
        ValueError: neither a ``BlockMask`` nor ``cu_seq_lens_q`` / ``max_length_q`` (a padded micro-batch);
            dropout, a sliding window or a softcap with ``cu_seq_lens_q``.
    """
    if cu_seq_lens_q is None or max_length_q is None:
        if type(attention_mask).__name__ == "BlockMask":
            from transformers.integrations.flex_attention import flex_attention_forward

            return flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)
        raise ValueError(f"{FLASH_VARLEN} attention needs packed rows (a BlockMask, or cu_seq_lens_q and "
                         "max_length_q)")
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError(f"{FLASH_VARLEN} attention has no dropout, sliding window or softcap (got {dropout}, "
                         f"{kwargs.get('sliding_window')}, {kwargs.get('softcap')})")
    batch, heads, length, dim = query.shape
    scale = dim ** -0.5 if scaling is None else scaling

    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1])

    out, _ = flash_varlen_fwd(flat(query), flat(key), flat(value), cu_seq_lens_q, max_length_q, scale)
    return out.view(batch, length, heads, -1), None


@functools.cache
def install() -> str:
    """Register :func:`flash_varlen_attention` with transformers as :data:`FLASH_VARLEN` (once per process; no
    mask function, so transformers passes no mask); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLASH_VARLEN, flash_varlen_attention)
    return FLASH_VARLEN
