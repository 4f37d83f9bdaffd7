"""P:D sizing (sizing.size_pd): table cases, errors, and properties checked with hypothesis."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrun_api.sizing import PDSize, SizingError, parse_ratio, size_pd


@pytest.mark.parametrize("ratio,replicas,expected", [
    ("1:2", 6, (2, 4)),      # the example
    ("1:1", 2, (1, 1)),
    ("1:1", 3, (1, 2)),      # a tie goes to fewer prefill replicas (rollouts are decode-heavy)
    ("1:1", 4, (2, 2)),
    ("2:1", 3, (2, 1)),
    ("3:1", 4, (3, 1)),
    ("2:3", 10, (4, 6)),
    ("1:100", 2, (1, 1)),    # never 0 of a role, however lopsided the ratio
    ("100:1", 5, (4, 1)),
    ("1:3", 7, (2, 5)),      # 7/4 = 1.75 prefill: 2 is closer than 1
])
def test_table(ratio, replicas, expected) -> None:
    assert size_pd(ratio, replicas) == PDSize(*expected)


@pytest.mark.parametrize("replicas", [1, 0, -3])
def test_fewer_than_two_replicas_is_an_error_naming_the_field_and_fix(replicas) -> None:
    with pytest.raises(SizingError) as info:
        size_pd("1:1", replicas)
    message = str(info.value)
    assert message.startswith("spec.inference.disaggregation.replicas:")
    assert "set it to 2 or more" in message


@pytest.mark.parametrize("ratio", ["1-2", "0:1", "1:0", "a:b", "1:2:3", "", ":", " 1:2", "-1:2"])
def test_malformed_ratio_is_an_error_naming_the_field(ratio) -> None:
    with pytest.raises(SizingError, match=r"^spec\.inference\.disaggregation\.ratio: .*write it like \"1:2\""):
        size_pd(ratio, 4)


def test_parse_ratio() -> None:
    assert parse_ratio("12:345") == (12, 345)


ratios = st.tuples(st.integers(1, 999), st.integers(1, 999))
budgets = st.integers(2, 400)


@settings(max_examples=400, deadline=None)
@given(ratio=ratios, replicas=budgets)
def test_never_over_budget_and_both_roles_present(ratio, replicas) -> None:
    size = size_pd(f"{ratio[0]}:{ratio[1]}", replicas)
    assert size.prefill >= 1 and size.decode >= 1
    assert size.prefill + size.decode == replicas


@settings(max_examples=400, deadline=None)
@given(ratio=ratios, replicas=budgets)
def test_ratio_error_is_minimal_versus_brute_force(ratio, replicas) -> None:
    p, d = ratio
    target = Fraction(p, p + d)  # the prefill share the ratio asks for

    def error(prefill: int) -> Fraction:
        return abs(Fraction(prefill, replicas) - target)

    best = min(error(k) for k in range(1, replicas))
    size = size_pd(f"{p}:{d}", replicas)
    assert error(size.prefill) == best
    # among equally good splits, the one with the fewest prefill replicas
    assert size.prefill == min(k for k in range(1, replicas) if error(k) == best)


@settings(max_examples=200, deadline=None)
@given(ratio=ratios, replicas=budgets)
def test_deterministic_and_scale_invariant(ratio, replicas) -> None:
    text = f"{ratio[0]}:{ratio[1]}"
    assert size_pd(text, replicas) == size_pd(text, replicas)
    # 2:4 means the same as 1:2
    k = 2 if max(ratio) * 2 <= 999 else 1
    assert size_pd(f"{ratio[0] * k}:{ratio[1] * k}", replicas) == size_pd(text, replicas)


def test_any_budget_is_sized_at_once() -> None:
    """The split is computed, not searched: a budget of 2**40 (the schema sets no maximum) is instant."""
    size = size_pd("1:2", 2 ** 40 + 1)
    assert (size.prefill, size.decode) == (366503875926, 733007751851)  # (2**40 + 1) / 3 = ...925.67
    assert size_pd("999:1", 2 ** 40).decode == size_pd("1:999", 2 ** 40).prefill == 1099511628  # 2**40 / 1000
