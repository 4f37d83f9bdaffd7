"""Rollouts and batches (pure): completion requests, parsing vLLM's answers, and batch assembly.

Token ids and logprobs come from vLLM's completions API (``return_token_ids: true``, ``logprobs: 0`` = the
sampled token's logprob only) and are never re-tokenized from text. A choice whose logprobs are missing,
``None``, NaN or infinite, or do not match its token ids one to one, is a broken sample: it is dropped and
counted, never zeroed.

Batch file format: docs/runtime-contract.md ("Batch file"), plus ``reward_mean`` (over every scored,
non-stale rollout considered for the step, including zero-advantage groups; None when there was none),
``exact_match_rate`` (the share of those rollouts with the full reward 1.0), the
drop counters (``dropped_zero_advantage_groups``, ``dropped_small_groups``, ``dropped_nonfinite_rewards``,
``dropped_bad_logprob_samples``), ``generation_seconds``, ``gate_wait_seconds`` (time the batch waited for
newer weights: inference idle) and ``prompt_cursor`` (the next task index; used to resume). A batch may hold
fewer than ``batchSize`` samples, or none, when filtering kept removing groups (docs/orchestrator.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from rlrun_api import constants
from rlrun_runtime.advantages import group_advantages, nonfinite_reward_indices
from rlrun_runtime.staleness import is_stale

FULL_REWARD = 1.0  # the score of a completely right answer in every built-in environment


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion: the server's token ids, their logprobs (temperature applied) and its text."""

    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclasses.dataclass
class Group:
    """The ``rolloutsPerPrompt`` completions of one prompt, stamped with the policy version that sent them.

    Attributes:
        task_index: the environment's task index (the prompt cursor value it was drawn at).
        prompt_ids: the prompt's token ids as sent.
        prompt_text: the prompt as text (for the sample file only).
        policy_version: version loaded on every engine when the requests were sent.
        completions: the valid completions (broken ones already removed).
        rewards: one reward per completion (NaN when the scorer failed).
        dropped_samples: completions removed for missing/NaN logprobs.
    """

    task_index: int
    prompt_ids: list[int]
    prompt_text: str
    policy_version: int
    completions: list[Completion]
    rewards: list[float]
    dropped_samples: int = 0


@dataclasses.dataclass
class AssembledBatch:
    """Result of :func:`assemble_batch`: the batch document, the groups not used, and what was dropped."""

    batch: dict[str, Any]
    leftover: list[Group]
    used_groups: list[Group]
    dropped_stale_groups: int
    dropped_zero_advantage_groups: int
    dropped_small_groups: int
    dropped_nonfinite_rewards: int
    rewards: list[float]

    @property
    def num_samples(self) -> int:
        return len(self.batch["samples"])


def get_completion_request(prompt_ids: Sequence[int], sampling: Mapping[str, Any], max_tokens: int,
                           policy_version: int, seed: int | None = None, n: int = 1) -> dict[str, Any]:
    """JSON body of one ``POST /v1/completions`` for ``n`` rollouts of one prompt (pure).

    Args:
        prompt_ids: prompt token ids (vLLM accepts a list of ints as ``prompt``).
        sampling: ``spec.algorithm.sampling`` (temperature, topP).
        max_tokens: completion length cap in tokens.
        policy_version: salts the prefix cache (``cache_salt = "policy-<version>"``) so that KV computed
            with other weights is never reused.
        seed: per-request sampling seed, or None. With ``n > 1`` vLLM gives choice ``i`` the seed
            ``seed + i`` (``vllm/v1/engine/parallel_sampling.py``), so the choices differ.
        n: completions to sample (``rolloutsPerPrompt`` for a group). vLLM 0.32 fans them out into n
            engine requests; each choice carries its own ``token_ids`` and ``logprobs``, and choice ``i``
            equals an ``n: 1`` request with seed ``seed + i`` (measured, tests/flow/test_orchestrator.py).
            The prompt's full KV blocks are shared through the prefix cache; a prompt shorter than one
            block (the tiny example's) is prefilled per choice.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    body: dict[str, Any] = {
        "model": constants.SERVED_MODEL_NAME,
        "prompt": list(prompt_ids),
        "n": int(n),
        "max_tokens": int(max_tokens),
        "temperature": float(sampling["temperature"]),
        "top_p": float(sampling["topP"]),
        "logprobs": 0,
        "return_token_ids": True,
        "cache_salt": f"policy-{policy_version}",
        "skip_special_tokens": True,
    }
    if seed is not None:
        body["seed"] = int(seed)
    return body


def parse_completion_choice(choice: Mapping[str, Any]) -> Completion | None:
    """A :class:`Completion` from one choice of a completions response, or None when it is broken.

    Broken: no generated token, missing/None/NaN/infinite logprob, or not as many logprobs as token ids.

    Raises:
        ValueError: the choice has no ``token_ids`` at all (the server ignored ``return_token_ids``;
            a vLLM older than the one rlrun pins).
    """
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise ValueError("completion choice has no token_ids: the server must honour return_token_ids (vLLM >= 0.10)")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not token_ids or not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        return None
    if any(lp is None or not isinstance(lp, (int, float)) or not math.isfinite(lp) for lp in logprobs):
        return None
    return Completion(token_ids=[int(t) for t in token_ids], logprobs=[float(x) for x in logprobs],
                      text=str(choice.get("text") or ""))


def get_exact_match_rate(rewards: Sequence[float]) -> float | None:
    """Fraction of ``rewards`` that reach the full score ``FULL_REWARD`` (None for no reward).

    Every built-in task scores in [0, 1] with 1.0 only for a completely right answer (for reverse-words: the
    exact reversal), so this is the exact-match rate; partial credit does not count.
    """
    if not rewards:
        return None
    return sum(1 for r in rewards if r >= FULL_REWARD) / len(rewards)


MIN_SIGNAL_RATE = 0.25  # over-generate at most 4x what the batch still needs


def plan_group_count(missing_samples: int, group_size: int, signal_rate: float) -> int:
    """Groups to generate in one round so that the batch most likely fills in that round (pure).

    Zero-advantage groups (every completion right, or every one equally wrong) are dropped at assembly,
    so generating only ``ceil(missing / group_size)`` groups needs another round for each drop; each round
    costs a whole generation's latency. With ``signal_rate`` the share of groups kept so far (1.0 before
    any was seen), this asks for ``ceil(missing / group_size / max(signal_rate, MIN_SIGNAL_RATE))``. Groups
    that do not fit stay in the leftover for the next step (still bounded by ``maxOffPolicySteps``).

    Raises:
        ValueError: ``group_size < 1``.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if missing_samples <= 0:
        return 0
    rate = min(1.0, max(MIN_SIGNAL_RATE, signal_rate))
    return math.ceil(missing_samples / group_size / rate - 1e-9)


def assemble_batch(step: int, groups: Sequence[Group], *, batch_size: int, max_off_policy_steps: int,
                   std_normalize: bool = False) -> AssembledBatch:
    """Build batch ``step`` from ``groups`` (in order), as many whole groups as fit in ``batch_size`` samples.

    For each group, in order: staleness > ``max_off_policy_steps`` -> dropped (stale, see
    :mod:`rlrun_runtime.staleness`); group-baseline advantages over its completions
    (:func:`rlrun_runtime.advantages.group_advantages`, ``std_normalize`` per
    ``spec.algorithm.advantageStdNormalization``); samples with a non-finite reward are dropped (their
    advantage is 0 and they are outside the baseline); fewer than 2 remaining -> dropped (small);
    every advantage 0 -> dropped (zero-advantage: no signal, and it would dilute the loss normaliser).
    A group that would overflow ``batch_size`` stays in ``leftover`` for the next step, with the groups
    not looked at.

    Returns:
        :class:`AssembledBatch` whose ``batch`` has the contract's keys (``step``, ``policy_versions``,
        ``dropped_stale_groups``, ``samples``) plus ``reward_mean`` and the other drop counters.
    """
    samples: list[dict[str, Any]] = []
    used: list[Group] = []
    leftover: list[Group] = []
    stale = zero = small = nonfinite = 0
    rewards_seen: list[float] = []
    for position, group in enumerate(groups):
        if len(samples) >= batch_size:
            leftover.extend(groups[position:])
            break
        if is_stale(step, group.policy_version, max_off_policy_steps):
            stale += 1
            continue
        rewards = list(group.rewards)
        bad = set(nonfinite_reward_indices(rewards))
        keep = [i for i in range(len(rewards)) if i not in bad]
        if len(keep) < 2:
            nonfinite += len(bad)
            small += 1
            continue
        if len(samples) + len(keep) > batch_size:
            leftover.append(group)
            continue
        nonfinite += len(bad)
        advantages = group_advantages(rewards, len(rewards), std_normalize=std_normalize)
        rewards_seen.extend(rewards[i] for i in keep)
        if all(advantages[i] == 0.0 for i in keep):
            zero += 1
            continue
        used.append(group)
        for i in keep:
            completion = group.completions[i]
            samples.append({
                "prompt_ids": list(group.prompt_ids),
                "completion_ids": list(completion.token_ids),
                "inference_logprobs": list(completion.logprobs),
                "reward": rewards[i],
                "advantage": advantages[i],
                "policy_version": group.policy_version,
                "group": group.task_index,
            })
    batch = {
        "step": step,
        "policy_versions": sorted({g.policy_version for g in used}),
        "dropped_stale_groups": stale,
        "dropped_zero_advantage_groups": zero,
        "dropped_small_groups": small,
        "dropped_nonfinite_rewards": nonfinite,
        "reward_mean": (math.fsum(rewards_seen) / len(rewards_seen)) if rewards_seen else None,
        "exact_match_rate": get_exact_match_rate(rewards_seen),
        "samples": samples,
    }
    return AssembledBatch(batch, leftover, used, stale, zero, small, nonfinite, rewards_seen)
