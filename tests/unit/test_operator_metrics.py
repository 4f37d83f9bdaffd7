"""The operator's run gauges (rlrun_operator.metrics): phase counts as runs move, finish and go."""

from __future__ import annotations

from rlrun_api import constants
from rlrun_operator import metrics
from rlrun_operator.status import PHASE_FAILED, PHASE_INITIALIZING, PHASE_RUNNING, PHASE_SUCCEEDED


def runs_in(phase: str) -> float:
    value = metrics.REGISTRY.get_sample_value(constants.OPERATOR_METRIC_RUNS, {"phase": phase})
    assert value is not None, f"no series for phase {phase}"
    return value


def test_phase_gauge_counts_each_run_once_as_it_moves_and_is_forgotten() -> None:
    before = {p: runs_in(p) for p in metrics.PHASES}  # every phase has a series from the start
    metrics.set_run_phase("ns-m", "a", PHASE_INITIALIZING)
    metrics.set_run_phase("ns-m", "b", PHASE_INITIALIZING)
    metrics.set_run_phase("ns-m", "a", PHASE_RUNNING)
    metrics.set_run_phase("ns-m", "a", PHASE_RUNNING)  # a repeat changes nothing
    assert runs_in(PHASE_INITIALIZING) - before[PHASE_INITIALIZING] == 1
    assert runs_in(PHASE_RUNNING) - before[PHASE_RUNNING] == 1
    metrics.set_run_phase("ns-m", "b", PHASE_FAILED)
    metrics.forget_run("ns-m", "a")
    metrics.forget_run("ns-m", "gone-already")  # unknown: no change
    assert {p: runs_in(p) - before[p] for p in metrics.PHASES} == {
        p: (1 if p == PHASE_FAILED else 0) for p in metrics.PHASES}
    metrics.forget_run("ns-m", "b")
    assert {p: runs_in(p) for p in metrics.PHASES} == before
    assert runs_in(PHASE_SUCCEEDED) == before[PHASE_SUCCEEDED]
