"""Log-probabilities of the sampled tokens straight from the last hidden states, without a [tokens, vocab]
float32 tensor.

:class:`ChunkedTokenLogprobs` computes, for the loss positions only and ``chunk`` tokens at a time,
``logits = hidden @ weight.T`` (in the weight's dtype, as the LM head), then in float32
``log_softmax(logits / temperature)[target]`` (vLLM's processed logprobs: it casts the logits to float32 and
divides by the temperature before the log-softmax). When all ``[N, V]`` logits fit in ``keep_bytes`` in their
own dtype they are computed in one matrix product and kept, and the backward turns them into their gradient in
place (two matrix products in all, no recompute); otherwise only ``[N]`` log-sum-exps are kept and the backward
recomputes each chunk's logits. Extra memory: the kept logits, or one chunk's (:func:`get_chunk_tokens`).

:class:`LogprobHead` replaces a model's ``lm_head`` (same ``weight`` parameter, same state-dict key): with a
request set it returns these logprobs instead of logits, so the computation runs inside the model's own
forward (FSDP2's root hooks gather the head's weight as usual).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .logprob_kernels import kernels_usable, logits_to_grad_, token_logprobs_and_lse

CHUNK_BYTES = 1 << 30  # float32 logits of one chunk: about 1 GiB
# Logits kept for the backward up to this size: 16,384 tokens x 151,936 words in bf16 is 4.6 GiB, held from the
# end of the forward to the head's backward (the peak of a step). Keeping them saves one [N, H] x [H, V] matrix
# product of the head's four per step (the backward's recompute).
KEEP_LOGITS_BYTES = 5 << 30


def get_chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def get_logit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-softmax: float32, or float64 for float64 weights (tests)."""
    return torch.promote_types(dtype, torch.float32)


def get_matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` returns here: the autocast dtype under autocast, else the weight's."""
    device = hidden.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device) and weight.dtype != torch.float64:
        return torch.get_autocast_dtype(device)  # autocast leaves float64 alone
    return weight.dtype


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``[N]`` float32 (float64 for float64 inputs) logprobs of ``targets`` under
    ``softmax((hidden @ weight.T).float() / temperature)``.

    Inputs: ``hidden`` ``[N, H]``, ``weight`` ``[V, H]`` (same dtype), ``targets`` ``[N]`` int64,
    ``temperature`` (> 0), ``chunk`` tokens per chunk, ``keep_bytes`` (logits up to this size are kept for
    the backward). Gradients flow to ``hidden`` and ``weight``. Under CUDA or CPU autocast (an unwrapped
    model, float32 weights) the backward's matrix products run in the autocast dtype as the forward's do, not
    in float32. With kept logits the backward consumes them (in place): a
    second backward through the same graph raises torch's in-place modification error. When the device has
    no room for all the logits (``torch.OutOfMemoryError`` on their allocation, at the step's peak) the
    chunks are recomputed instead, as with ``keep_bytes`` 0.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, compiled: bool = False, keep_bytes: int = KEEP_LOGITS_BYTES,
                kernels: bool = True) -> torch.Tensor:
        count, dtype = hidden.shape[0], get_logit_dtype(weight.dtype)
        kept = None
        if count * weight.shape[0] * get_matmul_dtype(hidden, weight).itemsize <= keep_bytes:
            try:
                kept = F.linear(hidden, weight)
            except torch.OutOfMemoryError:  # no room for all of them at this step's peak: recompute instead
                kept = None
        # kept logits on a GPU: the Triton kernels, one pass over all of them (same formulas, float32)
        ctx.kernels = kernels and kept is not None and dtype == torch.float32 and kernels_usable(kept)
        if ctx.kernels:
            out, lse = token_logprobs_and_lse(kept, targets, temperature)
        else:
            out = torch.empty(count, dtype=dtype, device=hidden.device)
            lse = torch.empty(count, dtype=dtype, device=hidden.device)
            forward_chunk = _compiled(_forward_chunk) if compiled else _forward_chunk
            for start in range(0, count, chunk):
                end = min(count, start + chunk)
                logits = kept[start:end] if kept is not None else F.linear(hidden[start:end], weight)
                out[start:end], lse[start:end] = forward_chunk(logits, targets[start:end], temperature, dtype)
        if kept is not None:
            ctx.save_for_backward(hidden, weight, targets, lse, kept)
        else:
            ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.compiled = temperature, chunk, compiled
        # The backward recomputes and multiplies in the forward's matmul dtype: it re-enters the autocast state
        # of the forward (an unwrapped model computes under autocast; autograd runs the backward outside it).
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device) if device in ("cuda", "cpu") else False,
                        torch.get_autocast_dtype(device) if device in ("cuda", "cpu") else None)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        device, enabled, autocast_dtype = ctx.autocast
        if not enabled:
            return ChunkedTokenLogprobs._backward(ctx, grad_out)
        with torch.autocast(device, dtype=autocast_dtype):
            return ChunkedTokenLogprobs._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse, *kept = ctx.saved_tensors
        kept = kept[0] if kept else None
        temperature, chunk = ctx.temperature, ctx.chunk
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = get_logit_dtype(weight.dtype)
        grad_out = grad_out.to(dtype)
        to_grad = _compiled(_logits_to_grad_) if ctx.compiled else _logits_to_grad_
        grad_hidden = grad_weight = None
        if kept is None:
            grad_hidden = torch.empty_like(hidden) if need_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        if ctx.kernels:
            logits_to_grad_(kept, targets, lse, grad_out, temperature)
        for start in range(0, hidden.shape[0] if not ctx.kernels else 0, chunk):
            end = min(hidden.shape[0], start + chunk)
            logits = kept[start:end] if kept is not None else F.linear(hidden[start:end], weight)
            to_grad(logits, targets[start:end], lse[start:end], grad_out[start:end], temperature, dtype)
            if kept is None:  # logits now hold this chunk's gradient
                if need_hidden:
                    grad_hidden[start:end] = logits @ weight
                if need_weight:
                    grad_weight.add_(logits.t() @ hidden[start:end])
        if kept is not None:  # all of them do: one matrix product each, accumulated inside it
            grad_hidden = kept @ weight if need_hidden else None
            grad_weight = kept.t() @ hidden if need_weight else None
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _forward_chunk(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, log-sum-exp) of one chunk of logits, taken in ``dtype`` and divided by
    ``temperature``."""
    logits = logits.to(dtype)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse


def _logits_to_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                     temperature: float, dtype: torch.dtype) -> None:
    """Overwrite one chunk's logits with their gradient, ``g * (onehot(target) - softmax) / temperature``
    computed in ``dtype``. The one-hot is a comparison, not a scatter, so compiled it is one elementwise kernel
    that reads and writes the chunk once."""
    x = logits.to(dtype)
    if temperature != 1.0:
        x = x / temperature
    onehot = torch.arange(x.shape[-1], device=x.device) == targets.unsqueeze(-1)
    grad = (onehot.to(dtype) - torch.exp(x - lse.unsqueeze(-1))) * grad_out.unsqueeze(-1)
    if temperature != 1.0:
        grad = grad / temperature
    logits.copy_(grad)


_COMPILED: dict[Any, Any] = {}


def _compiled(fn: Any) -> Any:
    """``torch.compile(fn)`` once per function (dynamic shapes: the last chunk is shorter)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           temperature: float = 1.0, chunk: int | None = None, compiled: bool = False,
                           keep_bytes: int = KEEP_LOGITS_BYTES, kernels: bool = True) -> torch.Tensor:
    """:class:`ChunkedTokenLogprobs` with ``chunk`` from :func:`get_chunk_tokens` when None; ``compiled`` runs
    each chunk's elementwise arithmetic through ``torch.compile`` (fused kernels; same formulas); logits of at
    most ``keep_bytes`` are kept for the backward (0: always recompute; never kept when no gradient is wanted:
    grad mode off, or neither ``hidden`` nor ``weight`` requires one); ``kernels``: kept logits on a GPU go
    through :mod:`rlrun_runtime.logprob_kernels` (False: the chunk arithmetic, the benchmark's comparison).

    Raises:
        ValueError: ``temperature <= 0``, or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)}: expected [N, H], [V, H], [N]")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        keep_bytes = 0  # no backward will consume them: a chunk at a time bounds the peak
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature),
                                      chunk or get_chunk_tokens(weight.shape[0]), compiled, keep_bytes, kernels)


class LogprobHead(torch.nn.Module):
    """An LM head (``weight`` ``[V, H]``, no bias) that returns the sampled tokens' logprobs when asked.

    With ``request`` None it is the plain linear head (returns logits). With ``request = (positions, targets,
    temperature)`` set (``positions`` ``[N]`` int64 indices into the flattened ``[B * T]`` positions, ``targets``
    ``[N]``), its forward returns the ``[N]`` logprobs of :func:`chunked_token_logprobs` at those positions
    (``keep_bytes``: its bound on logits kept for the backward; ``kernels``: its switch for the Triton kernels).
    """

    def __init__(self, head: torch.nn.Linear, chunk: int | None = None, compiled: bool = False,
                 keep_bytes: int = KEEP_LOGITS_BYTES):
        super().__init__()
        if getattr(head, "bias", None) is not None:
            raise ValueError("LogprobHead: an LM head with a bias is not supported")
        self.weight = head.weight
        self.chunk, self.compiled, self.keep_bytes, self.kernels = chunk, compiled, keep_bytes, True
        self.request: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight)
        positions, targets, temperature = self.request
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return chunked_token_logprobs(flat, self.weight, targets, temperature, self.chunk, self.compiled,
                                      self.keep_bytes, self.kernels)


def install_logprob_head(model: torch.nn.Module, chunk: int | None = None, compiled: bool = False,
                         keep_bytes: int = KEEP_LOGITS_BYTES) -> bool:
    """Replace ``model.lm_head`` (a bias-free ``nn.Linear``) by a :class:`LogprobHead` sharing its weight
    (tied embeddings stay tied); returns whether it was installed (False: no such head, left as it is)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, LogprobHead):
        return True
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    model.lm_head = LogprobHead(head, chunk, compiled, keep_bytes)
    return True
