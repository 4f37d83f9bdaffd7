"""What Argo CD sees of a run (docs/gitops.md), checked on the real operator (kopf over HTTP) against kmock with
the fidelity layer of tests/support/kube.py.

- The RLRun objects the operator leaves at each phase are recorded in tests/data/argocd/*.yaml, the fixtures
  tests/unit/test_argocd_health.py runs deploy/argocd/health.lua on. This test fails when the operator now
  writes something else; regenerate them with
  ``RLRUN_RECORD_ARGOCD=1 .venv/bin/python -m pytest tests/flow/test_gitops.py -k fixtures`` and review the diff.
- Children stored with the fields kube-apiserver defaults cost the operator no write (idle refreshes, a restart,
  Argo CD re-applying the RLRun), and no child carries Argo CD's tracking metadata.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kube import FidelityEmulator, run_operator, serve_kubernetes, wait_for, wait_for_refreshes
from rlrun_api import constants
from rlrun_operator.kubeapi import KubeApi, get_api_client

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "data" / "argocd"
RECORD = os.environ.get("RLRUN_RECORD_ARGOCD") == "1"
INTERVAL = 0.5  # the operator's status refresh interval, seconds
FIXED_TIME = "2026-01-01T00:00:00Z"  # recorded timestamps are replaced by this (they differ on every run)
WORKLOADS = ("Deployment", "StatefulSet", "Job")
CHILD_KINDS = ("ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Service",
               "NetworkPolicy", "StatefulSet", "Deployment", "Job")
TRACKING_ANNOTATION = "argocd.argoproj.io/tracking-id"
FAILURE = "3 consecutive batches without a trainable sample; environment builtin/reverse-words"

pytestmark = pytest.mark.timeout(240)


def make_run(name: str, namespace: str) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml renamed to ``namespace/name``."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    run["metadata"] = {"name": name, "namespace": namespace}
    return run


def get_run(emu: FidelityEmulator, namespace: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in emu.find(constants.KIND, namespace) if o["metadata"]["name"] == name]
    return found


def get_status(emu: FidelityEmulator, namespace: str, name: str) -> dict[str, Any]:
    return get_run(emu, namespace, name).get("status") or {}


def get_condition(emu: FidelityEmulator, namespace: str, name: str, ctype: str) -> dict[str, Any]:
    return next((c for c in get_status(emu, namespace, name).get("conditions") or [] if c["type"] == ctype), {})


def get_children(emu: FidelityEmulator, namespace: str, name: str) -> list[dict[str, Any]]:
    return [o for kind in CHILD_KINDS for o in emu.find(kind, namespace, f"{constants.LABEL_INSTANCE}={name}")]


async def play_ready(api: KubeApi, emu: FidelityEmulator, namespace: str, name: str) -> None:
    """Be the workload controllers: every workload of the run reports all its replicas ready and updated."""
    for kind in WORKLOADS:
        for obj in emu.find(kind, namespace, f"{constants.LABEL_INSTANCE}={name}"):
            meta = obj["metadata"]
            if kind == "Job":
                status: dict[str, Any] = {"active": 1, "ready": 1}
            else:
                n = obj["spec"].get("replicas", 1)
                status = {"observedGeneration": meta["generation"], "replicas": n, "readyReplicas": n,
                          "updatedReplicas": n, "availableReplicas": n}
            await api.merge_patch(kind, namespace, meta["name"], {"status": status}, subresource="status")


async def create_orchestrator_pod(api: KubeApi, namespace: str, run: str, ip: str | None,
                                  failure: str | None = None) -> None:
    """A Running orchestrator pod with a loopback podIP (None: none, so nothing is scraped); ``failure``: its
    container's last run ended with that termination message (what the kubelet copies from
    /dev/termination-log)."""
    name = f"{run}-orchestrator-x1"
    await api.create({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": name, "namespace": namespace,
                                   "labels": {constants.LABEL_INSTANCE: run,
                                              constants.LABEL_COMPONENT: constants.COMPONENT_ORCHESTRATOR}},
                      "spec": {"containers": [{"name": "main", "image": "runtime"}]}})
    status: dict[str, Any] = {"phase": "Running", **({"podIP": ip} if ip else {})}
    if failure:
        status["containerStatuses"] = [{"name": "main", "lastState": {"terminated": {
            "exitCode": 1, "message": failure, "finishedAt": FIXED_TIME}}}]
    await api.merge_patch("Pod", namespace, name, {"status": status}, subresource="status")


def serve_orchestrator_metrics(step: int, reward: float) -> tuple[str, Any]:
    """The orchestrator's progress metrics on a random 127.0.0.x (constants.ORCHESTRATOR_METRICS_PORT)."""
    registry = CollectorRegistry()
    for metric, value in {constants.METRIC_STEP: step, constants.METRIC_POLICY_VERSION: step,
                          constants.METRIC_LAST_REWARD: reward, constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT: 0}.items():
        Gauge(metric, metric, registry=registry).set(value)
    for _ in range(20):
        ip = f"127.0.0.{random.randint(20, 250)}"
        try:
            server, _thread = start_http_server(constants.ORCHESTRATOR_METRICS_PORT, addr=ip, registry=registry)
        except OSError:
            continue
        return ip, server
    raise RuntimeError("no free 127.0.0.x address for the metrics server")


def get_fixture(obj: dict[str, Any]) -> dict[str, Any]:
    """What a fixture keeps of a live RLRun: apiVersion, kind, name, namespace, generation, spec and status,
    with the status timestamps replaced by FIXED_TIME (uid, resourceVersion, kopf's annotations and
    finalizer change on every run and say nothing about health)."""
    meta = obj["metadata"]
    out = {"apiVersion": obj["apiVersion"], "kind": obj["kind"],
           "metadata": {"name": meta["name"], "namespace": meta["namespace"], "generation": meta["generation"]},
           "spec": copy.deepcopy(obj["spec"])}
    if obj.get("status"):
        status = copy.deepcopy(obj["status"])
        for key in ("startTime", "completionTime"):
            if key in status:
                status[key] = FIXED_TIME
        for cond in status.get("conditions") or []:
            cond["lastTransitionTime"] = FIXED_TIME
        out["status"] = status
    return out


async def check_fixture(emu: FidelityEmulator, namespace: str, name: str, fixture: str, what: str,
                        settle: bool = True) -> None:
    """Record (RLRUN_RECORD_ARGOCD=1) or compare the run's live object with tests/data/argocd/<fixture>.yaml.
    ``settle``: first let the operator's timer refresh the run twice (whatever it still had to write is then
    written); False while no operator runs."""
    if settle:
        await wait_for_refreshes(namespace, name, 2)
    live = get_fixture(get_run(emu, namespace, name))
    path = FIXTURES / f"{fixture}.yaml"
    if RECORD:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        header = (f"# {what}\n# Recorded from the real operator by tests/flow/test_gitops.py (status timestamps "
                  f"set to {FIXED_TIME});\n# regenerate: RLRUN_RECORD_ARGOCD=1 .venv/bin/python -m pytest "
                  "tests/flow/test_gitops.py -k fixtures\n")
        path.write_text(header + yaml.safe_dump(live, sort_keys=False, width=120), encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing: regenerate the fixtures (see this module's docstring)"
    recorded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert live == recorded, f"the operator now writes another {fixture!r} RLRun: regenerate the fixtures " \
                             f"(see this module's docstring) and check deploy/argocd/health.lua against it"


def test_health_fixtures_are_what_the_operator_writes() -> None:
    async def scenario() -> None:
        ns = "argo"
        ip, metrics_server = serve_orchestrator_metrics(step=3, reward=0.625)
        try:
            async with serve_kubernetes() as (emu, url):
                api = KubeApi(get_api_client(url))
                await api.create(make_run("tiny", ns))
                await check_fixture(emu, ns, "tiny", "no-status", "Created, no operator yet: no status", settle=False)
                async with run_operator(url, status_interval=INTERVAL):
                    await wait_for(lambda: get_status(emu, ns, "tiny").get("phase") == "Initializing")
                    await check_fixture(emu, ns, "tiny", "initializing", "Children created, none ready")

                    await play_ready(api, emu, ns, "tiny")
                    await create_orchestrator_pod(api, ns, "tiny", ip)
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Ready").get("status") == "True"
                                   and get_status(emu, ns, "tiny").get("step") == 3)
                    await check_fixture(emu, ns, "tiny", "ready", "Every role ready, training at step 3")

                    # A vllmArgs change rolls the inference pods: the Deployment's controller has not
                    # observed its new generation yet (updated 0).
                    await api.merge_patch(constants.KIND, ns, "tiny",
                                          {"spec": {"inference": {"vllmArgs": ["--max-num-seqs", "16"]}}})
                    await wait_for(lambda: get_status(emu, ns, "tiny").get("observedGeneration") == 2
                                   and get_status(emu, ns, "tiny")["replicas"]["inference"]["updated"] == 0)
                    await check_fixture(emu, ns, "tiny", "rolling-out", "Generation 2 applied, inference rolling out")
                    # A GPU pool rolls with maxSurge 0: its old pod stops before the new one starts.
                    (deployment,) = [o for o in emu.find("Deployment", ns) if o["metadata"]["name"] == "tiny-inference"]
                    await api.merge_patch("Deployment", ns, "tiny-inference", {"status": {
                        "observedGeneration": deployment["metadata"]["generation"], "readyReplicas": 0,
                        "updatedReplicas": 0, "availableReplicas": 0}}, subresource="status")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Degraded").get("reason")
                                   == "ReplicasUnavailable")
                    await check_fixture(emu, ns, "tiny", "rolling-out-unavailable",
                                        "Generation 2 applied, the inference pod replaced stop-first (none ready)")
                    await play_ready(api, emu, ns, "tiny")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Ready").get("status") == "True")

                # The operator is away while the spec changes again: the status describes generation 2.
                await api.merge_patch(constants.KIND, ns, "tiny",
                                      {"spec": {"inference": {"vllmArgs": ["--max-num-seqs", "32"]}}})
                await check_fixture(emu, ns, "tiny", "generation-not-observed",
                                    "Spec changed (generation 3) while the operator was not running", settle=False)
                async with run_operator(url, status_interval=INTERVAL):
                    await wait_for(lambda: get_status(emu, ns, "tiny").get("observedGeneration") == 3)
                    await play_ready(api, emu, ns, "tiny")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Ready").get("status") == "True"
                                   and get_condition(emu, ns, "tiny", "Ready").get("observedGeneration") == 3)

                    # The trainer loses its pod (no rollout: updated stays 1).
                    await api.merge_patch("StatefulSet", ns, "tiny-trainer", {"status": {"readyReplicas": 0}},
                                          subresource="status")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Degraded").get("reason")
                                   == "ReplicasUnavailable")
                    await check_fixture(emu, ns, "tiny", "degraded-replicas-unavailable", "The trainer lost its pod")
                    await play_ready(api, emu, ns, "tiny")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Ready").get("status") == "True")

                    # The orchestrator's pod failed once and was replaced: every role is ready again.
                    await api.merge_patch("Pod", ns, "tiny-orchestrator-x1", {"status": {"containerStatuses": [
                        {"name": "main", "lastState": {"terminated": {
                            "exitCode": 1, "message": FAILURE, "finishedAt": FIXED_TIME}}}]}}, subresource="status")
                    await api.merge_patch("Job", ns, "tiny-orchestrator", {"status": {"failed": 1}},
                                          subresource="status")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Degraded").get("reason")
                                   == "OrchestratorRestarted" and FAILURE in get_condition(
                                       emu, ns, "tiny", "Degraded").get("message", ""))
                    await check_fixture(emu, ns, "tiny", "degraded-orchestrator-restarted",
                                  "Ready, but the orchestrator's pod failed once (its termination message)")
                    await api.merge_patch("Job", ns, "tiny-orchestrator", {"status": {"failed": 0}},
                                          subresource="status")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Degraded").get("status") == "False")

                    await api.merge_patch(constants.KIND, ns, "tiny", {"spec": {"suspend": True}})
                    await wait_for(lambda: get_status(emu, ns, "tiny").get("phase") == "Suspended"
                                   and get_status(emu, ns, "tiny").get("observedGeneration") == 4)
                    await check_fixture(emu, ns, "tiny", "suspended", "spec.suspend: true applied")

                    await api.merge_patch(constants.KIND, ns, "tiny", {"spec": {"suspend": False}})
                    await wait_for(lambda: get_status(emu, ns, "tiny").get("observedGeneration") == 5)
                    await play_ready(api, emu, ns, "tiny")
                    await wait_for(lambda: get_condition(emu, ns, "tiny", "Ready").get("status") == "True")
                    await api.merge_patch("Job", ns, "tiny-orchestrator", {"status": {
                        "active": 0, "ready": 0, "succeeded": 1,
                        "conditions": [{"type": "Complete", "status": "True"}]}}, subresource="status")
                    await wait_for(lambda: get_status(emu, ns, "tiny").get("phase") == "Succeeded")
                    # The finish reconcile scales every workload but the Job to 0 (the status follows).
                    await wait_for(lambda: get_status(emu, ns, "tiny")["replicas"]["trainer"]["desired"] == 0)
                    await check_fixture(emu, ns, "tiny", "succeeded", "The orchestrator Job completed")

                    # A run whose spec update is invalid, then fixed, whose orchestrator then fails.
                    await api.create(make_run("broken", ns))
                    await wait_for(lambda: get_status(emu, ns, "broken").get("phase") == "Initializing")
                    await api.merge_patch(constants.KIND, ns, "broken",
                                          {"spec": {"environment": {"name": "no-such-task"}}})
                    await wait_for(lambda: get_condition(emu, ns, "broken", "Ready").get("reason") == "InvalidSpec")
                    await check_fixture(emu, ns, "broken", "invalid-update",
                                  "An invalid spec update (generation 2) of a run whose children are at generation 1")
                    await api.merge_patch(constants.KIND, ns, "broken",
                                          {"spec": {"environment": {"name": "reverse-words"}}})
                    await wait_for(lambda: get_status(emu, ns, "broken").get("observedGeneration") == 3)
                    await create_orchestrator_pod(api, ns, "broken", None, failure=FAILURE)
                    await api.merge_patch("Job", ns, "broken-orchestrator", {"status": {
                        "active": 0, "failed": 1, "conditions": [{"type": "Failed", "status": "True"}]}},
                        subresource="status")
                    await wait_for(lambda: get_status(emu, ns, "broken").get("phase") == "Failed"
                                   and FAILURE in get_condition(emu, ns, "broken", "Degraded").get("message", ""))
                    await wait_for(lambda: get_status(emu, ns, "broken")["replicas"]["trainer"]["desired"] == 0)
                    await check_fixture(emu, ns, "broken", "failed",
                                        "The orchestrator Job failed (its termination message)")

                    # A run created invalid: nothing is created.
                    bad = make_run("invalid", ns)
                    bad["spec"]["algorithm"]["microBatchSize"] = 256  # more than batchSize 128
                    await api.create(bad)
                    await wait_for(lambda: get_condition(emu, ns, "invalid", "Ready").get("reason") == "InvalidSpec")
                    await check_fixture(emu, ns, "invalid", "invalid-spec", "Created with an invalid spec")
        finally:
            metrics_server.shutdown()

    asyncio.run(scenario())


# The fields kube-apiserver fills in (its SetDefaults_* functions; the Service's clusterIP by its allocator,
# the PVC's storageClassName by the DefaultStorageClass admission plugin) on the kinds a run owns.
def _default_probe(probe: dict[str, Any]) -> None:
    for key, value in (("timeoutSeconds", 1), ("periodSeconds", 10), ("successThreshold", 1),
                       ("failureThreshold", 3)):
        probe.setdefault(key, value)
    if "httpGet" in probe:
        probe["httpGet"].setdefault("scheme", "HTTP")


def _default_pod_spec(spec: dict[str, Any]) -> None:
    for key, value in (("restartPolicy", "Always"), ("dnsPolicy", "ClusterFirst"),
                       ("schedulerName", "default-scheduler"), ("terminationGracePeriodSeconds", 30),
                       ("securityContext", {}), ("enableServiceLinks", True)):
        spec.setdefault(key, copy.deepcopy(value))
    for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        image = container.get("image", "")
        pull = "Always" if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1] else "IfNotPresent"
        for key, value in (("terminationMessagePath", "/dev/termination-log"),
                           ("terminationMessagePolicy", "File"), ("imagePullPolicy", pull), ("resources", {})):
            container.setdefault(key, copy.deepcopy(value))
        for port in container.get("ports", []):
            port.setdefault("protocol", "TCP")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe in container:
                _default_probe(container[probe])
        for env in container.get("env", []):
            field_ref = (env.get("valueFrom") or {}).get("fieldRef")
            if field_ref is not None:
                field_ref.setdefault("apiVersion", "v1")
    for volume in spec.get("volumes", []):
        for source in ("configMap", "secret"):
            if source in volume:
                volume[source].setdefault("defaultMode", 420)


def add_server_defaults(kind: str, obj: dict[str, Any]) -> None:
    """Add what kube-apiserver defaults on ``kind`` to ``obj`` (in place; set fields are kept)."""
    spec = obj.setdefault("spec", {}) if kind not in ("ConfigMap", "ServiceAccount", "Role", "RoleBinding") else {}
    if kind in WORKLOADS:
        _default_pod_spec(spec["template"].setdefault("spec", {}))
    if kind == "Deployment":
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
        if strategy.get("type") == "RollingUpdate":
            strategy.setdefault("rollingUpdate", {"maxSurge": "25%", "maxUnavailable": "25%"})
    elif kind == "StatefulSet":
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("podManagementPolicy", "OrderedReady")
        spec.setdefault("updateStrategy", {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}})
        spec.setdefault("persistentVolumeClaimRetentionPolicy", {"whenDeleted": "Retain", "whenScaled": "Retain"})
    elif kind == "Job":
        for key, value in (("parallelism", 1), ("completions", 1), ("backoffLimit", 6),
                           ("completionMode", "NonIndexed"), ("suspend", False),
                           ("podReplacementPolicy", "TerminatingOrFailed")):
            spec.setdefault(key, value)
        labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
        labels.setdefault("batch.kubernetes.io/job-name", obj["metadata"]["name"])
        labels.setdefault("job-name", obj["metadata"]["name"])
    elif kind == "Service":
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        digest = hashlib.sha256(obj["metadata"]["name"].encode()).digest()
        spec.setdefault("clusterIP", f"10.96.{digest[0]}.{digest[1] or 1}")
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        for port in spec.get("ports", []):
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port["port"])
    elif kind == "PersistentVolumeClaim":
        spec.setdefault("volumeMode", "Filesystem")
        spec.setdefault("storageClassName", "standard")
    elif kind == "NetworkPolicy":
        spec.setdefault("policyTypes", ["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        for rule in [*spec.get("ingress", []), *spec.get("egress", [])]:
            for port in rule.get("ports", []):
                port.setdefault("protocol", "TCP")


def child_writes(emu: FidelityEmulator, since: int) -> list[Any]:
    """Write requests on the run's child kinds served since index ``since`` of ``emu.writes``."""
    return [w for w in emu.writes[since:] if w.kind in CHILD_KINDS]


def test_server_defaulted_children_cost_the_operator_no_write() -> None:
    async def scenario() -> None:
        ns, app = "team", "rlrun-runs"
        async with serve_kubernetes() as (emu, url):
            emu.defaulter = add_server_defaults
            api = KubeApi(get_api_client(url))
            run = make_run("gitops", ns)
            # As Argo CD applies it with annotation tracking (and, for label tracking, its instance label).
            run["metadata"]["annotations"] = {
                TRACKING_ANNOTATION: f"{app}:{constants.GROUP}/{constants.KIND}:{ns}/gitops"}
            run["metadata"]["labels"] = {constants.LABEL_INSTANCE: app}
            await api.create(run)
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for(lambda: get_status(emu, ns, "gitops").get("phase") == "Initializing")
                children = get_children(emu, ns, "gitops")
                assert len(children) == 14
                # The children are stored as the API server defaults them (not as the operator sent them).
                by_name = {(o["kind"], o["metadata"]["name"]): o for o in children}
                assert by_name["Deployment", "gitops-inference"]["spec"]["progressDeadlineSeconds"] == 600
                assert by_name["Job", "gitops-orchestrator"]["spec"]["backoffLimit"] is not None
                assert by_name["Service", "gitops-router"]["spec"]["clusterIP"]
                assert by_name["StatefulSet", "gitops-trainer"]["spec"]["podManagementPolicy"]
                for obj in children:
                    meta = obj["metadata"]
                    assert TRACKING_ANNOTATION not in (meta.get("annotations") or {}), meta["name"]
                    assert meta["labels"][constants.LABEL_INSTANCE] == "gitops", meta["name"]
                await play_ready(api, emu, ns, "gitops")
                await wait_for(lambda: get_status(emu, ns, "gitops").get("phase") == "Running")
                await wait_for_refreshes(ns, "gitops", 2)
                settled = len(emu.writes)
                await wait_for_refreshes(ns, "gitops", 4)
                assert emu.writes[settled:] == []

                # Argo CD syncs again: the same manifest, new tracking/last-applied annotations (no spec change).
                await api.merge_patch(constants.KIND, ns, "gitops", {"metadata": {"annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": json.dumps(run)}}})
                assert get_run(emu, ns, "gitops")["metadata"]["generation"] == 1
                resynced = len(emu.writes)
                await wait_for_refreshes(ns, "gitops", 4)
                assert emu.writes[resynced:] == []

            # A restarted operator GETs and plans every defaulted child (resume handler): nothing to write.
            restarted = len(emu.writes)
            async with run_operator(url, status_interval=INTERVAL):
                await wait_for_refreshes(ns, "gitops", 5)
            assert emu.writes[restarted:] == []

            # A spec change patches what it changes; the API server defaults the patched children again, and
            # the operator does not answer those defaults with another write.
            async with run_operator(url, status_interval=INTERVAL):
                await api.merge_patch(constants.KIND, ns, "gitops",
                                      {"spec": {"inference": {"vllmArgs": ["--max-num-seqs", "16"]}}})
                await wait_for(lambda: get_status(emu, ns, "gitops").get("observedGeneration") == 2)
                patched = {w.name for w in child_writes(emu, restarted) if w.method == "PATCH"}
                assert "gitops-inference" in patched
                (inference,) = [o for o in emu.find("Deployment", ns) if o["metadata"]["name"] == "gitops-inference"]
                assert inference["spec"]["progressDeadlineSeconds"] == 600  # defaulted again after the patch
                assert inference["spec"]["template"]["spec"]["schedulerName"] == "default-scheduler"
                await play_ready(api, emu, ns, "gitops")
                await wait_for(lambda: get_condition(emu, ns, "gitops", "Ready").get("status") == "True")
                await wait_for_refreshes(ns, "gitops", 2)
                quiet = len(emu.writes)
                await wait_for_refreshes(ns, "gitops", 4)
                assert emu.writes[quiet:] == []
            # Nothing but this test wrote the RLRun's spec: generation 2 is its one spec change above.
            assert get_run(emu, ns, "gitops")["metadata"]["generation"] == 2
            spec_writes = [w for w in emu.writes if w.kind == constants.KIND and w.subresource is None
                           and w.method == "PATCH" and isinstance(w.body, dict) and "spec" in w.body]
            assert len(spec_writes) == 1

    asyncio.run(scenario())
