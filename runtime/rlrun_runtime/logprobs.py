"""Log-probabilities of the sampled tokens straight from the last hidden states, without a [tokens, vocab]
float32 tensor.

:class:`ChunkedTokenLogprobs` computes, for the loss positions only and ``chunk`` tokens at a time,
``logits = hidden @ weight.T`` (in the weight's dtype, as the LM head), then in float32
``log_softmax(logits / temperature)[target]`` (vLLM's processed logprobs: it casts the logits to float32 and
divides by the temperature before the log-softmax). Only ``[N]`` log-sum-exps are kept for the backward, which
recomputes each chunk's logits. Peak extra memory: one chunk of logits (:func:`get_chunk_tokens`).

:class:`LogprobHead` replaces a model's ``lm_head`` (same ``weight`` parameter, same state-dict key): with a
request set it returns these logprobs instead of logits, so the computation runs inside the model's own
forward (FSDP2's root hooks gather the head's weight as usual).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

CHUNK_BYTES = 1 << 30  # float32 logits of one chunk: about 1 GiB


def get_chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's float32 logits take about ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (4 * max(1, vocab_size)))


def get_logit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-softmax: float32, or float64 for float64 weights (tests)."""
    return torch.promote_types(dtype, torch.float32)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``[N]`` float32 (float64 for float64 inputs) logprobs of ``targets`` under
    ``softmax((hidden @ weight.T).float() / temperature)``.

    Inputs: ``hidden`` ``[N, H]``, ``weight`` ``[V, H]`` (same dtype), ``targets`` ``[N]`` int64,
    ``temperature`` (> 0), ``chunk`` tokens per chunk. Gradients flow to ``hidden`` and ``weight``. Under CUDA
    autocast (an unwrapped model, float32 weights) the backward's matrix products run in the autocast dtype
    as the forward's do (``torch.amp.custom_bwd``), not in float32.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, compiled: bool = False) -> torch.Tensor:
        count, dtype = hidden.shape[0], get_logit_dtype(weight.dtype)
        out = torch.empty(count, dtype=dtype, device=hidden.device)
        lse = torch.empty(count, dtype=dtype, device=hidden.device)
        forward_chunk = _compiled(_forward_chunk) if compiled else _forward_chunk
        for start in range(0, count, chunk):
            end = min(count, start + chunk)
            out[start:end], lse[start:end] = forward_chunk(hidden[start:end], weight, targets[start:end],
                                                           temperature, dtype)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.compiled = temperature, chunk, compiled
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        dtype = get_logit_dtype(weight.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_out = grad_out.to(dtype)
        grad_chunk = _compiled(_grad_logits_chunk) if ctx.compiled else _grad_logits_chunk
        for start in range(0, hidden.shape[0], chunk):
            end = min(hidden.shape[0], start + chunk)
            h = hidden[start:end]
            grad_logits = grad_chunk(h, weight, targets[start:end], lse[start:end], grad_out[start:end],
                                     temperature, dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight.add_(grad_logits.t() @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _forward_chunk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, log-sum-exp) of one chunk; logits ``(h @ weight.T).to(dtype) / temperature``."""
    logits = F.linear(h, weight).to(dtype)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse


def _grad_logits_chunk(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                       grad_out: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """Gradient of one chunk's logits (in the weight's dtype): ``g * (onehot(target) - softmax) / temperature``."""
    logits = F.linear(h, weight).to(dtype)
    if temperature != 1.0:
        logits = logits / temperature
    g = grad_out.unsqueeze(-1)
    grad_logits = torch.exp(logits - lse.unsqueeze(-1)) * -g
    grad_logits = grad_logits.scatter_add(-1, targets.unsqueeze(-1), g)
    if temperature != 1.0:
        grad_logits = grad_logits / temperature
    return grad_logits.to(weight.dtype)


_COMPILED: dict[Any, Any] = {}


def _compiled(fn: Any) -> Any:
    """``torch.compile(fn)`` once per function (dynamic shapes: the last chunk is shorter)."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           temperature: float = 1.0, chunk: int | None = None, compiled: bool = False) -> torch.Tensor:
    """:class:`ChunkedTokenLogprobs` with ``chunk`` from :func:`get_chunk_tokens` when None; ``compiled`` runs
    each chunk's elementwise arithmetic through ``torch.compile`` (fused kernels; same formulas).

    Raises:
        ValueError: ``temperature <= 0``, or mismatched shapes.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)}: expected [N, H], [V, H], [N]")
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, float(temperature),
                                      chunk or get_chunk_tokens(weight.shape[0]), compiled)


class LogprobHead(torch.nn.Module):
    """An LM head (``weight`` ``[V, H]``, no bias) that returns the sampled tokens' logprobs when asked.

    With ``request`` None it is the plain linear head (returns logits). With ``request = (positions, targets,
    temperature)`` set (``positions`` ``[N]`` int64 indices into the flattened ``[B * T]`` positions, ``targets``
    ``[N]``), its forward returns the ``[N]`` logprobs of :func:`chunked_token_logprobs` at those positions.
    """

    def __init__(self, head: torch.nn.Linear, chunk: int | None = None, compiled: bool = False):
        super().__init__()
        if getattr(head, "bias", None) is not None:
            raise ValueError("LogprobHead: an LM head with a bias is not supported")
        self.weight = head.weight
        self.chunk, self.compiled = chunk, compiled
        self.request: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return F.linear(hidden, self.weight)
        positions, targets, temperature = self.request
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return chunked_token_logprobs(flat, self.weight, targets, temperature, self.chunk, self.compiled)


def install_logprob_head(model: torch.nn.Module, chunk: int | None = None, compiled: bool = False) -> bool:
    """Replace ``model.lm_head`` (a bias-free ``nn.Linear``) by a :class:`LogprobHead` sharing its weight
    (tied embeddings stay tied); returns whether it was installed (False: no such head, left as it is)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, LogprobHead):
        return True
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    model.lm_head = LogprobHead(head, chunk, compiled)
    return True
