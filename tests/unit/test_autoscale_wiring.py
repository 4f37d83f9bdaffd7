"""The operator's pure autoscaler steps: observations from pods and scrapes (observe.get_observations), a
Decision turned into writes (reconcile.plan_scaling), and when the autoscaler acts (get_autoscaling)."""

from __future__ import annotations

import copy

from rlrun_api import constants
from rlrun_operator import autoscale, observe, reconcile
from rlrun_operator.autoscale import Inputs, State

NOW = 1_800_000_000.0


def decision(prefill: int, decode: int, before: tuple[int, int] = (1, 1), action: str = "grow",
             code: str = "prefill-queue") -> autoscale.Decision:
    return autoscale.Decision(prefill=prefill, decode=decode, prefill_before=before[0], decode_before=before[1],
                              action=action, code=code, reason="why", inputs=Inputs(), state=State())


RUN = {"metadata": {"name": "r", "namespace": "ns"}, "status": {}}


def test_a_grow_patches_one_deployment_guarded_by_the_replicas_it_read_and_records_it() -> None:
    plan = reconcile.plan_scaling(RUN, decision(2, 1), NOW, dry_run=False)
    assert plan.patches == (("r-prefill", [{"op": "test", "path": "/spec/replicas", "value": 1},
                                           {"op": "replace", "path": "/spec/replicas", "value": 2}]),)
    (entry,) = plan.history
    assert (entry["prefill"], entry["prefillBefore"], entry["dryRun"], entry["time"]) == (2, 1, False,
                                                                                          "2027-01-15T08:00:00Z")
    assert [e[1] for e in plan.events] == [constants.EVENT_SCALED_PREFILL]


def test_a_move_patches_both_pools_and_a_hold_writes_nothing() -> None:
    plan = reconcile.plan_scaling(RUN, decision(2, 1, before=(1, 2), action="move"), NOW, dry_run=False)
    assert [name for name, _ in plan.patches] == ["r-prefill", "r-decode"]
    assert [e[1] for e in plan.events] == [constants.EVENT_SCALED_PREFILL, constants.EVENT_SCALED_DECODE]
    hold = reconcile.plan_scaling(RUN, decision(1, 1, action="hold", code="balanced"), NOW, dry_run=False)
    assert (hold.patches, hold.history, hold.events) == ((), None, ())


def test_dry_run_records_without_patching_and_not_again_while_the_decision_repeats() -> None:
    first = reconcile.plan_scaling(RUN, decision(2, 1), NOW, dry_run=True)
    assert first.patches == () and first.history[-1]["dryRun"] is True
    assert [e[1] for e in first.events] == [constants.EVENT_AUTOSCALER_DRY_RUN]
    recorded = {**RUN, "status": {"scalingHistory": first.history}}
    again = reconcile.plan_scaling(recorded, decision(2, 1), NOW + 30, dry_run=True)
    assert (again.history, again.events) == (None, ())
    other = reconcile.plan_scaling(recorded, decision(1, 2, action="grow", code="decode-queue"), NOW + 60, True)
    assert len(other.history) == 2


def test_history_is_bounded() -> None:
    full = {**RUN, "status": {"scalingHistory": [{"time": "2026-01-01T00:00:00Z", "n": i} for i in range(20)]}}
    plan = reconcile.plan_scaling(full, decision(2, 1), NOW, dry_run=False)
    assert len(plan.history) == autoscale.HISTORY_LIMIT and plan.history[0]["n"] == 1


def test_a_hand_edit_is_taken_as_the_current_value_and_said_in_an_event() -> None:
    plan = reconcile.plan_scaling(RUN, decision(3, 1, before=(3, 1), action="hold", code="balanced"), NOW,
                                  dry_run=False, known={"prefill": 2, "decode": 1})
    assert plan.patches == () and [e[1] for e in plan.events] == [constants.EVENT_REPLICAS_EDITED]


def deployment(pool: str, replicas: int, ready: int, observed: bool = True) -> dict:
    return {"kind": "Deployment", "metadata": {"name": f"r-{pool}", "generation": 2,
                                               "labels": {constants.LABEL_COMPONENT: pool}},
            "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready, "observedGeneration": 2 if observed else 1}}


def pod(name: str, pool: str, ip: str, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": {constants.LABEL_COMPONENT: pool}},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def url(ip: str, port: int = constants.INFERENCE_PORT) -> str:
    return f"http://{ip}:{port}/metrics"


def test_observations_from_pods_and_scrapes_with_unknowns_left_out() -> None:
    workloads = [deployment("prefill", 2, 2), deployment("decode", 2, 1, observed=False)]
    pods = [pod("p1", "prefill", "10.0.0.1"), pod("p2", "prefill", "10.0.0.2", ready=False),
            pod("d1", "decode", "10.0.0.3"), pod("d2", "decode", "10.0.0.4")]
    texts = {url("10.0.0.1"): "vllm:num_requests_waiting 7\nvllm:num_requests_running 3\n"
                              "vllm:kv_cache_usage_perc 0.5\n",
             url("10.0.0.2"): "vllm:num_requests_waiting 1\n",
             url("10.0.0.3"): 'vllm:num_requests_waiting 9\nvllm:num_requests_waiting_by_reason{reason="capacity"} 2\n'
                              'vllm:num_requests_waiting_by_reason{reason="deferred"} 7\n',
             url("10.0.0.4"): "not prometheus {{{\n",  # unparsable: no sample; 10.0.0.x unreachable likewise
             url("10.0.0.9", constants.ORCHESTRATOR_METRICS_PORT): f"{constants.METRIC_STEP} 3\n"}
    scrape = observe.Scrape(texts=texts, orchestrator_url=url("10.0.0.9", constants.ORCHESTRATOR_METRICS_PORT))
    obs = observe.get_observations(workloads, pods, scrape)
    assert (obs.prefill.desired, obs.prefill.ready) == (2, 2)
    assert (obs.decode.desired, obs.decode.ready) == (2, 0)  # the controller has not observed generation 2
    assert [(p.name, p.waiting, p.warming) for p in obs.prefill.pods] == [("p1", 7, False), ("p2", 1, True)]
    assert [(p.name, p.waiting) for p in obs.decode.pods] == [("d1", 2)]  # capacity, not deferred
    # The orchestrator's autoscaler counters are absent: zeros and no resume time, not an error.
    assert obs.loop == autoscale.LoopSample()
    assert observe.get_observations(workloads, pods, observe.Scrape()).loop is None


def autoscaled_run(**autoscaling) -> dict:
    return {"apiVersion": constants.API_VERSION, "kind": constants.KIND,
            "metadata": {"name": "r", "namespace": "ns", "uid": "u-" + str(sorted(autoscaling.items())),
                         "generation": 1},
            "spec": {"model": {"name": constants.TINY_MODEL_NAME},
                     "environment": {"type": "builtin", "name": constants.BUILTIN_ENVIRONMENTS[0]},
                     "inference": {"disaggregation": {"enabled": True, "ratio": "1:1", "replicas": 2}},
                     "autoscaling": {"enabled": True, **autoscaling}}, "status": {}}


def test_the_autoscaler_acts_only_on_a_live_applied_autoscaled_run() -> None:
    run = autoscaled_run()
    view = reconcile.get_autoscaling(run, 1, [])
    assert view is not None and view.scrape_interval_s == 15
    assert reconcile.get_autoscaling(run, None, []) is None  # spec change not applied yet
    assert reconcile.get_autoscaling(run, 1, ["spec.x: bad"]) is None
    off = copy.deepcopy(run)
    off["metadata"]["uid"] = "off"
    off["spec"]["autoscaling"]["enabled"] = False
    assert reconcile.get_autoscaling(off, 1, []) is None
    suspended = copy.deepcopy(run)
    suspended["metadata"]["uid"] = "suspended"
    suspended["spec"]["suspend"] = True
    assert reconcile.get_autoscaling(suspended, 1, []) is None
    assert reconcile.get_autoscaling({**run, "status": {"phase": "Succeeded"}}, 1, []) is None
    assert reconcile.is_autoscale_due(None, NOW, view)
    assert not reconcile.is_autoscale_due(NOW, NOW + 10, view) and reconcile.is_autoscale_due(NOW, NOW + 15, view)
