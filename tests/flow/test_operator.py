"""The real operator (kopf over HTTP) against kmock with the fidelity layer of tests/support/kube.py.

The tests play the cluster's controllers through the API: they set Deployment/StatefulSet/Job status via
the status subresource, create Pods with loopback IPs, and serve the orchestrator's metrics from a
prometheus_client server bound on 127.0.0.x. Writes are counted on the emulator.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kube import FidelityEmulator, run_operator, serve_kubernetes, wait_for, wait_for_refreshes
from rlrun_api import constants
from rlrun_operator import metrics as operator_metrics
from rlrun_operator.kubeapi import KubeApi, get_api_client
from rlrun_operator.render import render
from rlrun_api.spec import apply_defaults

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.5  # status refresh interval of the operator under test, seconds
STANDARD_LABELS = (constants.LABEL_NAME, constants.LABEL_INSTANCE, constants.LABEL_COMPONENT,
                   constants.LABEL_PART_OF, constants.LABEL_MANAGED_BY)
WORKLOADS = {"Deployment", "StatefulSet", "Job"}
CHILD_KINDS = {"ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Service",
               "NetworkPolicy", "StatefulSet", "Deployment", "Job"}

pytestmark = pytest.mark.timeout(120)


def make_run(name: str, namespace: str, disaggregated: bool = False) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml renamed; optionally with prefill/decode disaggregation (2 replicas)."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    run["metadata"] = {"name": name, "namespace": namespace}
    if disaggregated:
        run["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:1", "replicas": 2}
    return run


def children(emu: FidelityEmulator, namespace: str, name: str) -> list[dict[str, Any]]:
    """Every object of the run's child kinds labelled instance=<name> in ``namespace``."""
    sel = f"{constants.LABEL_INSTANCE}={name}"
    return [o for kind in sorted(CHILD_KINDS) for o in emu.find(kind, namespace, sel)]


def one(emu: FidelityEmulator, kind: str, namespace: str, name: str) -> dict[str, Any]:
    found = [o for o in emu.find(kind, namespace) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {namespace}/{name}: {len(found)} objects"
    return found[0]


def run_status(emu: FidelityEmulator, namespace: str, name: str) -> dict[str, Any]:
    found = [o for o in emu.find(constants.KIND, namespace) if o["metadata"]["name"] == name]
    return (found[0].get("status") or {}) if found else {}


def event_reasons(emu: FidelityEmulator, namespace: str, name: str) -> set[str]:
    """Reasons of the Events posted about RLRun ``name``."""
    return {e["reason"] for e in emu.find("Event", namespace) if e["involvedObject"]["name"] == name}


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == ctype)


async def play_ready(api: KubeApi, emu: FidelityEmulator, namespace: str, name: str) -> None:
    """Be the Deployment/StatefulSet/Job controllers: every workload of the run reports all its replicas
    ready and updated for its current generation."""
    for obj in [o for kind in WORKLOADS for o in emu.find(kind, namespace, f"{constants.LABEL_INSTANCE}={name}")]:
        meta = obj["metadata"]
        if obj["kind"] == "Job":
            status = {"active": 1, "ready": 1}
        else:
            n = obj["spec"].get("replicas", 1)
            status = {"observedGeneration": meta["generation"], "replicas": n, "readyReplicas": n,
                      "updatedReplicas": n, "availableReplicas": n}
        await api.merge_patch(obj["kind"], namespace, meta["name"], {"status": status}, subresource="status")


def serve_metrics(port: int, values: dict[str, float]) -> tuple[str, Any]:
    """A prometheus_client server on a random 127.0.0.x at ``port`` exposing gauges ``values``.
    Returns (ip, server) — call server.shutdown()."""
    registry = CollectorRegistry()
    for name, value in values.items():
        Gauge(name, name, registry=registry).set(value)
    for _ in range(20):
        ip = f"127.0.0.{random.randint(20, 250)}"
        try:
            server, _thread = start_http_server(port, addr=ip, registry=registry)
        except OSError:
            continue
        return ip, server
    raise RuntimeError("no free 127.0.0.x address for the metrics server")


def serve_orchestrator_metrics(step: int, version: int, reward: float) -> tuple[str, Any]:
    """The orchestrator's progress metrics, served like its pod does (constants.ORCHESTRATOR_METRICS_PORT)."""
    return serve_metrics(constants.ORCHESTRATOR_METRICS_PORT, {
        constants.METRIC_STEP: step, constants.METRIC_POLICY_VERSION: version,
        constants.METRIC_LAST_REWARD: reward, constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT: 0})


async def create_pod(api: KubeApi, namespace: str, run: str, component: str, ip: str) -> None:
    """A Running pod of the run with a loopback podIP (what the kubelet would report)."""
    await api.create({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{run}-{component}-x1", "namespace": namespace,
                     "labels": {constants.LABEL_INSTANCE: run, constants.LABEL_COMPONENT: component}},
        "spec": {"containers": [{"name": "main", "image": "runtime"}]},
    })
    await api.merge_patch("Pod", namespace, f"{run}-{component}-x1",
                          {"status": {"phase": "Running", "podIP": ip}}, subresource="status")


def test_create_gives_every_child_with_labels_owner_and_status() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL, operator_namespace="ops"):
                created = await api.create(make_run("alpha", "ns1", disaggregated=True))
                uid = created["metadata"]["uid"]
                await wait_for(lambda: run_status(emu, "ns1", "alpha").get("phase") == "Initializing")
                live = children(emu, "ns1", "alpha")
                expected = render(apply_defaults({**created, "status": {}}), operator_namespace="ops")
                policy = one(emu, "NetworkPolicy", "ns1", "alpha-inference")
                assert policy["spec"] == next(m for m in expected if m["kind"] == "NetworkPolicy")["spec"]
                assert policy["spec"]["ingress"][0]["from"][1]["namespaceSelector"] == {
                    "matchLabels": {"kubernetes.io/metadata.name": "ops"}}
                assert sorted((o["kind"], o["metadata"]["name"]) for o in live) == \
                    sorted((m["kind"], m["metadata"]["name"]) for m in expected)
                assert {o["metadata"]["name"] for o in live if o["kind"] == "Deployment"} == \
                    {"alpha-prefill", "alpha-decode", "alpha-router"}
                for obj in live:
                    labels = obj["metadata"]["labels"]
                    assert all(k in labels for k in STANDARD_LABELS), obj["metadata"]["name"]
                    assert labels[constants.LABEL_INSTANCE] == "alpha"
                    assert labels[constants.LABEL_MANAGED_BY] == constants.MANAGED_BY
                    (ref,) = obj["metadata"]["ownerReferences"]
                    assert (ref["uid"], ref["kind"], ref["name"], ref["controller"]) == (uid, "RLRun", "alpha", True)
                    assert constants.ANNOTATION_SPEC_HASH in obj["metadata"]["annotations"]
                status = run_status(emu, "ns1", "alpha")
                assert status["observedGeneration"] == 1
                assert status["replicas"]["prefill"] == {"desired": 1, "ready": 0, "updated": 0}
                assert status["replicas"]["trainer"] == {"desired": 1, "ready": 0, "updated": 0}
                assert [c["type"] for c in status["conditions"]] == [
                    "Ready", "TrainerReady", "InferenceReady", "RouterReady", "OrchestratorReady",
                    "Progressing", "Degraded"]
                assert condition(status, "Ready")["status"] == "False"
                assert all(c["observedGeneration"] == 1 for c in status["conditions"])
                run = one(emu, constants.KIND, "ns1", "alpha")
                # No finalizer: the status refresh is the operator's own task, not a kopf timer (which would
                # make kopf block every run's deletion), so a delete never waits for the operator.
                assert not run["metadata"].get("finalizers")
                # Each child was written exactly once (its create).
                assert emu.write_count(CHILD_KINDS) == len(expected)
                await wait_for(lambda: "Initializing" in event_reasons(emu, "ns1", "alpha"))

    asyncio.run(scenario())


def test_status_follows_children_and_orchestrator_metrics_until_succeeded() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            ip, metrics_server = serve_orchestrator_metrics(step=3, version=3, reward=0.625)
            vllm_ip, vllm_server = serve_metrics(constants.INFERENCE_PORT, {constants.VLLM_METRIC_WAITING: 5})
            try:
                async with run_operator(url, status_interval=INTERVAL):
                    await api.create(make_run("beta", "ns1"))
                    await wait_for(lambda: run_status(emu, "ns1", "beta").get("phase") == "Initializing")
                    await play_ready(api, emu, "ns1", "beta")
                    await create_pod(api, "ns1", "beta", constants.COMPONENT_ORCHESTRATOR, ip)
                    await create_pod(api, "ns1", "beta", constants.COMPONENT_INFERENCE, vllm_ip)
                    await wait_for(lambda: run_status(emu, "ns1", "beta").get("step") == 3)
                    # Re-exported on the operator's own metrics (embedded here: same process).
                    await wait_for(lambda: operator_metrics.REGISTRY.get_sample_value(
                        "rlrun_operator_queue_depth", {"namespace": "ns1", "name": "beta", "role": "inference"}) == 5)
                    assert operator_metrics.REGISTRY.get_sample_value(
                        "rlrun_operator_run_step", {"namespace": "ns1", "name": "beta"}) == 3
                    status = run_status(emu, "ns1", "beta")
                    assert status["phase"] == "Running"
                    assert (status["policyVersion"], status["lastReward"]) == (3, 0.625)
                    assert condition(status, "Ready")["status"] == "True"
                    assert condition(status, "Ready")["reason"] == "AllRolesReady"
                    assert status["replicas"]["inference"] == {"desired": 1, "ready": 1, "updated": 1}
                    ready_since = condition(status, "Ready")["lastTransitionTime"]

                    # An idle resync writes nothing.
                    before = emu.write_count()
                    await wait_for_refreshes("ns1", "beta", 3)
                    assert emu.write_count() == before
                    assert condition(run_status(emu, "ns1", "beta"), "Ready")["lastTransitionTime"] == ready_since

                    # The orchestrator Job completes: Succeeded, completionTime, an Event.
                    await api.merge_patch("Job", "ns1", "beta-orchestrator", {"status": {
                        "active": 0, "ready": 0, "succeeded": 1,
                        "conditions": [{"type": "Complete", "status": "True"}]}}, subresource="status")
                    await wait_for(lambda: run_status(emu, "ns1", "beta").get("phase") == "Succeeded")
                    status = run_status(emu, "ns1", "beta")
                    assert status["completionTime"] >= status["startTime"]
                    assert condition(status, "Ready")["reason"] == "Succeeded"
                    assert condition(status, "Progressing")["status"] == "False"
                    await wait_for(lambda: {"Initializing", "Running", "Succeeded"} <= event_reasons(emu, "ns1", "beta"))
            finally:
                metrics_server.shutdown()
                vllm_server.shutdown()

    asyncio.run(scenario())


def printer_columns() -> list[dict[str, Any]]:
    crd = yaml.safe_load((ROOT / "crds" / "rlrun.yaml").read_text())
    return crd["spec"]["versions"][0]["additionalPrinterColumns"]


def resolve_column(obj: dict[str, Any], json_path: str) -> Any:
    """What kubectl prints for a printer column's jsonPath on ``obj`` (None when nothing matches): the
    forms the CRD uses, ``.a.b`` and ``.a[?(@.k=="v")].b`` (tests/unit/test_crd.py keeps it to those)."""
    match = re.fullmatch(r'((?:\.\w+)+?)(?:\[\?\(@\.(\w+)=="(\w+)"\)\]((?:\.\w+)+))?', json_path)
    assert match, json_path
    head, key, value, tail = match.groups()

    def walk(node: Any, dotted: str) -> Any:
        for part in dotted.strip(".").split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    found = walk(obj, head)
    if key is None:
        return found
    items = [item for item in found or [] if isinstance(item, dict) and item.get(key) == value]
    return walk(items[0], tail) if items else None


def test_printer_columns_show_what_the_operator_writes() -> None:
    """`kubectl get rlr` on the status the real operator writes: a run without disaggregation shows its
    ready inference pods (not two empty Prefill/Decode columns), a disaggregated one prefill and decode;
    the wide columns show the Ready condition, the trainer and the policy version."""
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            ip, metrics_server = serve_orchestrator_metrics(step=4, version=4, reward=0.5)
            try:
                async with run_operator(url, status_interval=INTERVAL):
                    await api.create(make_run("plain", "ns1"))
                    await api.create(make_run("split", "ns1", disaggregated=True))
                    for name in ("plain", "split"):
                        await wait_for(lambda: run_status(emu, "ns1", name).get("phase") == "Initializing")
                        await play_ready(api, emu, "ns1", name)
                    await create_pod(api, "ns1", "plain", constants.COMPONENT_ORCHESTRATOR, ip)
                    await wait_for(lambda: run_status(emu, "ns1", "plain").get("step") == 4)
                    await wait_for(lambda: condition(run_status(emu, "ns1", "split"), "Ready")["status"] == "True")
                    await wait_for(lambda: condition(run_status(emu, "ns1", "plain"), "Ready")["status"] == "True")
                    columns = printer_columns()
                    rows = {name: {c["name"]: resolve_column(one(emu, constants.KIND, "ns1", name), c["jsonPath"])
                                   for c in columns}
                            for name in ("plain", "split")}
            finally:
                metrics_server.shutdown()
        plain, split = rows["plain"], rows["split"]
        assert {k: plain[k] for k in ("Phase", "Step", "Reward", "Inference", "Prefill", "Decode")} == {
            "Phase": "Running", "Step": 4, "Reward": 0.5, "Inference": 1, "Prefill": None, "Decode": None}
        assert {k: split[k] for k in ("Phase", "Inference", "Prefill", "Decode")} == {
            "Phase": "Running", "Inference": None, "Prefill": 1, "Decode": 1}
        for row in (plain, split):
            assert (row["Ready"], row["Reason"], row["Trainer"]) == ("True", "AllRolesReady", 1)
            assert row["Age"]  # metadata.creationTimestamp
        assert plain["Policy"] == 4
        # Every default column says something about every run's pods (Prefill/Decode xor Inference).
        default = [c["name"] for c in columns if not c.get("priority")]
        for row in (plain, split):
            assert any(row[name] for name in ("Inference", "Prefill", "Decode") if name in default)

    asyncio.run(scenario())


def test_vllm_args_change_rolls_inference_only_and_keeps_live_replicas() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("gamma", "ns1", disaggregated=True))
                await wait_for(lambda: run_status(emu, "ns1", "gamma").get("observedGeneration") == 1)
                # Someone (an autoscaler) scales decode to 3.
                await api.merge_patch("Deployment", "ns1", "gamma-decode", {"spec": {"replicas": 3}})
                trainer_before = one(emu, "StatefulSet", "ns1", "gamma-trainer")
                job_before = one(emu, "Job", "ns1", "gamma-orchestrator")
                hashes = {n: one(emu, "Deployment", "ns1", f"gamma-{n}")["spec"]["template"]["metadata"]
                          ["annotations"][constants.ANNOTATION_CONFIG_HASH] for n in ("prefill", "decode")}
                writes_before = len(emu.writes)
                await api.merge_patch(constants.KIND, "ns1", "gamma",
                                      {"spec": {"inference": {"vllmArgs": ["--max-num-seqs", "64"]}}})
                await wait_for(lambda: run_status(emu, "ns1", "gamma").get("observedGeneration") == 2)
                for n in ("prefill", "decode"):
                    dep = one(emu, "Deployment", "ns1", f"gamma-{n}")
                    new_hash = dep["spec"]["template"]["metadata"]["annotations"][constants.ANNOTATION_CONFIG_HASH]
                    assert new_hash != hashes[n]
                assert one(emu, "Deployment", "ns1", "gamma-decode")["spec"]["replicas"] == 3
                assert one(emu, "Deployment", "ns1", "gamma-prefill")["spec"]["replicas"] == 1
                assert one(emu, "StatefulSet", "ns1", "gamma-trainer") == trainer_before
                # The orchestrator does not read vllmArgs: its Job is neither replaced nor patched.
                assert one(emu, "Job", "ns1", "gamma-orchestrator") == job_before
                patched = {(w.kind, w.name) for w in emu.writes[writes_before:] if w.method == "PATCH"
                           and w.kind in CHILD_KINDS}
                assert patched == {("ConfigMap", "gamma-config"), ("Deployment", "gamma-prefill"),
                                   ("Deployment", "gamma-decode")}
                sent = [w.body for w in emu.writes[writes_before:] if w.kind == "Deployment"]
                assert sent and not any("/spec/replicas" in str(body) for body in sent)

    asyncio.run(scenario())


def test_suspend_scales_to_zero_and_resume_restores_live_replicas() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("delta", "ns1", disaggregated=True))
                await wait_for(lambda: run_status(emu, "ns1", "delta").get("observedGeneration") == 1)
                await api.merge_patch("Deployment", "ns1", "delta-decode", {"spec": {"replicas": 3}})
                await api.merge_patch(constants.KIND, "ns1", "delta", {"spec": {"suspend": True}})
                await wait_for(lambda: run_status(emu, "ns1", "delta").get("observedGeneration") == 2)
                assert run_status(emu, "ns1", "delta")["phase"] == "Suspended"
                assert one(emu, "Deployment", "ns1", "delta-decode")["spec"]["replicas"] == 0
                assert one(emu, "Deployment", "ns1", "delta-prefill")["spec"]["replicas"] == 0
                assert one(emu, "Deployment", "ns1", "delta-router")["spec"]["replicas"] == 0
                assert one(emu, "StatefulSet", "ns1", "delta-trainer")["spec"]["replicas"] == 0
                assert one(emu, "Job", "ns1", "delta-orchestrator")["spec"]["suspend"] is True
                assert len(emu.find("Job", "ns1")) == 1  # suspended in place, not replaced
                await api.merge_patch(constants.KIND, "ns1", "delta", {"spec": {"suspend": False}})
                await wait_for(lambda: run_status(emu, "ns1", "delta").get("observedGeneration") == 3)
                decode = one(emu, "Deployment", "ns1", "delta-decode")
                assert decode["spec"]["replicas"] == 3
                assert constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND not in decode["metadata"]["annotations"]
                assert one(emu, "Deployment", "ns1", "delta-prefill")["spec"]["replicas"] == 1
                assert one(emu, "StatefulSet", "ns1", "delta-trainer")["spec"]["replicas"] == 1
                assert one(emu, "Job", "ns1", "delta-orchestrator")["spec"]["suspend"] is False
                assert run_status(emu, "ns1", "delta")["phase"] == "Initializing"

    asyncio.run(scenario())


def test_delete_removes_children_through_owner_references() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL) as memo:
                await api.create(make_run("eps", "ns1"))
                await wait_for(lambda: run_status(emu, "ns1", "eps").get("phase") == "Initializing")
                assert len(children(emu, "ns1", "eps")) == 14
                assert [t.get_name() for t in memo.refreshers] == ["rlrun status refresh ns1/eps"]
                await api.delete(constants.KIND, "ns1", "eps")
                await wait_for(lambda: not emu.find(constants.KIND, "ns1"))
                await wait_for(lambda: not children(emu, "ns1", "eps"))
                # The operator itself deleted nothing: the garbage collector did.
                assert not [w for w in emu.writes if w.method == "DELETE" and w.kind in CHILD_KINDS]
                # The run's status refresh notices it is gone, ends and forgets its metric series.
                await wait_for(lambda: not memo.refreshers, timeout=10)
                phases = [s for m in operator_metrics.REGISTRY.collect() for s in m.samples
                          if s.labels.get("name") == "eps" and s.labels.get("namespace") == "ns1"]
                assert phases == [], phases

    asyncio.run(scenario())


def test_finalizer_of_an_older_operator_is_removed_and_delete_does_not_wait() -> None:
    """A run an older operator served carries kopf's rlrun.dev/finalizer (its status refresh was a kopf
    timer): this operator removes only that finalizer, keeps another controller's, and a delete then waits
    for the other controller alone."""
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            run = make_run("old", "ns1")
            run["metadata"]["finalizers"] = [constants.FINALIZER, "example.com/keep"]
            await api.create(run)
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for(lambda: run_status(emu, "ns1", "old").get("phase") == "Initializing")
                await wait_for(lambda: one(emu, constants.KIND, "ns1", "old")["metadata"].get("finalizers")
                               == ["example.com/keep"])
                await api.delete(constants.KIND, "ns1", "old")
                await wait_for(lambda: one(emu, constants.KIND, "ns1", "old")["metadata"].get("deletionTimestamp"))
                await api.json_patch(constants.KIND, "ns1", "old", [{"op": "remove", "path": "/metadata/finalizers"}])
                await wait_for(lambda: not emu.find(constants.KIND, "ns1"))

    asyncio.run(scenario())


def test_invalid_spec_reports_invalid_spec_creates_nothing_and_recovers() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                bad = make_run("zeta", "team-a")
                bad["spec"]["environment"]["name"] = "no-such-task"
                await api.create(bad)
                await api.create(make_run("zeta", "team-b"))
                await wait_for(lambda: condition(run_status(emu, "team-a", "zeta"), "Ready")["reason"]
                               == "InvalidSpec" if run_status(emu, "team-a", "zeta") else False)
                await wait_for(lambda: run_status(emu, "team-b", "zeta").get("phase") == "Initializing")
                status = run_status(emu, "team-a", "zeta")
                assert status["phase"] == "Pending"
                assert "spec.environment.name" in condition(status, "Ready")["message"]
                assert children(emu, "team-a", "zeta") == []
                assert len(children(emu, "team-b", "zeta")) == 14
                await wait_for(lambda: "InvalidSpec" in event_reasons(emu, "team-a", "zeta"))
                warnings = [e for e in emu.find("Event", "team-a") if e["reason"] == "InvalidSpec"]
                assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
                assert "spec.environment.name" in warnings[0]["message"]
                # Still invalid on the next resyncs: no second Event.
                await wait_for_refreshes("team-a", "zeta", 2)
                assert len([e for e in emu.find("Event", "team-a") if e["reason"] == "InvalidSpec"]) == 1
                # Fixing the spec recovers.
                await api.merge_patch(constants.KIND, "team-a", "zeta",
                                      {"spec": {"environment": {"name": "reverse-words"}}})
                await wait_for(lambda: condition(run_status(emu, "team-a", "zeta"), "Ready")["reason"]
                               == "RolesNotReady")
                assert run_status(emu, "team-a", "zeta")["phase"] == "Initializing"
                assert len(children(emu, "team-a", "zeta")) == 14

    asyncio.run(scenario())


def test_operator_restart_makes_no_duplicates_and_no_writes() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("eta", "ns1", disaggregated=True))
                await wait_for(lambda: run_status(emu, "ns1", "eta").get("phase") == "Initializing")
                await play_ready(api, emu, "ns1", "eta")
                await wait_for(lambda: run_status(emu, "ns1", "eta").get("phase") == "Running")
                await wait_for_refreshes("ns1", "eta", 2)
            before_writes = len(emu.writes)
            before = sorted((o["kind"], o["metadata"]["name"], o["metadata"]["resourceVersion"])
                            for o in children(emu, "ns1", "eta"))
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for_refreshes("ns1", "eta", 5)  # resume handler plus several status refreshes
            after = sorted((o["kind"], o["metadata"]["name"], o["metadata"]["resourceVersion"])
                           for o in children(emu, "ns1", "eta"))
            assert after == before
            assert emu.writes[before_writes:] == []
            assert run_status(emu, "ns1", "eta")["phase"] == "Running"

    asyncio.run(scenario())


def test_two_runs_in_two_namespaces_stay_isolated() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                one_run = await api.create(make_run("same", "ns1"))
                two_run = await api.create(make_run("same", "ns2", disaggregated=True))
                for ns in ("ns1", "ns2"):
                    await wait_for(lambda ns=ns: run_status(emu, ns, "same").get("phase") == "Initializing")
                for ns, run in (("ns1", one_run), ("ns2", two_run)):
                    for obj in children(emu, ns, "same"):
                        assert obj["metadata"]["namespace"] == ns
                        assert obj["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
                assert {o["metadata"]["name"] for o in emu.find("Deployment", "ns1")} == {"same-inference", "same-router"}
                assert {o["metadata"]["name"] for o in emu.find("Deployment", "ns2")} == \
                    {"same-prefill", "same-decode", "same-router"}
                await play_ready(api, emu, "ns2", "same")
                await wait_for(lambda: condition(run_status(emu, "ns2", "same"), "TrainerReady")["status"] == "True")
                assert condition(run_status(emu, "ns1", "same"), "TrainerReady")["status"] == "False"
                await api.delete(constants.KIND, "ns1", "same")
                await wait_for(lambda: not children(emu, "ns1", "same"))
                assert len(children(emu, "ns2", "same")) == 16  # prefill and decode: 2 more than ns1
                assert len(children(emu, "ns1", "same")) == 0

    asyncio.run(scenario())


def test_rlrun_operator_process_logs_in_with_kubeconfig_and_serves_metrics_and_liveness(tmp_path: Path) -> None:
    """The console script as a process: KUBECONFIG login, children created, /healthz and /metrics."""
    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "t",
                "clusters": [{"name": "t", "cluster": {"server": url}}], "users": [{"name": "t", "user": {}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
            metrics_port, health_port = free_port(), free_port()
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "rlrun-operator"), "--all-namespaces", "--status-interval", "1",
                 "--metrics-port", str(metrics_port), "--health-port", str(health_port),
                 "--metrics-host", "127.0.0.1", "--log-level", "warning"],
                env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                api = KubeApi(get_api_client(url))
                async with aiohttp.ClientSession() as http:
                    async def get(port: int, path: str) -> tuple[int, str]:
                        try:
                            async with http.get(f"http://127.0.0.1:{port}{path}") as resp:
                                return resp.status, await resp.text()
                        except aiohttp.ClientError:
                            return 0, ""

                    for _ in range(300):
                        if (await get(health_port, "/healthz"))[0] == 200:
                            break
                        assert proc.poll() is None, proc.stdout.read().decode()
                        await asyncio.sleep(0.1)
                    await api.create(make_run("proc", "ns1"))
                    await wait_for(lambda: run_status(emu, "ns1", "proc").get("phase") == "Initializing")
                    assert len(children(emu, "ns1", "proc")) == 14
                    status, text = await get(metrics_port, "/metrics")
                    assert status == 200
                    assert 'rlrun_operator_reconciles_total{trigger="create"} 1.0' in text
                    assert 'rlrun_operator_child_writes_total{action="create"} 14.0' in text
                    assert 'rlrun_operator_runs{phase="Initializing"} 1.0' in text
            finally:
                proc.terminate()
                proc.wait(timeout=20)

    asyncio.run(scenario())


# Seconds the operator may take from SIGTERM to exit: kopf's own shutdown waits up to 5 s for handlers
# still running before it cancels them; a pod has 30 s (terminationGracePeriodSeconds) before SIGKILL.
STOP_GRACE_S = 5.0


async def serve_hanging_metrics() -> tuple[str, asyncio.Event, Any]:
    """A metrics endpoint at a random 127.0.0.x:ORCHESTRATOR_METRICS_PORT that reads each request and
    never answers it (it holds the connection until the client closes it): a status refresh that scrapes
    it stays in flight. Returns (ip, an Event set on the first request, the server)."""
    asked = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            asked.set()
            await reader.read()  # until the client goes away
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    for _ in range(20):
        ip = f"127.0.0.{random.randint(20, 250)}"
        try:
            server = await asyncio.start_server(hold, ip, constants.ORCHESTRATOR_METRICS_PORT)
        except OSError:
            continue
        return ip, asked, server
    raise RuntimeError("no free 127.0.0.x address for the metrics server")


def test_a_refresh_in_flight_never_writes_its_status_onto_a_run_recreated_under_the_same_name() -> None:
    """No finalizer holds a deletion, so a run can be deleted and created again (kubectl replace --force, a
    GitOps re-sync) while its status refresh waits on a scrape: that refresh's write carries the
    resourceVersion it read, the API server refuses it (409), and the re-read finds another uid: the old run's
    Succeeded status never lands on the new run, and the old refresh ends."""
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            ip, asked, server = await serve_hanging_metrics()
            try:
                async with run_operator(url, status_interval=INTERVAL) as memo:
                    await api.create(make_run("re", "ns1"))
                    await wait_for(lambda: run_status(emu, "ns1", "re").get("phase") == "Initializing")
                    await play_ready(api, emu, "ns1", "re")
                    await wait_for(lambda: run_status(emu, "ns1", "re").get("phase") == "Running")
                    old_uid = one(emu, constants.KIND, "ns1", "re")["metadata"]["uid"]
                    # The old run's next refresh sees its Job complete (so it will write phase Succeeded, which
                    # is sticky: on the new run it would make every reconcile treat it as finished), then
                    # waits on the orchestrator's scrape.
                    await api.merge_patch("Job", "ns1", "re-orchestrator", {"status": {
                        "active": 0, "ready": 0, "succeeded": 1,
                        "conditions": [{"type": "Complete", "status": "True"}]}}, subresource="status")
                    await create_pod(api, "ns1", "re", constants.COMPONENT_ORCHESTRATOR, ip)
                    await asyncio.wait_for(asked.wait(), timeout=30)  # a refresh of the old run now waits
                    await api.delete(constants.KIND, "ns1", "re")
                    await wait_for(lambda: not emu.find(constants.KIND, "ns1"))
                    await api.create(make_run("re", "ns1"))
                    await wait_for(lambda: run_status(emu, "ns1", "re").get("phase") == "Initializing")
                    assert one(emu, constants.KIND, "ns1", "re")["metadata"]["uid"] != old_uid
                    deadline = asyncio.get_running_loop().time() + 4 * INTERVAL + 3  # the scrape gives up after 2 s
                    while asyncio.get_running_loop().time() < deadline:
                        assert run_status(emu, "ns1", "re").get("phase") == "Initializing", run_status(emu, "ns1", "re")
                        await asyncio.sleep(0.02)
                    assert [t.get_name() for t in memo.refreshers] == ["rlrun status refresh ns1/re"]
            finally:
                server.close()

    asyncio.run(scenario())


def test_sigterm_during_a_status_refresh_exits_cleanly_within_the_grace_period(tmp_path: Path) -> None:
    """The console script as a process gets SIGTERM while its status timer waits on a scrape (the
    orchestrator's /metrics never answers): it exits 0 within STOP_GRACE_S, and its log has no ERROR, no
    traceback and no timer left orphaned (kopf: "did not exit in time")."""
    async def scenario() -> tuple[int | None, float, str]:
        async with serve_kubernetes() as (emu, url):
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "t",
                "clusters": [{"name": "t", "cluster": {"server": url}}], "users": [{"name": "t", "user": {}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
            log = open(tmp_path / "operator.log", "wb")
            proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "rlrun-operator"), "--status-interval", "0.5",
                 "--metrics-port", "0", "--health-port", "0", "--log-level", "info"],
                env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log, stderr=subprocess.STDOUT)
            ip, asked, server = await serve_hanging_metrics()
            try:
                api = KubeApi(get_api_client(url))
                await api.create(make_run("term", "ns1"))
                await wait_for(lambda: run_status(emu, "ns1", "term").get("phase") == "Initializing", timeout=60)
                await play_ready(api, emu, "ns1", "term")
                await create_pod(api, "ns1", "term", constants.COMPONENT_ORCHESTRATOR, ip)
                await asyncio.wait_for(asked.wait(), timeout=30)  # a refresh is now waiting on the scrape
                assert proc.poll() is None
                proc.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                await wait_for(lambda: proc.poll() is not None, timeout=30)
                return proc.returncode, time.monotonic() - sent, (tmp_path / "operator.log").read_text()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
                server.close()

    code, took, text = asyncio.run(scenario())
    assert code == 0, text
    assert took < STOP_GRACE_S, (took, text)
    for bad in ("ERROR", "Traceback", "did not exit in time", "orphaned"):
        assert bad not in text, text

    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("theta", "ns1"))
                await wait_for(lambda: run_status(emu, "ns1", "theta").get("phase") == "Initializing")
                old_uid = one(emu, "Deployment", "ns1", "theta-router")["metadata"]["uid"]
                await api.delete("Deployment", "ns1", "theta-router")
                await wait_for(lambda: [o for o in emu.find("Deployment", "ns1")
                                        if o["metadata"]["name"] == "theta-router"])
                new = one(emu, "Deployment", "ns1", "theta-router")
                assert new["metadata"]["uid"] != old_uid
                assert new["metadata"]["ownerReferences"][0]["name"] == "theta"
                assert len(children(emu, "ns1", "theta")) == 14
                # Not only workloads: a deleted NetworkPolicy (vLLM's weight endpoints open) and a Service.
                for kind, name in (("NetworkPolicy", "theta-inference"), ("Service", "theta-router")):
                    old_uid = one(emu, kind, "ns1", name)["metadata"]["uid"]
                    await api.delete(kind, "ns1", name)
                    await wait_for(lambda kind=kind, name=name: [
                        o for o in emu.find(kind, "ns1") if o["metadata"]["name"] == name])
                    assert one(emu, kind, "ns1", name)["metadata"]["uid"] != old_uid
                assert len(children(emu, "ns1", "theta")) == 14

    asyncio.run(scenario())


def test_child_refused_by_the_api_server_is_invalid_spec_without_endless_retries() -> None:
    """spec.pod.affinity's parts are free-form in the CRD, so a malformed one passes validate; the API server (here
    kubernetes-validate in tests/support/kube.py) answers 422 for the rendered StatefulSet. That is InvalidSpec with
    the server's message and one Warning Event, not a conflict retried forever."""
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                bad = make_run("iota", "ns1")
                bad["spec"]["pod"] = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": 5}}}
                await api.create(bad)
                await wait_for(lambda: run_status(emu, "ns1", "iota").get("conditions"))
                ready = condition(run_status(emu, "ns1", "iota"), "Ready")
                assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
                assert 'StatefulSet "iota-trainer" is invalid' in ready["message"]
                assert "affinity.nodeAffinity" in ready["message"]
                await wait_for(lambda: "InvalidSpec" in event_reasons(emu, "ns1", "iota"))
                refused = [w for w in emu.writes if w.status == 422]
                assert [(w.method, w.kind) for w in refused] == [("POST", "StatefulSet")]
                # No retry loop: nothing more is attempted while the spec stays the same.
                before = emu.write_count(CHILD_KINDS)
                await wait_for_refreshes("ns1", "iota", 5)
                assert emu.write_count(CHILD_KINDS) == before
                assert len([e for e in emu.find("Event", "ns1") if e["reason"] == "InvalidSpec"]) == 1
                # Fixing the spec recovers: every child exists.
                await api.json_patch(constants.KIND, "ns1", "iota",
                                     [{"op": "remove", "path": "/spec/pod/affinity"}])
                await wait_for(lambda: condition(run_status(emu, "ns1", "iota"), "Ready")["reason"] == "RolesNotReady")
                assert len(children(emu, "ns1", "iota")) == 14

    asyncio.run(scenario())


def test_patch_refused_by_the_api_server_is_invalid_spec_not_a_conflict() -> None:
    """A valid run, then a spec change whose rendered children the API server refuses (422 on a JSON patch
    whose resourceVersion test held): InvalidSpec, the live children are kept, no retry loop."""
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("kappa", "ns1"))
                await wait_for(lambda: run_status(emu, "ns1", "kappa").get("phase") == "Initializing")
                await api.merge_patch(constants.KIND, "ns1", "kappa",
                                      {"spec": {"pod": {"affinity": {"podAffinity": {
                                          "requiredDuringSchedulingIgnoredDuringExecution": "near"}}}}})
                await wait_for(lambda: condition(run_status(emu, "ns1", "kappa"), "Ready")["reason"] == "InvalidSpec")
                assert "affinity.podAffinity" in condition(run_status(emu, "ns1", "kappa"), "Ready")["message"]
                refused = [(w.method, w.kind) for w in emu.writes if w.status == 422]
                assert refused == [("PATCH", "StatefulSet")]
                before = emu.write_count(CHILD_KINDS)
                await wait_for_refreshes("ns1", "kappa", 5)
                assert emu.write_count(CHILD_KINDS) == before
                assert len(children(emu, "ns1", "kappa")) == 14

    asyncio.run(scenario())


def test_finished_run_gives_its_gpus_back_and_keeps_job_and_storage() -> None:
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("lam", "ns1", disaggregated=True))
                await wait_for(lambda: run_status(emu, "ns1", "lam").get("phase") == "Initializing")
                await api.merge_patch("Deployment", "ns1", "lam-decode", {"spec": {"replicas": 3}})
                await play_ready(api, emu, "ns1", "lam")
                await wait_for(lambda: run_status(emu, "ns1", "lam").get("phase") == "Running")
                job_uid = one(emu, "Job", "ns1", "lam-orchestrator")["metadata"]["uid"]
                await api.merge_patch("Job", "ns1", "lam-orchestrator", {"status": {
                    "active": 0, "ready": 0, "succeeded": 1,
                    "conditions": [{"type": "Complete", "status": "True"}]}}, subresource="status")
                await wait_for(lambda: run_status(emu, "ns1", "lam").get("phase") == "Succeeded")
                await wait_for(lambda: one(emu, "StatefulSet", "ns1", "lam-trainer")["spec"]["replicas"] == 0)
                for name in ("lam-prefill", "lam-decode", "lam-router"):
                    await wait_for(lambda name=name: one(emu, "Deployment", "ns1", name)["spec"]["replicas"] == 0)
                decode = one(emu, "Deployment", "ns1", "lam-decode")
                assert decode["metadata"]["annotations"][constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND] == "3"
                job = one(emu, "Job", "ns1", "lam-orchestrator")
                assert job["metadata"]["uid"] == job_uid and job["spec"]["suspend"] is False
                assert one(emu, "PersistentVolumeClaim", "ns1", "lam-storage")
                assert one(emu, "ConfigMap", "ns1", "lam-config")
                assert run_status(emu, "ns1", "lam")["phase"] == "Succeeded"
                # Settled: the timer writes nothing more, and a restarted operator neither.
                await wait_for_refreshes("ns1", "lam", 2)
                before = len(emu.writes)
                await wait_for_refreshes("ns1", "lam", 3)
                assert emu.writes[before:] == []
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for_refreshes("ns1", "lam", 5)
            assert emu.writes[before:] == []
            assert run_status(emu, "ns1", "lam")["phase"] == "Succeeded"

    asyncio.run(scenario())


def test_replaced_orchestrator_job_waits_for_the_old_pod() -> None:
    """A spec change the orchestrator reads replaces its Job (immutable pod template). The old Job is
    deleted in the foreground, so the new one is only created once the old pod is gone: never two
    orchestrators at once. The test plays the Job controller and the kubelet: the old pod carries a
    finalizer until the test releases it."""
    async def scenario() -> None:
        async with serve_kubernetes() as (emu, url):
            api = KubeApi(get_api_client(url))
            async with run_operator(url, status_interval=INTERVAL):
                await api.create(make_run("mu", "ns1"))
                await wait_for(lambda: run_status(emu, "ns1", "mu").get("phase") == "Initializing")
                old_job = one(emu, "Job", "ns1", "mu-orchestrator")
                await api.create({
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": "mu-orchestrator-abcde", "namespace": "ns1",
                                 "finalizers": ["test.rlrun.dev/still-running"],
                                 "labels": {constants.LABEL_INSTANCE: "mu",
                                            constants.LABEL_COMPONENT: constants.COMPONENT_ORCHESTRATOR},
                                 "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "mu-orchestrator",
                                                      "uid": old_job["metadata"]["uid"], "controller": True}]},
                    "spec": {"containers": [{"name": "main", "image": "runtime"}]}})
                await api.merge_patch(constants.KIND, "ns1", "mu", {"spec": {"algorithm": {"maxSteps": 61}}})
                await wait_for(lambda: one(emu, "Job", "ns1", "mu-orchestrator")["metadata"].get("deletionTimestamp"))
                deletes = [w for w in emu.writes if w.method == "DELETE" and w.kind == "Job"]
                assert deletes and deletes[0].body["propagationPolicy"] == "Foreground"
                # While the old pod runs, the old Job stays and no second one is created.
                await wait_for_refreshes("ns1", "mu", 3)
                jobs = emu.find("Job", "ns1")
                assert [j["metadata"]["uid"] for j in jobs] == [old_job["metadata"]["uid"]]
                # The old pod exits: the old Job goes, the retried reconcile creates the new one.
                await api.json_patch("Pod", "ns1", "mu-orchestrator-abcde",
                                     [{"op": "remove", "path": "/metadata/finalizers"}])
                await wait_for(lambda: [j for j in emu.find("Job", "ns1")
                                        if j["metadata"]["uid"] != old_job["metadata"]["uid"]], timeout=30)
                (new_job,) = emu.find("Job", "ns1")
                assert new_job["spec"]["template"] != old_job["spec"]["template"]
                await wait_for(lambda: run_status(emu, "ns1", "mu").get("observedGeneration") == 2, timeout=30)

    asyncio.run(scenario())
