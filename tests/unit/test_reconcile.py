"""Pure decisions of the reconcile module: what the status timer does after a refresh; the operator config."""

from __future__ import annotations

import pytest

from rlrun_api import constants
from rlrun_operator.config import OperatorConfig
from rlrun_operator.reconcile import RunState, StatusChange, plan_after_refresh


def run(generation: int) -> dict:
    return {"metadata": {"name": "r", "namespace": "n", "generation": generation}}


@pytest.mark.parametrize("old, new, missing, generation, reconciled, expected", [
    ("Running", "Succeeded", (), 1, 1, "finish"),
    ("Running", "Failed", ("Deployment/r-router",), 1, 1, "finish"),   # finishing wins over drift
    ("Succeeded", "Succeeded", (), 1, 1, None),                         # already handled once
    (None, "Failed", (), 1, 1, "finish"),
    ("Running", "Running", ("Deployment/r-router",), 2, 2, "drift"),
    ("Running", "Running", ("Deployment/r-router",), 3, 2, None),       # a spec change is pending
    ("Running", "Running", ("Deployment/r-router",), 1, None, None),    # never reconciled by this process
    ("Running", "Running", (), 1, 1, None),
])
def test_plan_after_refresh(old, new, missing, generation, reconciled, expected):
    change = StatusChange(patch={}, old_phase=old, new_phase=new, missing=missing)
    assert plan_after_refresh(run(generation), change, reconciled) == expected


def test_run_state_falls_back_to_the_observed_generation():
    state = RunState()
    assert state.get_reconciled_generation({"status": {"observedGeneration": 4}}) == 4
    state.reconciled_generation = 5
    assert state.get_reconciled_generation({"status": {"observedGeneration": 4}}) == 5


def test_operator_config_from_env_and_overrides():
    assert OperatorConfig.from_env({}).operator_namespace == constants.DEFAULT_OPERATOR_NAMESPACE
    env = {constants.ENV_OPERATOR_NAMESPACE: "ops"}
    assert OperatorConfig.from_env(env).operator_namespace == "ops"
    config = OperatorConfig.from_env(env, status_interval_s=0.5, operator_namespace=None)
    assert (config.operator_namespace, config.status_interval_s) == ("ops", 0.5)  # None overrides nothing
