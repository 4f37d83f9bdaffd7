"""Triton kernels for the LM head's kept logits on GPU: the sampled tokens' logprobs and log-sum-exps in one
read of the ``[N, V]`` logits, and their gradient written over them in one read and one write.

Used by :class:`rlrun_runtime.logprobs.ChunkedTokenLogprobs` when it keeps the logits on a CUDA device (torch's
compiled elementwise code took about 3x the bytes' time there: 10 ms for 12,288 x 151,936 bf16 logits on an
H100, 2026-12-07, benchmarks/README.md). The formulas are the module's: float32 arithmetic,
``x = logit / temperature`` (vLLM divides the float32 logits by the temperature), ``lse = logsumexp(x)``,
``logprob = x[target] - lse``, gradient ``g * (onehot(target) - exp(x - lse)) / temperature``.
"""

from __future__ import annotations

import functools

import torch

FORWARD_BLOCK = 4096  # columns per step of a row's online log-sum-exp
GRAD_BLOCK = 4096  # columns per program of the gradient


@functools.cache
def _get_kernels():
    try:  # torch's CUDA builds install Triton; kernels_usable() is False without it
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise RuntimeError(f"the LM head's kernels need Triton: {exc}") from exc

    @triton.jit
    def lse_kernel(logits, stride, targets, logprobs, lses, vocab, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride
        cols = tl.arange(0, BLOCK)
        # per lane running maximum and sum of exp(x - maximum) (an online softmax), merged at the end
        high = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) / temperature
            new_high = tl.maximum(high, x)
            # lanes still at -inf (masked) keep a zero sum without computing exp(-inf - -inf)
            scale = tl.where(new_high == float("-inf"), 0.0, tl.exp(high - new_high))
            total = total * scale + tl.where(new_high == float("-inf"), 0.0, tl.exp(x - new_high))
            high = new_high
        top = tl.max(high, 0)
        lse = top + tl.log(tl.sum(total * tl.exp(high - top), 0))
        target = tl.load(targets + row)
        picked = tl.load(base + target).to(tl.float32) / temperature
        tl.store(logprobs + row, picked - lse)
        tl.store(lses + row, lse)

    @triton.jit
    def grad_kernel(logits, stride, targets, lses, grads, vocab, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = idx < vocab
        ptrs = logits + row.to(tl.int64) * stride + idx
        x = tl.load(ptrs, mask=keep, other=0.0).to(tl.float32) / temperature
        lse = tl.load(lses + row)
        g = tl.load(grads + row)
        onehot = (idx == tl.load(targets + row)).to(tl.float32)
        grad = (onehot - tl.exp(x - lse)) * g / temperature
        tl.store(ptrs, grad.to(logits.dtype.element_ty), mask=keep)

    return lse_kernel, grad_kernel


def kernels_usable(logits: torch.Tensor) -> bool:
    """Whether the kernels take ``logits``: a row-contiguous 2-D CUDA tensor of bf16, fp16 or float32, and
    Triton imports."""
    if logits.device.type != "cuda" or logits.dim() != 2 or logits.stride(1) != 1:
        return False
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def token_logprobs_and_lse(logits: torch.Tensor, targets: torch.Tensor,
                           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, lse)``, float32 ``[N]`` each, of ``logits`` ``[N, V]`` at ``targets`` ``[N]`` (int64, on the
    logits' device, each in ``[0, V)``: unlike ``gather``, the kernel does not check the range)."""
    count, vocab = logits.shape
    logprobs = torch.empty(count, dtype=torch.float32, device=logits.device)
    lse = torch.empty(count, dtype=torch.float32, device=logits.device)
    if count:
        lse_kernel, _ = _get_kernels()
        lse_kernel[(count,)](logits, logits.stride(0), targets.contiguous(), logprobs, lse, vocab, float(temperature),
                             BLOCK=FORWARD_BLOCK, num_warps=8)
    return logprobs, lse


def logits_to_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor,
                    temperature: float) -> None:
    """Overwrite ``logits`` ``[N, V]`` with the gradient of the logprobs (``grad_out`` float32 ``[N]``, ``lse``
    from :func:`token_logprobs_and_lse`) with respect to them."""
    count, vocab = logits.shape
    if count:
        _, grad_kernel = _get_kernels()
        grid = (count, (vocab + GRAD_BLOCK - 1) // GRAD_BLOCK)
        grad_kernel[grid](logits, logits.stride(0), targets.contiguous(), lse.contiguous(), grad_out.contiguous(),
                          vocab, float(temperature), BLOCK=GRAD_BLOCK, num_warps=8)
