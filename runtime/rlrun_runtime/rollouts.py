"""Rollouts and batches (pure): completion requests, parsing vLLM's answers, and batch assembly.

Token ids and logprobs come from vLLM's completions API (``return_token_ids: true``, ``logprobs: 0`` = the
sampled token's logprob only) and are never re-tokenized from text. A choice without ``token_ids``, with an
empty list or with an entry that is not a non-negative int (e.g. ``null``) is a broken sample
(``BAD_TOKEN_IDS``); so is one whose logprobs are missing, ``None``, NaN or infinite, or do not match its
token ids one to one (``BAD_LOGPROBS``). Broken samples are dropped and counted, never zeroed or repaired.
vLLM's ``finish_reason`` is kept per completion: ``"length"`` marks one cut at ``max_tokens``, which
``spec.algorithm.truncation`` (``keep | zeroReward | mask``, :func:`assemble_batch`) decides about.

Batch file format: docs/runtime-contract.md ("Batch file"), plus ``reward_mean`` (over every scored,
non-stale rollout considered for the step, including zero-advantage groups; None when there was none),
``exact_match_rate`` (the share of those rollouts with the full reward 1.0), the
drop counters (``dropped_zero_advantage_groups``, ``dropped_small_groups``, ``dropped_nonfinite_rewards``,
``dropped_truncated_samples``; the orchestrator adds ``dropped_bad_logprob_samples``,
``dropped_bad_token_ids_samples``, ``dropped_long_prompts``), ``truncated_rollouts`` (completions with
finish_reason ``"length"`` among the groups considered), and from the orchestrator ``scorer_errors``,
``generated_rollouts``, ``empty_batch_streak``, ``generation_seconds``, ``gate_wait_seconds`` (time the batch
waited for newer weights: inference idle) and ``prompt_cursor`` (the next task index; used to resume). Each
sample carries its ``finish_reason``. A batch may hold fewer than ``batchSize`` samples, or none, when
filtering kept removing groups (docs/orchestrator.md); :func:`get_empty_batch_reason` says why it is empty.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from rlrun_api import constants
from rlrun_runtime.advantages import group_advantages, nonfinite_reward_indices
from rlrun_runtime.staleness import is_stale

FULL_REWARD = 1.0  # the score of a completely right answer in every built-in environment


BAD_TOKEN_IDS = "bad_token_ids"  # reasons a choice is broken (labels of rlrun_orchestrator_dropped_samples_total)
BAD_LOGPROBS = "bad_logprobs"


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion: the server's token ids, their logprobs (temperature applied), its text and
    vLLM's ``finish_reason`` (``"stop"``, ``"length"`` = cut at ``max_tokens``; None when the server sent none)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None

    @property
    def truncated(self) -> bool:
        """True when vLLM cut the completion at ``max_tokens`` (``finish_reason == "length"``)."""
        return self.finish_reason == constants.FINISH_REASON_LENGTH


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
        dropped_samples: completions removed for missing/NaN logprobs (``BAD_LOGPROBS``).
        dropped_bad_token_ids: completions removed for missing/null token ids (``BAD_TOKEN_IDS``).
        scorer_errors: completions whose ``env.score`` raised (their reward is NaN).
        last_scorer_error: ``"ExceptionType: message"`` of the last of those, or None.
    """

    task_index: int
    prompt_ids: list[int]
    prompt_text: str
    policy_version: int
    completions: list[Completion]
    rewards: list[float]
    dropped_samples: int = 0
    dropped_bad_token_ids: int = 0
    scorer_errors: int = 0
    last_scorer_error: str | None = None


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
    truncated_rollouts: int = 0
    dropped_truncated_samples: int = 0

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


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def get_choice_problem(choice: Mapping[str, Any]) -> str | None:
    """Why one choice of a completions response is broken, or None when it is a usable sample (pure).

    Returns:
        ``BAD_TOKEN_IDS``: ``token_ids`` missing (a server that ignored ``return_token_ids``), not a list,
        empty, or holding an entry that is not a non-negative int (``null``, a float, a string);
        ``BAD_LOGPROBS``: ``logprobs.token_logprobs`` missing, not a list, not one per token id, or holding
        a ``null``, NaN or infinite value; None otherwise.
    """
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(_is_token_id(t) for t in token_ids):
        return BAD_TOKEN_IDS
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        return BAD_LOGPROBS
    if any(lp is None or isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp)
           for lp in logprobs):
        return BAD_LOGPROBS
    return None


def parse_completion_choice(choice: Mapping[str, Any]) -> Completion | None:
    """A :class:`Completion` from one choice of a completions response, or None when it is broken
    (:func:`get_choice_problem` says why; the caller drops and counts it). Never raises for a malformed
    choice: one bad answer must not end the orchestrator."""
    if get_choice_problem(choice) is not None:
        return None
    finish_reason = choice.get("finish_reason")
    return Completion(token_ids=[int(t) for t in choice["token_ids"]],
                      logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                      text=str(choice.get("text") or ""),
                      finish_reason=str(finish_reason) if finish_reason is not None else None)


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


def apply_truncation_policy(rewards: Sequence[float], truncated: Sequence[bool], policy: str
                            ) -> tuple[list[float], list[bool]]:
    """Rewards for the group baseline and which samples go into the batch, per ``spec.algorithm.truncation``.

    Args:
        rewards: one reward per completion of a group (NaN for a failed scorer: left as it is, dropped later).
        truncated: one flag per completion, True when vLLM cut it at ``max_tokens`` (finish_reason "length").
        policy: ``keep`` (nothing changes), ``zeroReward`` (a truncated completion's finite reward becomes
            0.0 before the baseline; it is trained with it) or ``mask`` (rewards unchanged, so the truncated
            completion stays in the group baseline; it is left out of the batch: its tokens get no loss and
            do not count in the loss normaliser).

    Returns:
        ``(rewards, trained)``: the rewards the baseline uses and, per completion, whether it may be trained.

    Raises:
        ValueError: unknown policy, or ``rewards`` and ``truncated`` of different lengths.
    """
    if policy not in constants.TRUNCATION_POLICIES:
        raise ValueError(f"unknown truncation policy {policy!r}: use one of {', '.join(constants.TRUNCATION_POLICIES)}")
    if len(rewards) != len(truncated):
        raise ValueError(f"{len(rewards)} rewards but {len(truncated)} truncation flags")
    out = list(rewards)
    if policy == constants.TRUNCATION_ZERO_REWARD:
        out = [0.0 if cut and math.isfinite(r) else r for r, cut in zip(out, truncated)]
    trained = [not (cut and policy == constants.TRUNCATION_MASK) for cut in truncated]
    return out, trained


def assemble_batch(step: int, groups: Sequence[Group], *, batch_size: int, max_off_policy_steps: int,
                   std_normalize: bool = False, truncation: str = constants.DEFAULT_TRUNCATION) -> AssembledBatch:
    """Build batch ``step`` from ``groups`` (in order), as many whole groups as fit in ``batch_size`` samples.

    For each group, in order: staleness > ``max_off_policy_steps`` -> dropped (stale, see
    :mod:`rlrun_runtime.staleness`); the truncation policy (:func:`apply_truncation_policy`, ``truncation``
    per ``spec.algorithm.truncation``); group-baseline advantages over its completions
    (:func:`rlrun_runtime.advantages.group_advantages`, ``std_normalize`` per
    ``spec.algorithm.advantageStdNormalization``); samples with a non-finite reward are dropped (their
    advantage is 0 and they are outside the baseline); fewer than 2 remaining -> dropped (small);
    truncated samples under ``mask`` are left out (counted, ``dropped_truncated_samples``) after they served
    in the baseline; every advantage of the samples left 0 (or none left) -> dropped (zero-advantage: no
    signal, and it would dilute the loss normaliser). A group whose trained samples would overflow
    ``batch_size`` stays in ``leftover`` for the next step, with the groups not looked at.

    Returns:
        :class:`AssembledBatch` whose ``batch`` has the contract's keys (``step``, ``policy_versions``,
        ``dropped_stale_groups``, ``samples``, each sample with its ``finish_reason``) plus ``reward_mean``,
        ``exact_match_rate``, ``truncated_rollouts`` (truncated completions of the groups looked at, not
        stale, not left over) and the other drop counters.

    Raises:
        ValueError: unknown ``truncation``.
    """
    samples: list[dict[str, Any]] = []
    used: list[Group] = []
    leftover: list[Group] = []
    stale = zero = small = nonfinite = truncated_count = masked = 0
    rewards_seen: list[float] = []
    for position, group in enumerate(groups):
        if len(samples) >= batch_size:
            leftover.extend(groups[position:])
            break
        if is_stale(step, group.policy_version, max_off_policy_steps):
            stale += 1
            continue
        cut = [c.truncated for c in group.completions]
        rewards, trainable = apply_truncation_policy(group.rewards, cut, truncation)
        bad = set(nonfinite_reward_indices(rewards))
        keep = [i for i in range(len(rewards)) if i not in bad]
        if len(keep) < 2:
            nonfinite += len(bad)
            small += 1
            truncated_count += sum(cut)
            continue
        train = [i for i in keep if trainable[i]]
        if len(samples) + len(train) > batch_size:
            leftover.append(group)
            continue
        nonfinite += len(bad)
        truncated_count += sum(cut)
        masked += len(keep) - len(train)
        advantages = group_advantages(rewards, len(rewards), std_normalize=std_normalize)
        rewards_seen.extend(rewards[i] for i in keep)
        if all(advantages[i] == 0.0 for i in train):  # also when mask left nothing to train
            zero += 1
            continue
        used.append(group)
        for i in train:
            completion = group.completions[i]
            samples.append({
                "prompt_ids": list(group.prompt_ids),
                "completion_ids": list(completion.token_ids),
                "inference_logprobs": list(completion.logprobs),
                "reward": rewards[i],
                "advantage": advantages[i],
                "policy_version": group.policy_version,
                "group": group.task_index,
                "finish_reason": completion.finish_reason,
            })
    batch = {
        "step": step,
        "policy_versions": sorted({g.policy_version for g in used}),
        "dropped_stale_groups": stale,
        "dropped_zero_advantage_groups": zero,
        "dropped_small_groups": small,
        "dropped_nonfinite_rewards": nonfinite,
        "dropped_truncated_samples": masked,
        "truncated_rollouts": truncated_count,
        "reward_mean": (math.fsum(rewards_seen) / len(rewards_seen)) if rewards_seen else None,
        "exact_match_rate": get_exact_match_rate(rewards_seen),
        "samples": samples,
    }
    return AssembledBatch(batch, leftover, used, stale, zero, small, nonfinite, rewards_seen, truncated_count, masked)


def get_empty_batch_reason(batch: Mapping[str, Any]) -> str:
    """Why a batch has no sample, in words, from its counters (pure; for the orchestrator's failure message).

    Every cause with a non-zero count is named, largest count first, e.g. ``"the scorer raised for 32 of 32
    rollouts (last: ValueError: boom); 4 groups were dropped as too small (fewer than 2 finite rewards)"``.
    ``"no rollout was generated"`` when no counter explains it.
    """
    generated = int(batch.get("generated_rollouts") or 0)
    scorer = int(batch.get("scorer_errors") or 0)
    causes: list[tuple[int, str]] = []
    if scorer:
        last = batch.get("last_scorer_error")
        causes.append((scorer, f"the scorer raised for {scorer} of {generated} rollouts"
                               + (f" (last: {last})" if last else "")))
    if (other := int(batch.get("dropped_nonfinite_rewards") or 0) - scorer) > 0:
        causes.append((other, f"{other} rewards were NaN or infinite"))
    named = (
        ("dropped_zero_advantage_groups", "groups had zero advantage (every completion of the group got the "
                                          "same reward: no learning signal)"),
        ("dropped_small_groups", "groups were dropped as too small (fewer than 2 finite rewards)"),
        ("dropped_long_prompts", "prompts were too long (no room for a completion under model.maxModelLen)"),
        ("dropped_stale_groups", "groups were stale (staleness above maxOffPolicySteps)"),
        ("dropped_bad_token_ids_samples", "completions had missing or null token_ids"),
        ("dropped_bad_logprob_samples", "completions had missing, null or non-finite logprobs"),
        ("dropped_truncated_samples", "truncated completions were masked (algorithm.truncation: mask)"),
    )
    for key, words in named:
        if (count := int(batch.get(key) or 0)) > 0:
            causes.append((count, f"{count} {words}"))
    if not causes:
        return "no rollout was generated"
    causes.sort(key=lambda c: -c[0])
    return "; ".join(text for _, text in causes)
