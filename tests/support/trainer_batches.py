"""Synthetic rollout batches for trainer runs without an orchestrator (deterministic per step)."""

from __future__ import annotations

import math
import random

from rlrun_runtime.storage import RunStorage, atomic_write_json
from tiny_qwen3 import VOCAB


def write_batch(storage: RunStorage, step: int, groups: int = 2, rollouts_per_prompt: int = 4,
                empty: bool = False) -> None:
    """Write rollouts/step-N as the orchestrator would: ``groups`` x ``rollouts_per_prompt`` samples.

    Prompts of 4 random tokens, completions of 1-8 random tokens with inference logprobs near
    -log(VOCAB) (what a near-uniform random model gives), rewards k/(n-1) and advantages centred on 0 within
    each group, stamped policy version step - 1. ``empty``: a batch whose every group was dropped (no signal).
    """
    rng = random.Random(step)
    samples = []
    for group in range(groups):
        for k in range(rollouts_per_prompt):
            completion = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 8))]
            reward = k / (rollouts_per_prompt - 1)
            samples.append({
                "prompt_ids": [rng.randrange(2, VOCAB) for _ in range(4)], "completion_ids": completion,
                "inference_logprobs": [-math.log(VOCAB) + rng.uniform(-0.3, 0.3) for _ in completion],
                "reward": reward, "advantage": reward - 0.5, "policy_version": step - 1, "group": group,
            })
    batch = {"step": step, "policy_versions": [step - 1], "dropped_stale_groups": step % 2, "samples": samples}
    if empty:
        batch.update(samples=[], reward_mean=1.0, dropped_zero_advantage_groups=groups)
    atomic_write_json(storage.rollout_batch(step), batch)
