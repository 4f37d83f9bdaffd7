"""Who owns the replica counts (issue 7 §2), with the real operator (kopf over HTTP) against kmock
(tests/support/kube.py).

A person's ``kubectl scale`` is played as a merge patch of the Deployment's spec.replicas (what the scale
subresource changes). Idle windows are counted in the operator's own status refreshes, never in seconds.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube import FidelityEmulator, run_operator, serve_kubernetes, wait_for, wait_for_refreshes
from rlrun_api import constants
from rlrun_operator import metrics as operator_metrics
from rlrun_operator.kubeapi import KubeApi, get_api_client

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.25  # the operator's status refresh interval, seconds

pytestmark = pytest.mark.timeout(120)


def make_run(name: str, replicas: int = 1, disaggregation: dict[str, Any] | None = None,
             autoscaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml as ``ns1/<name>`` with ``replicas`` inference pods, or ``disaggregation``."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    run["metadata"] = {"name": name, "namespace": "ns1"}
    run["spec"]["inference"]["replicas"] = replicas
    if disaggregation is not None:
        run["spec"]["inference"]["disaggregation"] = {"enabled": True, **disaggregation}
    if autoscaling is not None:
        run["spec"]["autoscaling"] = autoscaling
    return run


def one(emu: FidelityEmulator, kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in emu.find(kind, "ns1") if o["metadata"]["name"] == name]
    return found


def replicas(emu: FidelityEmulator, name: str) -> int:
    return one(emu, "Deployment", name)["spec"]["replicas"]


def applied_sizes(emu: FidelityEmulator, name: str) -> dict[str, Any]:
    return json.loads(one(emu, "Deployment", name)["metadata"]["annotations"][constants.ANNOTATION_APPLIED_SIZES])


def observed(emu: FidelityEmulator, run: str) -> int | None:
    return (one(emu, constants.KIND, run).get("status") or {}).get("observedGeneration")


def messages(emu: FidelityEmulator, run: str, reason: str) -> list[str]:
    """Messages of the Events with ``reason`` posted about RLRun ``run``, oldest first."""
    return [e["message"] for e in emu.find("Event", "ns1") if e["involvedObject"]["name"] == run
            and e["reason"] == reason]


def deployment_writes(emu: FidelityEmulator, since: int = 0) -> list[Any]:
    return [w for w in emu.writes[since:] if w.kind == "Deployment" and w.method != "GET"]


def spec_writes(emu: FidelityEmulator, run: str) -> list[Any]:
    """Writes to the RLRun itself (not its status) that carry a spec, after its creation: only the test's
    own edits may be there, the operator makes none."""
    return [w for w in emu.writes if w.kind == constants.KIND and w.name == run and w.subresource is None
            and w.method != "POST" and isinstance(w.body, dict) and "spec" in w.body]


async def scale_by_hand(api: KubeApi, name: str, count: int) -> None:
    """``kubectl scale deployment <name> --replicas <count>``."""
    await api.merge_patch("Deployment", "ns1", name, {"spec": {"replicas": count}})


def no_null_replicas(emu: FidelityEmulator) -> bool:
    """No write to a Deployment carried ``replicas: null`` (or any null value)."""
    return "None" not in str([w.body for w in emu.writes if w.kind == "Deployment"])


def test_hand_scale_is_kept_across_resyncs_until_the_spec_size_changes() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            created = await api.create(make_run("solo"))
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for(lambda: observed(emu, "solo") == 1)
                assert replicas(emu, "solo-inference") == 1
                assert applied_sizes(emu, "solo-inference") == {"spec.inference.replicas": 1}
                await scale_by_hand(api, "solo-inference", 3)
                hand = len(emu.writes)
                await wait_for_refreshes("ns1", "solo", 6)
                assert replicas(emu, "solo-inference") == 3
                assert [w for w in deployment_writes(emu, hand) if w.name == "solo-inference"] == []
            # ... and across an operator restart (the resume handler reconciles every child).
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for_refreshes("ns1", "solo", 4)
                assert replicas(emu, "solo-inference") == 3
                assert deployment_writes(emu, hand) == []
                assert messages(emu, "solo", constants.EVENT_RESIZED) == []

                # A spec change of inference.replicas resizes the pool, says so, and records the new size.
                await api.merge_patch(constants.KIND, "ns1", "solo", {"spec": {"inference": {"replicas": 2}}})
                await wait_for(lambda: replicas(emu, "solo-inference") == 2)
                await wait_for(lambda: messages(emu, "solo", constants.EVENT_RESIZED))
                assert messages(emu, "solo", constants.EVENT_RESIZED) == [
                    "spec.inference.replicas 1 -> 2: inference replicas 3 -> 2"]
                assert applied_sizes(emu, "solo-inference") == {"spec.inference.replicas": 2}
                await wait_for(lambda: observed(emu, "solo") == 2)

                # The next hand scale stays again: the spec did not change since.
                await scale_by_hand(api, "solo-inference", 4)
                hand = len(emu.writes)
                await wait_for_refreshes("ns1", "solo", 6)
                assert replicas(emu, "solo-inference") == 4
                assert deployment_writes(emu, hand) == []
                assert len(messages(emu, "solo", constants.EVENT_RESIZED)) == 1
            assert [w.body for w in spec_writes(emu, "solo")] == [{"spec": {"inference": {"replicas": 2}}}]
            assert one(emu, constants.KIND, "solo")["spec"]["inference"] == {**created["spec"]["inference"],
                                                                             "replicas": 2}
            assert no_null_replicas(emu)

    asyncio.run(scenario())


def test_ratio_change_resizes_both_pools_with_an_event_each() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            await api.create(make_run("pd", disaggregation={"ratio": "1:1", "replicas": 4}))
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for(lambda: observed(emu, "pd") == 1)
                assert (replicas(emu, "pd-prefill"), replicas(emu, "pd-decode")) == (2, 2)
                await scale_by_hand(api, "pd-decode", 3)  # overridden: the spec's split changes below
                await api.merge_patch(constants.KIND, "ns1", "pd",
                                      {"spec": {"inference": {"disaggregation": {"ratio": "1:3"}}}})
                await wait_for(lambda: observed(emu, "pd") == 2)
                assert (replicas(emu, "pd-prefill"), replicas(emu, "pd-decode")) == (1, 3)
                await wait_for(lambda: len(messages(emu, "pd", constants.EVENT_RESIZED)) == 1)
                # decode was at 3 by hand, which is the new spec's size: set from the spec (annotation), no
                # replicas sent, so no resize Event; prefill 2 -> 1 is one.
                assert messages(emu, "pd", constants.EVENT_RESIZED) == [
                    "spec.inference.disaggregation.ratio 1:1 -> 1:3: prefill replicas 2 -> 1"]
                for pool in ("pd-prefill", "pd-decode"):
                    assert applied_sizes(emu, pool) == {"spec.inference.disaggregation.ratio": "1:3",
                                                        "spec.inference.disaggregation.replicas": 4}
                # Back to 1:1: both pools resized, one Event each.
                await api.merge_patch(constants.KIND, "ns1", "pd",
                                      {"spec": {"inference": {"disaggregation": {"ratio": "1:1"}}}})
                await wait_for(lambda: observed(emu, "pd") == 3)
                assert (replicas(emu, "pd-prefill"), replicas(emu, "pd-decode")) == (2, 2)
                await wait_for(lambda: len(messages(emu, "pd", constants.EVENT_RESIZED)) == 3)
                assert sorted(messages(emu, "pd", constants.EVENT_RESIZED)[1:]) == [
                    "spec.inference.disaggregation.ratio 1:3 -> 1:1: decode replicas 3 -> 2",
                    "spec.inference.disaggregation.ratio 1:3 -> 1:1: prefill replicas 1 -> 2"]
                settled = len(emu.writes)
                await wait_for_refreshes("ns1", "pd", 4)
                assert deployment_writes(emu, settled) == []
                assert len(messages(emu, "pd", constants.EVENT_RESIZED)) == 3
            assert no_null_replicas(emu)

    asyncio.run(scenario())


AUTOSCALING = {"enabled": True, "maxReplicas": 4, "prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 3},
               "scrapeIntervalSeconds": 1, "upCooldownSeconds": 0, "downCooldownSeconds": 600}


def desired_gauge(run: str, pool: str) -> float | None:
    """The operator's rlrun_operator_autoscaler_desired_replicas for a pool: set by every decision."""
    return operator_metrics.REGISTRY.get_sample_value(constants.OPERATOR_METRIC_DESIRED_REPLICAS,
                                                      {"namespace": "ns1", "name": run, "role": pool})


def test_autoscaling_on_observes_a_hand_edit_and_leaves_spec_sizes_to_the_autoscaler() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            created = await api.create(make_run("handedit", disaggregation={"ratio": "1:1", "replicas": 2},
                                                autoscaling=AUTOSCALING))
            spec_before = copy.deepcopy(created["spec"])
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for(lambda: observed(emu, "handedit") == 1)
                await wait_for(lambda: desired_gauge("handedit", "decode") == 1, timeout=30)  # it decided once
                await scale_by_hand(api, "handedit-decode", 2)
                hand = len(emu.writes)
                await wait_for(lambda: messages(emu, "handedit", constants.EVENT_REPLICAS_EDITED), timeout=30)
                assert messages(emu, "handedit", constants.EVENT_REPLICAS_EDITED) == [
                    "decode replicas changed from 1 to 2 outside the autoscaler; it decides from 2"]
                await wait_for(lambda: desired_gauge("handedit", "decode") == 2)  # its next decision starts there
                await wait_for_refreshes("ns1", "handedit", 12)  # 3 s: 3 autoscaler intervals
                assert replicas(emu, "handedit-decode") == 2  # an observation, not reverted
                assert deployment_writes(emu, hand) == []
                assert len(messages(emu, "handedit", constants.EVENT_REPLICAS_EDITED)) == 1

                # A spec change of the sizes is not applied while the autoscaler owns the replicas.
                await api.merge_patch(constants.KIND, "ns1", "handedit", {"spec": {"inference": {
                    "disaggregation": {"ratio": "1:3", "replicas": 4}}}})
                await wait_for(lambda: observed(emu, "handedit") == 2)
                await wait_for(lambda: messages(emu, "handedit", constants.EVENT_RESIZE_LEFT_TO_AUTOSCALER))
                assert messages(emu, "handedit", constants.EVENT_RESIZE_LEFT_TO_AUTOSCALER) == [
                    "spec.inference.disaggregation.ratio 1:1 -> 1:3; spec.inference.disaggregation.replicas 2 -> 4: "
                    "not applied, spec.autoscaling.enabled lets the autoscaler own the replicas (the spec's sizes "
                    "are the initial split only)"]
                await wait_for_refreshes("ns1", "handedit", 8)
                assert (replicas(emu, "handedit-prefill"), replicas(emu, "handedit-decode")) == (1, 2)
                assert applied_sizes(emu, "handedit-decode") == {"spec.inference.disaggregation.ratio": "1:1",
                                                             "spec.inference.disaggregation.replicas": 2}
                assert deployment_writes(emu, hand) == []
                assert messages(emu, "handedit", constants.EVENT_RESIZED) == []
            assert [w.body for w in spec_writes(emu, "handedit")] == [{"spec": {"inference": {
                "disaggregation": {"ratio": "1:3", "replicas": 4}}}}]  # the test's own edit, nothing else
            assert created["spec"] == spec_before
            assert no_null_replicas(emu)

    asyncio.run(scenario())
