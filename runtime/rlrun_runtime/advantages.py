"""Group-baseline advantages for GRPO-style RL (pure Python, no torch: the orchestrator imports it).

A *group* is the ``rolloutsPerPrompt`` completions of one prompt. Each completion's advantage is its reward
minus the group's mean reward (the group-mean baseline of GRPO, Shao et al. 2024, arXiv:2402.03300, eq. in
section 4.1.2). By default the advantage is NOT divided by the group's reward standard deviation: Dr. GRPO
(Liu et al. 2025, arXiv:2503.20783, section 3.1) shows that the std division re-weights prompts by their
difficulty (groups that are almost all right or all wrong get amplified) and biases the update; rlrun follows
Dr. GRPO unless ``spec.algorithm.advantageStdNormalization`` is true.

Degenerate groups never produce huge or NaN advantages:
- a group whose rewards are equal up to float residue (e.g. ``0.1 + 0.2`` vs ``0.3``) gets exactly 0.0 for
  every member, with or without std normalisation (without this guard the std division turns a 1e-17
  residue into advantages of +-1);
- a non-finite reward (NaN, inf: a broken scorer or sample) is excluded from its group's baseline and gets
  advantage 0.0; the caller must drop such samples and count them (:func:`nonfinite_reward_indices`);
- with std normalisation the divisor is the population std plus ``STD_EPS``, so ``|advantage| <=
  sqrt(n - 1)`` for a group of ``n`` finite rewards; without it ``|advantage| <= max - min``.

Groups whose advantages are all zero carry no learning signal (their policy-gradient term is zero) but
would still count in the loss normaliser: :func:`rlrun_runtime.rollouts.assemble_batch` leaves a group out of
a batch when every advantage of its trainable members is exactly 0.0.
"""

from __future__ import annotations

import math
from typing import Sequence

# Rewards of a group that differ by at most this (relative to max(1, |largest reward|)) are "equal".
EQUAL_REWARD_RTOL = 1e-9
# Added to the group std before dividing (TRL's GRPOTrainer uses 1e-4 too); only with std_normalize.
STD_EPS = 1e-4


def _check_group_size(num_rewards: int, group_size: int) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if num_rewards % group_size:
        raise ValueError(
            f"{num_rewards} rewards do not split into whole groups of {group_size}: the rewards of each "
            "prompt's group must be consecutive and complete"
        )


def _group_advantages_one(rewards: Sequence[float], std_normalize: bool) -> list[float]:
    finite = [float(r) for r in rewards if math.isfinite(r)]
    if len(finite) < 2:
        return [0.0] * len(rewards)
    low, high = min(finite), max(finite)
    scale = max(1.0, abs(low), abs(high))
    if high - low <= EQUAL_REWARD_RTOL * scale:
        return [0.0] * len(rewards)
    mean = math.fsum(finite) / len(finite)
    denom = 1.0
    if std_normalize:
        var = math.fsum((r - mean) ** 2 for r in finite) / len(finite)
        denom = math.sqrt(var) + STD_EPS
    return [(float(r) - mean) / denom if math.isfinite(r) else 0.0 for r in rewards]


def group_advantages(rewards: Sequence[float], group_size: int, std_normalize: bool = False) -> list[float]:
    """Group-mean-baseline advantages of a flat list of rewards.

    Args:
        rewards: ``num_groups * group_size`` floats; the rewards of one group are consecutive.
        group_size: completions per prompt (``spec.algorithm.rolloutsPerPrompt``).
        std_normalize: divide by the group's population std + ``STD_EPS`` (GRPO); default False (Dr. GRPO).

    Returns:
        A list of the same length: ``r_i - mean(group)`` (or that over ``std + STD_EPS``). Members of
        groups with equal rewards (up to ``EQUAL_REWARD_RTOL``), groups with fewer than two finite rewards,
        and samples with a non-finite reward get exactly 0.0; a non-finite reward is left out of the mean.

    Raises:
        ValueError: ``group_size < 1`` or ``len(rewards)`` not a multiple of it.
    """
    _check_group_size(len(rewards), group_size)
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        out.extend(_group_advantages_one(rewards[start:start + group_size], std_normalize))
    return out


def nonfinite_reward_indices(rewards: Sequence[float]) -> list[int]:
    """Indices of rewards that are NaN or infinite: samples the caller must drop and count.

    Their advantage from :func:`group_advantages` is 0.0 and they are not part of their group's baseline,
    so dropping them after computing advantages leaves the other members' advantages unchanged.
    """
    return [i for i, r in enumerate(rewards) if r is None or not math.isfinite(r)]

