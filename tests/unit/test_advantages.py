"""Group-baseline advantages: hand-computed values, degenerate groups, NaN rewards, properties."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrun_runtime.advantages import (
    STD_EPS,
    group_advantages,
    nonfinite_reward_indices,
)


def test_mean_baseline_by_hand():
    # group 1: mean 0.5 -> [0.5, -0.5, 0.5, -0.5]; group 2: mean 0.25 -> [-0.25, -0.25, -0.25, 0.75]
    adv = group_advantages([1, 0, 1, 0, 0, 0, 0, 1], group_size=4)
    assert adv == pytest.approx([0.5, -0.5, 0.5, -0.5, -0.25, -0.25, -0.25, 0.75], abs=1e-12)


def test_std_normalised_by_hand():
    # rewards [1, 0, 0, 0]: mean 0.25, population std sqrt(0.1875) = 0.4330127
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], group_size=4, std_normalize=True)
    std = math.sqrt(0.1875)
    assert adv == pytest.approx([0.75 / (std + STD_EPS)] + [-0.25 / (std + STD_EPS)] * 3, rel=1e-12)
    assert adv[0] == pytest.approx(1.7316, abs=1e-3)


@pytest.mark.parametrize("std_normalize", [False, True])
def test_all_equal_and_float_residue_give_exact_zero(std_normalize):
    assert 0.1 + 0.2 != 0.3  # the residue this test is about
    rewards = [0.1 + 0.2, 0.3, 0.3, 0.3, 1.0, 1.0, 1.0, 1.0]
    adv = group_advantages(rewards, group_size=4, std_normalize=std_normalize)
    assert adv == [0.0] * 8  # exactly: rollouts.assemble drops such groups (no learning signal)


def test_nan_reward_is_excluded_from_baseline_and_reported():
    rewards = [1.0, float("nan"), 0.0, 0.0, 0.5, 0.5, float("inf"), 0.5]
    adv = group_advantages(rewards, group_size=4)
    # group 1 baseline over the finite 1, 0, 0 = 1/3
    assert adv[:4] == pytest.approx([2 / 3, 0.0, -1 / 3, -1 / 3])
    # group 2: the finite rewards are equal -> all zero
    assert adv[4:] == [0.0] * 4
    assert all(math.isfinite(a) for a in adv)
    assert nonfinite_reward_indices(rewards) == [1, 6]


def test_group_with_one_finite_reward_is_zero():
    assert group_advantages([float("nan"), 3.0], group_size=2, std_normalize=True) == [0.0, 0.0]


def test_bad_group_size_raises():
    with pytest.raises(ValueError, match="whole groups of 4"):
        group_advantages([1.0, 0.0, 1.0], group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0], group_size=0)


rewards_st = st.floats(min_value=-10, max_value=10, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(group=st.lists(rewards_st, min_size=2, max_size=16), std_normalize=st.booleans())
def test_properties(group, std_normalize):
    n = len(group)
    adv = group_advantages(group, group_size=n, std_normalize=std_normalize)
    assert len(adv) == n
    assert all(math.isfinite(a) for a in adv)
    bound = math.sqrt(n - 1) if std_normalize else (max(group) - min(group))
    assert all(abs(a) <= bound + 1e-9 for a in adv)
    # centred: advantages sum to zero
    assert abs(math.fsum(adv)) <= 1e-9 * max(1.0, n * bound)
    # order preserving: a higher reward never gets a lower advantage
    for i in range(n):
        for j in range(n):
            if group[i] > group[j]:
                assert adv[i] >= adv[j]


@settings(max_examples=100, deadline=None)
@given(value=rewards_st, n=st.integers(2, 16), std_normalize=st.booleans(),
       noise=st.lists(st.floats(-1e-12, 1e-12), min_size=16, max_size=16))
def test_near_equal_groups_are_zero(value, n, std_normalize, noise):
    group = [value + noise[i] for i in range(n)]
    assert group_advantages(group, n, std_normalize) == [0.0] * n


@settings(max_examples=100, deadline=None)
@given(group=st.lists(st.one_of(rewards_st, st.just(float("nan"))), min_size=2, max_size=8))
def test_nan_never_leaks(group):
    adv = group_advantages(group, len(group), std_normalize=True)
    assert all(math.isfinite(a) for a in adv)
    for i in nonfinite_reward_indices(group):
        assert adv[i] == 0.0
