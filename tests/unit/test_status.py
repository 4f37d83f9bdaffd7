"""Pure parts of the operator: status from children and metrics, create-or-patch planning, metric parsing.

Children come from the real renderer (examples/rlrun-tiny.yaml, through tests/support/run_objects.py); JSON
patches are applied with the `jsonpatch` library, as an API server would.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from rlrun_api import constants
from rlrun_operator.apply import get_spec_hash, plan_child, plan_prune
from rlrun_operator.observe import get_orchestrator_failure, get_pod_targets, get_progress
from rlrun_operator.render import render
from rlrun_operator.status import Progress, get_status, get_status_patch
from run_objects import LATER, NOW, cond, make_run, workloads


def child(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def test_pending_without_children_then_initializing_then_running_and_ready() -> None:
    run = make_run(disaggregated=True)
    pending = get_status(run, [], None, NOW, reconciled_generation=None)
    assert pending["phase"] == "Pending"
    assert "startTime" not in pending and "observedGeneration" not in pending
    initializing = get_status(run, workloads(run, ready=False), None, NOW, reconciled_generation=1)
    assert initializing["phase"] == "Initializing"
    assert initializing["replicas"]["prefill"] == {"desired": 1, "ready": 0, "updated": 0}
    assert initializing["replicas"]["decode"] == {"desired": 2, "ready": 0, "updated": 0}
    assert cond(initializing, "Ready")["status"] == "False"
    assert cond(initializing, "Progressing")["reason"] == "RollingOut"
    run["status"] = initializing
    running = get_status(run, workloads(run, ready=True), Progress(step=7, policy_version=6, last_reward=0.25),
                         LATER, reconciled_generation=1)
    assert running["phase"] == "Running"
    assert (running["step"], running["policyVersion"], running["lastReward"]) == (7, 6, 0.25)
    assert cond(running, "Ready") | {"lastTransitionTime": None} == {
        "type": "Ready", "status": "True", "reason": "AllRolesReady", "observedGeneration": 1,
        "message": "every role runs the current generation", "lastTransitionTime": None}
    assert cond(running, "Ready")["lastTransitionTime"] == LATER
    assert cond(running, "Degraded")["lastTransitionTime"] == NOW  # status unchanged: time kept
    assert running["startTime"] == NOW


def test_ready_needs_the_current_generation_everywhere() -> None:
    run = make_run(generation=2)
    # Children all ready, but the last reconcile applied generation 1.
    stale = get_status(run, workloads(run, ready=True), None, NOW, reconciled_generation=1)
    assert cond(stale, "Ready")["reason"] == "ReconcilePending"
    # Applied, but one Deployment's controller has not observed its new generation yet.
    objs = workloads(run, ready=True)
    router = next(o for o in objs if o["metadata"]["name"] == "r-router")
    router["metadata"]["generation"] = 2
    lagging = get_status(run, objs, None, NOW, reconciled_generation=2)
    assert lagging["replicas"]["router"] == {"desired": 1, "ready": 1, "updated": 0}
    assert cond(lagging, "RouterReady")["status"] == "False"
    assert cond(lagging, "Ready")["status"] == "False"
    assert cond(get_status(run, workloads(run, ready=True), None, NOW, 2), "Ready")["status"] == "True"


def test_running_run_losing_a_pod_is_degraded_not_initializing() -> None:
    run = make_run()
    run["status"] = get_status(run, workloads(run, ready=True), None, NOW, reconciled_generation=1)
    objs = workloads(run, ready=True)
    next(o for o in objs if o["metadata"]["name"] == "r-inference")["status"]["readyReplicas"] = 0
    status = get_status(run, objs, None, LATER, reconciled_generation=1)
    assert status["phase"] == "Running"
    assert cond(status, "Degraded")["status"] == "True"
    assert cond(status, "Degraded")["reason"] == "ReplicasUnavailable"
    assert "inference" in cond(status, "Degraded")["message"]


@pytest.mark.parametrize("job_status,phase,reason", [
    ({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}, "Succeeded", "Succeeded"),
    ({"failed": 4, "conditions": [{"type": "Failed", "status": "True"}]}, "Failed", "Failed"),
])
def test_job_completion_decides_success_or_failure(job_status: dict, phase: str, reason: str) -> None:
    run = make_run()
    run["status"] = {"step": 40, "lastReward": 0.9, "startTime": NOW}
    status = get_status(run, workloads(run, ready=True, job=job_status), None, LATER, reconciled_generation=1)
    assert status["phase"] == phase
    assert status["completionTime"] == LATER
    assert (status["step"], status["lastReward"]) == (40, 0.9)  # kept: the orchestrator pod is gone
    assert cond(status, "Ready")["reason"] == reason
    assert cond(status, "Degraded")["status"] == ("True" if phase == "Failed" else "False")


def orchestrator_pod(name: str, **terminated: Any) -> dict[str, Any]:
    """An orchestrator pod (as the kubelet reports it) whose container restarted after ``terminated``."""
    return {"metadata": {"name": name, "labels": {constants.LABEL_COMPONENT: constants.COMPONENT_ORCHESTRATOR}},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "orchestrator",
                                                                  "lastState": {"terminated": terminated}}]}}


def test_a_failed_orchestrators_termination_message_reaches_the_degraded_condition() -> None:
    why = ("3 consecutive batches without a trainable sample (steps 1..3, algorithm.maxEmptyBatches 3); "
           "environment python/bad:env (seed 0): the scorer raised for 64 of 64 rollouts")
    pods = [orchestrator_pod("a", exitCode=3, message="older", finishedAt="2026-12-01T10:00:00Z"),
            orchestrator_pod("b", exitCode=3, message=why, finishedAt="2026-12-01T10:05:00Z"),
            orchestrator_pod("c", exitCode=0, message="clean exit", finishedAt="2026-12-01T10:09:00Z"),
            {"metadata": {"labels": {constants.LABEL_COMPONENT: "trainer"}},
             "status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "message": "not ours",
                                                                        "finishedAt": "2026-12-01T11:00:00Z"}}}]}}]
    assert get_orchestrator_failure(pods) == why
    assert get_orchestrator_failure(pods[2:]) is None
    run = make_run()
    failed = {"failed": 4, "conditions": [{"type": "Failed", "status": "True"}]}
    status = get_status(run, workloads(run, ready=True, job=failed), None, LATER, reconciled_generation=1,
                        failure=why)
    assert cond(status, "Degraded")["reason"] == "OrchestratorFailed"
    assert cond(status, "Degraded")["message"] == f"the orchestrator Job failed: {why}"
    restarted = get_status(run, workloads(run, ready=True, job={"failed": 1, "active": 1}), None, LATER,
                           reconciled_generation=1, failure=why)
    assert why in cond(restarted, "Degraded")["message"]


def test_suspended_and_invalid_spec() -> None:
    run = make_run(suspend=True)
    status = get_status(run, workloads(run, ready=False), None, NOW, reconciled_generation=1)
    assert status["phase"] == "Suspended"
    assert cond(status, "TrainerReady")["reason"] == "Suspended"
    invalid = get_status(make_run(), [], None, NOW, None, invalid=["spec.environment.name: unknown"])
    assert invalid["phase"] == "Pending"
    assert cond(invalid, "Ready") | {"lastTransitionTime": None} == {
        "type": "Ready", "status": "False", "reason": "InvalidSpec", "observedGeneration": 1,
        "message": "spec.environment.name: unknown", "lastTransitionTime": None}


def test_status_patch_is_empty_when_nothing_changed_and_deletes_what_went_away() -> None:
    run = make_run()
    first = get_status(run, workloads(run, ready=True), None, NOW, reconciled_generation=1)
    run["status"] = {**first, "scalingHistory": [{"prefill": 1}]}
    again = get_status(run, workloads(run, ready=True), None, LATER, reconciled_generation=1)
    assert get_status_patch(run["status"], again) == {}
    old = {"phase": "Succeeded", "completionTime": NOW, "replicas": {"inference": {"desired": 1}},
           "scalingHistory": []}
    new = {"phase": "Running", "replicas": {"prefill": {"desired": 1}}}
    assert get_status_patch(old, new) == {"phase": "Running", "completionTime": None,
                                          "replicas": {"inference": None, "prefill": {"desired": 1}}}


def live_copy(body: dict[str, Any], version: str = "1") -> dict[str, Any]:
    """What an API server stores for a POSTed body (plus server-set fields)."""
    obj = copy.deepcopy(body)
    obj["metadata"].update(resourceVersion=version, uid="child", generation=1)
    if obj["kind"] == "Service":
        obj["spec"].setdefault("clusterIP", "10.0.0.7")  # set by the server
    return obj


def apply_ops(live: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return jsonpatch.apply_patch(live, ops)


def test_no_op_plan_for_every_child_after_create() -> None:
    run = make_run(disaggregated=True)
    for manifest in render(run):
        create = plan_child(manifest, None, suspended=False)
        assert create.action == "create"
        assert create.body["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH] == get_spec_hash(manifest)
        assert plan_child(manifest, live_copy(create.body), suspended=False).action == "none"


def test_vllm_args_change_patches_inference_pools_only_and_never_sends_replicas() -> None:
    run = make_run(disaggregated=True)
    live = {(m["kind"], m["metadata"]["name"]): live_copy(plan_child(m, None, False).body) for m in render(run)}
    live[("Deployment", "r-decode")]["spec"]["replicas"] = 5  # scaled by someone after creation
    changed = copy.deepcopy(run)
    changed["spec"]["inference"]["vllmArgs"] = ["--max-num-seqs", "32"]
    plans = {(m["kind"], m["metadata"]["name"]): (m, plan_child(m, live[(m["kind"], m["metadata"]["name"])], False))
             for m in render(changed)}
    patched = sorted(key for key, (_, plan) in plans.items() if plan.action != "none")
    # The orchestrator does not read vllmArgs (its config hash leaves them out, render.config), so its Job
    # is kept, like trainer, router and Services.
    assert patched == [("ConfigMap", "r-config"), ("Deployment", "r-decode"), ("Deployment", "r-prefill")]
    assert plans[("Job", "r-orchestrator")][1].action == "none"
    manifest, plan = plans[("Deployment", "r-decode")]
    assert plan.ops[0] == {"op": "test", "path": "/metadata/resourceVersion", "value": "1"}
    assert not any(op["path"] == "/spec/replicas" for op in plan.ops)
    after = apply_ops(live[("Deployment", "r-decode")], plan.ops)
    assert after["spec"]["replicas"] == 5
    assert after["spec"]["template"] == manifest["spec"]["template"]
    assert plan_child(manifest, after, False).action == "none"
    svc_manifest, svc_plan = plans[("Service", "r-router")]
    assert svc_plan.action == "none"


def test_suspend_saves_live_replicas_and_resume_restores_them() -> None:
    run = make_run(disaggregated=True)
    decode = child(render(run), "Deployment", "r-decode")
    live = live_copy(plan_child(decode, None, False).body)
    live["spec"]["replicas"] = 4
    suspend = plan_child(decode, live, suspended=True)
    suspended = apply_ops(live, suspend.ops)
    assert suspended["spec"]["replicas"] == 0
    assert suspended["metadata"]["annotations"][constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND] == "4"
    assert plan_child(decode, suspended, suspended=True).action == "none"
    resumed = apply_ops(suspended, plan_child(decode, suspended, suspended=False).ops)
    assert resumed["spec"]["replicas"] == 4
    assert constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND not in resumed["metadata"]["annotations"]
    assert plan_child(decode, resumed, suspended=False).action == "none"


def test_job_template_change_replaces_the_job_and_suspend_is_patched_in_place() -> None:
    run = make_run()
    job = next(m for m in render(run) if m["kind"] == "Job")
    live = live_copy(plan_child(job, None, False).body)
    suspended_job = next(m for m in render(make_run(suspend=True)) if m["kind"] == "Job")
    plan = plan_child(suspended_job, live, suspended=True)
    assert plan.action == "patch"
    assert plan.ops[1:] == [{"op": "add", "path": "/spec/suspend", "value": True}]
    changed = make_run()
    changed["spec"]["algorithm"]["maxSteps"] = 41
    new_job = next(m for m in render(changed) if m["kind"] == "Job")
    assert plan_child(new_job, live, suspended=False).action == "replace"


def test_foreign_labels_and_server_fields_survive_a_patch() -> None:
    run = make_run()
    svc = next(m for m in render(run) if m["kind"] == "Service" and m["metadata"]["name"] == "r-router")
    live = live_copy(plan_child(svc, None, False).body)
    live["metadata"]["labels"]["argocd.argoproj.io/instance"] = "app"
    live["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH] = "stale"
    after = apply_ops(live, plan_child(svc, live, False).ops)
    assert after["metadata"]["labels"]["argocd.argoproj.io/instance"] == "app"
    assert after["spec"]["clusterIP"] == "10.0.0.7"
    assert after["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH] == get_spec_hash(svc)


def test_prune_deletes_only_owned_children_no_longer_rendered_and_never_pvcs() -> None:
    owned = {"ownerReferences": [{"uid": "u-1", "controller": True}]}
    live = [
        {"kind": "Deployment", "metadata": {"name": "r-inference", **owned}},
        {"kind": "Deployment", "metadata": {"name": "r-prefill", **owned}},
        {"kind": "Deployment", "metadata": {"name": "r-other", "ownerReferences": [{"uid": "u-2", "controller": True}]}},
        {"kind": "PersistentVolumeClaim", "metadata": {"name": "r-old-storage", **owned}},
    ]
    desired = [{"kind": "Deployment", "metadata": {"name": "r-prefill"}}]
    assert plan_prune("u-1", desired, live) == [("Deployment", "r-inference")]


@settings(max_examples=40, deadline=None)
@given(replicas=st.integers(min_value=0, max_value=50), suspend_first=st.booleans(),
       args=st.lists(st.sampled_from(["--a", "--b", "1", "2"]), max_size=3))
def test_plans_converge_and_then_do_nothing(replicas: int, suspend_first: bool, args: list[str]) -> None:
    """Property: whatever the live replicas and spec change, applying one plan leaves nothing to do,
    and the replicas are either kept (running) or 0 (suspended)."""
    base = make_run(disaggregated=True)
    decode = child(render(base), "Deployment", "r-decode")
    live = live_copy(plan_child(decode, None, False).body)
    live["spec"]["replicas"] = replicas
    if suspend_first:
        live = apply_ops(live, plan_child(decode, live, True).ops)
    changed = copy.deepcopy(base)
    changed["spec"]["inference"]["vllmArgs"] = args
    target = child(render(changed), "Deployment", "r-decode")
    plan = plan_child(target, live, suspended=False)
    after = apply_ops(live, plan.ops) if plan.action == "patch" else live
    assert plan_child(target, after, suspended=False).action == "none"
    assert after["spec"]["replicas"] == replicas


def test_progress_and_targets_from_real_prometheus_text() -> None:
    registry = CollectorRegistry()
    Gauge(constants.METRIC_STEP, "s", registry=registry).set(12)
    Gauge(constants.METRIC_POLICY_VERSION, "v", registry=registry).set(11)
    Gauge(constants.METRIC_LAST_REWARD, "r", registry=registry).set(-0.5)
    Gauge(constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT, "w", registry=registry).set(1)
    Counter("unrelated_requests", "c", registry=registry).inc()
    progress = get_progress(generate_latest(registry).decode())
    assert progress == Progress(step=12, policy_version=11, last_reward=-0.5, weight_update_in_flight=True)
    assert get_progress("# nothing here\n") == Progress()
    pods = [
        {"metadata": {"labels": {constants.LABEL_COMPONENT: "orchestrator"}},
         "status": {"phase": "Running", "podIP": "10.1.0.5"}},
        {"metadata": {"labels": {constants.LABEL_COMPONENT: "decode"}}, "status": {"phase": "Running", "podIP": "10.1.0.6"}},
        {"metadata": {"labels": {constants.LABEL_COMPONENT: "decode"}}, "status": {"phase": "Pending"}},
    ]
    orchestrator, pools = get_pod_targets(pods)
    assert orchestrator == f"http://10.1.0.5:{constants.ORCHESTRATOR_METRICS_PORT}/metrics"
    assert pools == {"decode": [f"http://10.1.0.6:{constants.INFERENCE_PORT}/metrics"]}


def test_finished_run_stays_finished_when_its_job_is_removed() -> None:
    run = make_run()
    done = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
    run["status"] = get_status(run, workloads(run, ready=True, job=done), None, NOW, reconciled_generation=1)
    without_job = [o for o in workloads(run, ready=False) if o["kind"] != "Job"]
    status = get_status(run, without_job, None, LATER, reconciled_generation=1)
    assert status["phase"] == "Succeeded"
    assert status["completionTime"] == NOW
