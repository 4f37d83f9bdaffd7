"""Who owns the pools' replica counts (issue 7 §2): the pure plans of apply.plan_replicas / plan_child and
reconcile.get_pool_sizes, as tables over examples/rlrun-tiny.yaml rendered for real.

Autoscaling off: a change of the spec's size fields (against the rlrun.dev/applied-sizes annotation) resizes
the pool with an Event ``Resized``; otherwise the live value (a ``kubectl scale``) stays. Autoscaling on: the
spec's sizes were the initial split, nothing is resized (Event ``ResizeLeftToAutoscaler``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from rlrun_api import constants as c
from rlrun_api.spec import apply_defaults
from rlrun_operator import apply
from rlrun_operator.apply import PoolSizes, get_spec_hash, plan_child, plan_replicas
from rlrun_operator.reconcile import ReconcileResult, get_pool_sizes
from rlrun_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
SINGLE = "spec.inference.replicas"
RATIO, TOTAL = "spec.inference.disaggregation.ratio", "spec.inference.disaggregation.replicas"


def make_run(replicas: int = 1, ratio: str | None = None, total: int = 2, autoscaling: dict | None = None,
             suspend: bool = False) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml as run ns/r, defaulted: one pool of ``replicas``, or with ``ratio`` a
    disaggregated run over ``total`` replicas; ``autoscaling`` merged into spec.autoscaling."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    run["metadata"] = {"name": "r", "namespace": "ns", "uid": "u-1", "generation": 1}
    run["spec"]["suspend"] = suspend
    run["spec"]["inference"]["replicas"] = replicas
    if ratio is not None:
        run["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": ratio, "replicas": total}
    if autoscaling is not None:
        run["spec"]["autoscaling"] = autoscaling
    return apply_defaults(run)


def pool(run: dict[str, Any], component: str) -> dict[str, Any]:
    (found,) = [m for m in render(run) if m["kind"] == "Deployment" and m["metadata"]["name"] == f"r-{component}"]
    return found


def created(run: dict[str, Any], component: str, replicas: int | None = None, saved: int | None = None,
            annotation: str | None = "keep") -> dict[str, Any]:
    """The pool Deployment as the operator created it for ``run``, then edited: ``replicas`` set by hand,
    ``saved`` as rlrun.dev/replicas-before-suspend, ``annotation`` replacing the applied-sizes one (None
    removes it, "keep" leaves the operator's)."""
    body = plan_child(pool(run, component), None, bool(run["spec"]["suspend"]), get_pool_sizes(run["spec"])).body
    live = copy.deepcopy(body)
    live["metadata"].update(resourceVersion="7", uid="child", generation=1)
    annotations = live["metadata"]["annotations"]
    if replicas is not None:
        live["spec"]["replicas"] = replicas
    if saved is not None:
        annotations[c.ANNOTATION_REPLICAS_BEFORE_SUSPEND] = str(saved)
    if annotation is None:
        annotations.pop(c.ANNOTATION_APPLIED_SIZES)
    elif annotation != "keep":
        annotations[c.ANNOTATION_APPLIED_SIZES] = annotation
    return live


def converge(run: dict[str, Any], live: dict[str, Any], component: str) -> tuple[dict[str, Any], list, apply.Plan]:
    """Plan the pool of ``run`` against ``live`` and apply the plan's JSON patch (as the API server would)."""
    plan = plan_child(pool(run, component), live, bool(run["spec"]["suspend"]), get_pool_sizes(run["spec"]))
    after = jsonpatch.apply_patch(live, plan.ops) if plan.action == "patch" else live
    return after, [(reason, message) for _, reason, message in plan.events], plan


def applied(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(obj["metadata"]["annotations"][c.ANNOTATION_APPLIED_SIZES])


AUTO = {"enabled": True, "prefill": {"min": 1, "max": 4}, "decode": {"min": 1, "max": 4}}
RESIZED, LEFT = c.EVENT_RESIZED, c.EVENT_RESIZE_LEFT_TO_AUTOSCALER

# (id, run the child was created for, edits of the live child, run now, component,
#  replicas after, applied sizes after, events (reason, message))
CASES = [
    ("unchanged-spec-keeps-a-hand-scale", make_run(1), {"replicas": 3}, make_run(1), "inference",
     3, {SINGLE: 1}, []),
    ("spec-change-resizes", make_run(1), {}, make_run(2), "inference",
     2, {SINGLE: 2}, [(RESIZED, "spec.inference.replicas 1 -> 2: inference replicas 1 -> 2")]),
    ("spec-change-overrides-a-hand-scale", make_run(1), {"replicas": 5}, make_run(2), "inference",
     2, {SINGLE: 2}, [(RESIZED, "spec.inference.replicas 1 -> 2: inference replicas 5 -> 2")]),
    ("spec-change-to-the-hand-scaled-size-writes-no-replicas", make_run(1), {"replicas": 2}, make_run(2),
     "inference", 2, {SINGLE: 2}, []),
    ("child-from-before-the-annotation-is-adopted-not-resized", make_run(1), {"annotation": None, "replicas": 4},
     make_run(2), "inference", 4, {SINGLE: 2}, []),
    ("unreadable-annotation-is-adopted-not-resized", make_run(1), {"annotation": "{not json"}, make_run(2),
     "inference", 1, {SINGLE: 2}, []),
    ("suspend-saves-and-scales-to-zero-spec-change-waits", make_run(1), {"replicas": 3},
     make_run(2, suspend=True), "inference", 0, {SINGLE: 1}, []),
    ("resume-restores-the-saved-count", make_run(1), {"replicas": 0, "saved": 3}, make_run(1), "inference",
     3, {SINGLE: 1}, []),
    ("resume-with-a-changed-spec-resizes", make_run(1), {"replicas": 0, "saved": 3}, make_run(2), "inference",
     2, {SINGLE: 2}, [(RESIZED, "spec.inference.replicas 1 -> 2: inference replicas 3 -> 2")]),
    ("ratio-change-resizes-prefill", make_run(ratio="1:1", total=4), {}, make_run(ratio="1:3", total=4),
     "prefill", 1, {RATIO: "1:3", TOTAL: 4},
     [(RESIZED, "spec.inference.disaggregation.ratio 1:1 -> 1:3: prefill replicas 2 -> 1")]),
    ("ratio-change-resizes-decode", make_run(ratio="1:1", total=4), {}, make_run(ratio="1:3", total=4),
     "decode", 3, {RATIO: "1:3", TOTAL: 4},
     [(RESIZED, "spec.inference.disaggregation.ratio 1:1 -> 1:3: decode replicas 2 -> 3")]),
    ("budget-change-names-the-field", make_run(ratio="1:1", total=2), {"replicas": 3},
     make_run(ratio="1:1", total=4), "decode", 2, {RATIO: "1:1", TOTAL: 4},
     [(RESIZED, "spec.inference.disaggregation.replicas 2 -> 4: decode replicas 3 -> 2")]),
    ("autoscaled-spec-change-is-left-to-the-autoscaler", make_run(ratio="1:1", total=2, autoscaling=AUTO),
     {"replicas": 3}, make_run(ratio="1:3", total=4, autoscaling=AUTO), "decode", 3, {RATIO: "1:1", TOTAL: 2},
     [(LEFT, "spec.inference.disaggregation.ratio 1:1 -> 1:3; spec.inference.disaggregation.replicas 2 -> 4: "
             "not applied, spec.autoscaling.enabled lets the autoscaler own the replicas (the spec's sizes are "
             "the initial split only)")]),
    ("autoscaled-unchanged-keeps-the-autoscalers-value", make_run(ratio="1:1", total=2, autoscaling=AUTO),
     {"replicas": 3}, make_run(ratio="1:1", total=2, autoscaling=AUTO), "prefill", 3, {RATIO: "1:1", TOTAL: 2}, []),
    ("autoscaled-resume-restores-the-saved-count", make_run(ratio="1:1", total=2, autoscaling=AUTO),
     {"replicas": 0, "saved": 3}, make_run(ratio="1:1", total=2, autoscaling=AUTO), "prefill", 3,
     {RATIO: "1:1", TOTAL: 2}, []),
    ("dry-run-autoscaling-leaves-sizing-to-the-spec",
     make_run(ratio="1:1", total=2, autoscaling={**AUTO, "dryRun": True}), {},
     make_run(ratio="1:1", total=4, autoscaling={**AUTO, "dryRun": True}), "decode", 2, {RATIO: "1:1", TOTAL: 4},
     [(RESIZED, "spec.inference.disaggregation.replicas 2 -> 4: decode replicas 1 -> 2")]),
]


@pytest.mark.parametrize("before,edits,now,component,replicas,sizes,events",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_who_sets_the_replicas(before, edits, now, component, replicas, sizes, events) -> None:
    live = created(before, component, **edits)
    after, posted, plan = converge(now, live, component)
    assert after["spec"]["replicas"] == replicas
    assert applied(after) == sizes
    assert posted == events
    assert c.ANNOTATION_REPLICAS_BEFORE_SUSPEND not in after["metadata"]["annotations"] or now["spec"]["suspend"]
    # Never replicas: null, and nothing but replicas and our two annotations is touched by these plans.
    assert all(op.get("value", 0) is not None for op in plan.ops)
    assert {op["path"] for op in plan.ops} <= {
        "/metadata/resourceVersion", "/spec/replicas",
        "/metadata/annotations/" + c.ANNOTATION_APPLIED_SIZES.replace("/", "~1"),
        "/metadata/annotations/" + c.ANNOTATION_REPLICAS_BEFORE_SUSPEND.replace("/", "~1")}
    # Converged: the same spec again plans nothing more (and says nothing more, but for the autoscaled case,
    # whose spec sizes stay unapplied).
    again, posted_again, plan_again = converge(now, after, component)
    assert plan_again.action == "none" and again == after
    assert posted_again == [e for e in events if e[0] == LEFT]


def test_create_stamps_the_sizes_and_keeps_the_hashes() -> None:
    run = make_run(ratio="1:2", total=3)
    sizes = get_pool_sizes(run["spec"])
    for component, seed in (("prefill", 1), ("decode", 2)):
        desired = pool(run, component)
        body = plan_child(desired, None, False, sizes).body
        assert body["spec"]["replicas"] == seed
        assert body["metadata"]["annotations"][c.ANNOTATION_APPLIED_SIZES] == (
            '{"spec.inference.disaggregation.ratio":"1:2","spec.inference.disaggregation.replicas":3}')
        # Not rendered, not hashed, not on the pod template: the spec and config hashes stay as they were.
        assert c.ANNOTATION_APPLIED_SIZES not in (desired["metadata"].get("annotations") or {})
        assert c.ANNOTATION_APPLIED_SIZES not in body["spec"]["template"]["metadata"]["annotations"]
        assert get_spec_hash(desired) == body["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]
        other = copy.deepcopy(body)
        other["metadata"]["annotations"][c.ANNOTATION_APPLIED_SIZES] = '{"spec.inference.replicas":9}'
        assert get_spec_hash(other) == get_spec_hash(body)
    router = next(m for m in render(run) if m["metadata"]["name"] == "r-router")
    assert c.ANNOTATION_APPLIED_SIZES not in plan_child(router, None, False, sizes).body["metadata"]["annotations"]


def test_a_content_change_keeps_a_hand_scale_and_sends_no_replicas() -> None:
    before = make_run(ratio="1:1", total=2)
    live = created(before, "decode", replicas=3)
    now = copy.deepcopy(before)
    now["spec"]["inference"]["vllmArgs"] = ["--max-num-seqs", "64"]
    after, posted, plan = converge(now, live, "decode")
    assert plan.action == "patch" and posted == []
    assert not any(op["path"].startswith("/spec/replicas") for op in plan.ops)
    assert after["spec"]["replicas"] == 3 and applied(after) == applied(live)


def test_without_sizes_the_live_replicas_are_kept_as_before() -> None:
    """plan_child without PoolSizes (callers that predate them) keeps the live value whatever the seed."""
    live = created(make_run(1), "inference", replicas=4)
    plan = plan_child(pool(make_run(3), "inference"), live, False)
    assert plan.action == "none" and plan.events == ()


@pytest.mark.parametrize("run,fields,autoscaled", [
    (make_run(2), {SINGLE: 2}, False),
    (make_run(2, ratio="2:3", total=5), {RATIO: "2:3", TOTAL: 5}, False),
    (make_run(ratio="1:1", total=2, autoscaling=AUTO), {RATIO: "1:1", TOTAL: 2}, True),
    (make_run(ratio="1:1", total=2, autoscaling={**AUTO, "dryRun": True}), {RATIO: "1:1", TOTAL: 2}, False),
    (make_run(ratio="1:1", total=2, autoscaling={**AUTO, "enabled": False}), {RATIO: "1:1", TOTAL: 2}, False),
], ids=["single", "disaggregated", "autoscaled", "dry-run", "autoscaling-off"])
def test_pool_sizes_from_the_spec(run, fields, autoscaled) -> None:
    sizes = get_pool_sizes(run["spec"])
    assert (dict(sizes.fields), sizes.autoscaled) == (fields, autoscaled)


def test_plan_replicas_ignores_other_children_and_reconcile_events_are_posted_once() -> None:
    run = make_run(ratio="1:1", total=2, autoscaling=AUTO)
    router = next(m for m in render(run) if m["metadata"]["name"] == "r-router")
    assert plan_replicas(router, {"spec": {"replicas": 5}}, False, get_pool_sizes(run["spec"])) == apply.ReplicaPlan()
    event = ("Normal", LEFT, "same message")
    result = ReconcileResult(outcomes=[apply.Outcome("Deployment", "r-prefill", "none", {}, (event,)),
                                       apply.Outcome("Deployment", "r-decode", "none", {}, (event,))])
    assert result.events == (event,)
    assert PoolSizes({SINGLE: 1}).encoded() == '{"spec.inference.replicas":1}'
