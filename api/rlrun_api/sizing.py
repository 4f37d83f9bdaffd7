"""Prefill/decode pool sizing from a P:D ratio and a replica budget (pure)."""

from __future__ import annotations

from dataclasses import dataclass


class SizingError(ValueError):
    """The ratio or the budget cannot give a disaggregated split; the message names the field and the fix."""


@dataclass(frozen=True)
class PDSize:
    """Replica counts of the two pools. Invariant: prefill >= 1, decode >= 1, prefill + decode == budget."""

    prefill: int
    decode: int


def parse_ratio(ratio: str) -> tuple[int, int]:
    """Parse a "P:D" ratio such as "1:2" into (1, 2).

    Raises SizingError (naming spec.inference.disaggregation.ratio) when the text is not two positive
    integers separated by a colon.
    """
    parts = ratio.split(":") if isinstance(ratio, str) else []
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SizingError(
            f"spec.inference.disaggregation.ratio: {ratio!r} is not a ratio 'P:D' of two positive integers; "
            "write it like \"1:2\" (one prefill replica per two decode replicas)"
        )
    return int(parts[0]), int(parts[1])


def size_pd(ratio: str, replicas: int) -> PDSize:
    """Split ``replicas`` inference pods into prefill and decode pools as close to ``ratio`` as possible.

    Rule: among all splits with at least one pod of each role and exactly ``replicas`` pods in total,
    choose the prefill count p minimising |p / replicas - P / (P + D)| (compared exactly, in integers:
    |p * (P + D) - replicas * P|). A tie goes to the split with fewer prefill pods, because RL rollouts are
    decode-heavy (long completions from short prompts). Examples: 6 at "1:2" -> 2 prefill, 4 decode;
    2 at anything -> 1 and 1; 3 at "1:1" -> 1 prefill, 2 decode.

    Args:
        ratio: "P:D", two positive integers.
        replicas: total prefill + decode pods (spec.inference.disaggregation.replicas).

    Returns:
        PDSize with prefill + decode == replicas and both >= 1.

    Raises:
        SizingError: ratio malformed, or replicas < 2 (a disaggregated run needs one pod of each role).
    """
    p_part, d_part = parse_ratio(ratio)
    if not isinstance(replicas, int) or replicas < 2:
        raise SizingError(
            f"spec.inference.disaggregation.replicas: {replicas!r} cannot hold one prefill and one decode "
            "replica; set it to 2 or more, or set spec.inference.disaggregation.enabled: false"
        )
    total = p_part + d_part
    # |p * total - replicas * P| is convex in p with its minimum at replicas * P / total: the best split in
    # [1, replicas - 1] is one of the two integers around it, clamped (O(1): replicas may be any size).
    q = replicas * p_part // total
    candidates = {min(max(p, 1), replicas - 1) for p in (q, q + 1)}
    best = min(candidates, key=lambda p: (abs(p * total - replicas * p_part), p))
    return PDSize(prefill=best, decode=replicas - best)
