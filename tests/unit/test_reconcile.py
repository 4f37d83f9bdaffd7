"""Pure decisions of the reconcile module: what the status timer does after a refresh; the operator config."""

from __future__ import annotations

import pytest

from rlrun_api import constants
from rlrun_operator.config import OperatorConfig
from rlrun_operator.reconcile import RunState, StatusChange, get_invalid, plan_after_refresh


def stored_run(storage: dict, uid: str = "u-1", generation: int = 1) -> dict:
    """A minimal RLRun as the API server stores it (uid, generation), with ``storage`` as its spec.storage."""
    return {"apiVersion": constants.API_VERSION, "kind": constants.KIND,
            "metadata": {"name": "r", "namespace": "n", "uid": uid, "generation": generation},
            "spec": {"model": {"name": constants.TINY_MODEL_NAME},
                     "environment": {"type": "builtin", "name": constants.BUILTIN_ENVIRONMENTS[0]},
                     "storage": storage}}


def test_a_claim_name_run_stored_with_the_former_size_default_stays_valid():
    """Stored under the CRD that defaulted storage.size, a claimName run carries size 100Gi that its user
    never wrote: the operator must not turn it InvalidSpec after the upgrade; any other size is refused."""
    assert get_invalid(stored_run({"claimName": "data", "size": constants.DEFAULT_STORAGE_SIZE})) == []
    [error] = get_invalid(stored_run({"claimName": "data", "size": "10Gi"}, uid="u-2"))
    assert error.startswith("spec.storage.size: ") and "drop it when storage.claimName" in error
    assert get_invalid(stored_run({"size": "10Gi"}, uid="u-3")) == []


def test_validation_is_remembered_per_uid_and_generation_only():
    run_1 = stored_run({"claimName": "data", "size": "10Gi"}, uid="u-4")
    assert get_invalid(run_1) != []
    fixed = stored_run({"claimName": "data"}, uid="u-4", generation=2)  # the spec change bumps generation
    assert get_invalid(fixed) == []
    other = stored_run({"claimName": "data", "size": "10Gi"}, uid="u-5")  # another run, same spec
    assert get_invalid(other) == get_invalid(run_1) != []
    no_uid = stored_run({"claimName": "data"}, uid=None)
    assert get_invalid(no_uid) == []
    no_uid["spec"]["storage"]["size"] = "1Gi"
    assert get_invalid(no_uid) != []  # without uid nothing is remembered


def run(generation: int) -> dict:
    return {"metadata": {"name": "r", "namespace": "n", "generation": generation}}


@pytest.mark.parametrize("old, new, missing, generation, reconciled, expected", [
    ("Running", "Succeeded", (), 1, 1, "finish"),
    ("Running", "Failed", ("Deployment/r-router",), 1, 1, "finish"),   # finishing wins over drift
    ("Succeeded", "Succeeded", (), 1, 1, None),                         # already handled once
    (None, "Failed", (), 1, 1, "finish"),
    ("Running", "Succeeded", (), 2, 1, None),                           # spec change pending: the update finishes it
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
