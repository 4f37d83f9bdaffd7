"""The token-level importance-sampled policy-gradient loss (pure tensor functions).

Rollouts are sampled by the inference engine with policy ``pi_inf`` (an older policy version, and another
numeric implementation); the trainer computes ``pi_train`` with gradients. For every completion token::

    log_ratio = logp_train - logp_inf           (detached only for the band test and the metrics)
    ratio     = exp(log_ratio)                  importance ratio pi_train / pi_inf
    keep      = loss_mask and ratio_low <= ratio <= ratio_high
    token_loss = -ratio * advantage + kl_coef * k3
    k3        = ratio - 1 - log_ratio           (Schulman 2020, "Approximating KL Divergence", k3:
                                                 unbiased, non-negative estimate of KL(pi_inf || pi_train)
                                                 from samples of pi_inf)

The gradient of ``-ratio * A`` is ``-A * ratio * grad(logp_train)``: the off-policy policy gradient with a
per-token importance weight. Tokens whose ratio leaves the trust band ``[ratio_low, ratio_high]`` are masked
out entirely (no gradient), as prime-rl's loss does (token-level masking rather than PPO clipping).

Normalisation: ``loss = sum(token_loss over kept tokens) / total_loss_tokens``, where ``total_loss_tokens``
is the number of loss-mask tokens of the WHOLE trainer step (every micro-batch on every rank). Summing this
loss over micro-batches and ranks therefore gives exactly the full-batch loss, and its gradient does not
depend on micro-batching, padding, packing or the rank split. The metrics are normalised the same way, so
they also add up over micro-batches to the step means.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LossMetrics:
    """Per-step means (each already divided by the step's ``total_loss_tokens``: sum them over micro-batches).

    Attributes:
        mismatch_kl: mean k3 estimate of KL(pi_inf || pi_train) over loss-mask tokens (nats per token).
        masked_fraction: fraction of loss-mask tokens whose importance ratio left the trust band.
        ratio_mean: mean importance ratio pi_train / pi_inf over loss-mask tokens.
        advantage_mean: mean per-token advantage over loss-mask tokens.
    """

    mismatch_kl: float = 0.0
    masked_fraction: float = 0.0
    ratio_mean: float = 0.0
    advantage_mean: float = 0.0

    def __add__(self, other: "LossMetrics") -> "LossMetrics":
        return LossMetrics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_tensor(self) -> torch.Tensor:
        """The metrics as a float64 vector (for an all-reduce sum across ranks)."""
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "LossMetrics":
        """Inverse of :meth:`as_tensor`."""
        return cls(**{f.name: float(v) for f, v in zip(fields(cls), values.tolist())})


def token_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    vLLM reports the sampled token's logprob after temperature scaling when run with
    ``--logprobs-mode processed_logprobs`` (docs/runtime-contract.md), so the trainer divides its logits by
    the same temperature for the importance ratio to compare like with like.

    Args:
        logits: ``[..., T, V]`` (any float dtype; computed in float32).
        target_ids: ``[..., T]`` int64 token ids, the token each position predicts.
        temperature: sampling temperature (> 0).

    Returns:
        ``[..., T]`` float32 log-probabilities.

    Raises:
        ValueError: ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def policy_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    total_loss_tokens: int,
    ratio_low: float = 0.125,
    ratio_high: float = 8.0,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossMetrics]:
    """Token-level importance-sampled policy-gradient loss of one micro-batch (see the module docstring).

    Args:
        trainer_logprobs: ``[B, T]`` logprobs of the sampled tokens under the trainer's policy (with grad).
        inference_logprobs: ``[B, T]`` the same tokens' logprobs reported by vLLM (no grad).
        advantages: ``[B, T]`` the sample's advantage broadcast over its tokens.
        loss_mask: ``[B, T]`` bool, True on completion tokens (prompt and padding are False).
        total_loss_tokens: loss-mask tokens of the whole step across micro-batches and ranks (>= 1).
        ratio_low, ratio_high: trust band of the importance ratio (``spec.algorithm.loss``; defaults are the
            CRD's 0.125 and 8.0).
        kl_coef: weight of the k3 mismatch-KL penalty (0 disables it).

    Returns:
        ``(loss, metrics)``: a scalar tensor (differentiable in ``trainer_logprobs``) and :class:`LossMetrics`
        normalised by ``total_loss_tokens``.

    Raises:
        ValueError: mismatched shapes, or ``total_loss_tokens < 1``.
    """
    shape = trainer_logprobs.shape
    for name, t in (("inference_logprobs", inference_logprobs), ("advantages", advantages),
                    ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like trainer_logprobs")
    if total_loss_tokens < 1:
        raise ValueError(f"total_loss_tokens must be >= 1, got {total_loss_tokens}")

    mask = loss_mask.bool()
    # Prompt and padding positions may hold arbitrary values: zero them so exp() cannot overflow there.
    log_ratio = torch.where(mask, trainer_logprobs.float() - inference_logprobs.float(), 0.0)
    with torch.no_grad():
        ratio_all = torch.exp(log_ratio)
        outside = (ratio_all < ratio_low) | (ratio_all > ratio_high)
        keep = mask & ~outside
        k3_all = ratio_all - 1.0 - log_ratio
    # Out-of-band tokens get log_ratio 0 before exp(): an overflowing ratio there would otherwise turn the
    # zero gradient of the masked branch into 0 * inf = NaN.
    kept_log_ratio = torch.where(keep, log_ratio, 0.0)
    ratio = torch.exp(kept_log_ratio)
    token_loss = -ratio * advantages.float()
    if kl_coef:
        token_loss = token_loss + kl_coef * (ratio - 1.0 - kept_log_ratio)
    loss = torch.where(keep, token_loss, 0.0).sum() / total_loss_tokens

    with torch.no_grad():
        n = float(total_loss_tokens)
        metrics = LossMetrics(
            mismatch_kl=float(torch.where(mask, k3_all, 0.0).sum()) / n,
            masked_fraction=float((mask & outside).sum()) / n,
            ratio_mean=float(torch.where(mask, ratio_all, 0.0).sum()) / n,
            advantage_mean=float(torch.where(mask, advantages.float(), 0.0).sum()) / n,
        )
    return loss, metrics
