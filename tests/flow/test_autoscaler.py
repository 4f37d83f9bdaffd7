"""The autoscaler wired into the real operator (kopf over HTTP) against kmock (tests/support/kube.py).

The tests play the cluster: they report the Deployments ready, create Running + Ready pods with loopback IPs
and serve each pod's Prometheus text from a loopback HTTP server whose values they set (prefill queue,
decode queue by reason, running, KV usage; the orchestrator's progress). Idle windows are counted in the
operator's own status refreshes, never in seconds.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube import FidelityEmulator, run_operator, serve_kubernetes, wait_for, wait_for_refreshes
from rlrun_api import constants
from rlrun_operator import metrics as operator_metrics
from rlrun_operator.kubeapi import KubeApi, get_api_client

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.25  # the operator's status refresh interval, seconds (several per autoscaler interval)

pytestmark = pytest.mark.timeout(120)


class MetricsServer:
    """Prometheus text on http://127.0.0.x:port/metrics; ``text`` may be replaced at any time."""

    def __init__(self, port: int, text: str) -> None:
        self.text = text
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: Any) -> None:
                pass

        for _ in range(50):
            self.ip = f"127.0.0.{random.randint(20, 250)}"
            try:
                self.server = ThreadingHTTPServer((self.ip, port), Handler)
                break
            except OSError:
                continue
        else:
            raise RuntimeError("no free 127.0.0.x address for a metrics server")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def vllm_text(waiting: float = 0, running: float = 0, kv: float = 0.0, capacity: float | None = None,
              deferred: float = 0) -> str:
    """A vLLM server's /metrics: decode servers add the waiting queue by reason (capacity, deferred)."""
    lines = [f'vllm:num_requests_waiting{{engine="0"}} {waiting + (deferred if capacity is not None else 0)}',
             f'vllm:num_requests_running{{engine="0"}} {running}', f'vllm:kv_cache_usage_perc{{engine="0"}} {kv}']
    if capacity is not None:
        lines.insert(0, "# TYPE vllm:num_requests_waiting_by_reason gauge")
        lines += [f'vllm:num_requests_waiting_by_reason{{engine="0",reason="capacity"}} {capacity}',
                  f'vllm:num_requests_waiting_by_reason{{engine="0",reason="deferred"}} {deferred}']
    return "\n".join(["# TYPE vllm:num_requests_waiting gauge", "# TYPE vllm:num_requests_running gauge",
                      "# TYPE vllm:kv_cache_usage_perc gauge", *lines]) + "\n"


ORCHESTRATOR_TEXT = (f"{constants.METRIC_STEP} 2\n{constants.METRIC_POLICY_VERSION} 2\n"
                     f"{constants.METRIC_LAST_REWARD} 0.5\n{constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT} 0\n")


def make_run(name: str, namespace: str, dry_run: bool = False) -> dict[str, Any]:
    """examples/rlrun-tiny.yaml, disaggregated 1:1 over 2 replicas, autoscaling on with a 1 s interval, no up
    cooldown and a long down cooldown (nothing shrinks within a test)."""
    run = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
    run["metadata"] = {"name": name, "namespace": namespace}
    run["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:1", "replicas": 2}
    run["spec"]["autoscaling"] = {"enabled": True, "dryRun": dry_run, "maxReplicas": 4,
                                  "prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 3},
                                  "scrapeIntervalSeconds": 1, "upCooldownSeconds": 0, "downCooldownSeconds": 600}
    return run


def one(emu: FidelityEmulator, kind: str, namespace: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in emu.find(kind, namespace) if o["metadata"]["name"] == name]
    return found


def replicas(emu: FidelityEmulator, namespace: str, name: str) -> int:
    return one(emu, "Deployment", namespace, name)["spec"]["replicas"]


def history(emu: FidelityEmulator, namespace: str, name: str) -> list[dict[str, Any]]:
    return (one(emu, constants.KIND, namespace, name).get("status") or {}).get("scalingHistory") or []


def events(emu: FidelityEmulator, namespace: str, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in emu.find("Event", namespace) if e["involvedObject"]["name"] == name and e["reason"] == reason]


async def play_ready(api: KubeApi, emu: FidelityEmulator, namespace: str, name: str) -> None:
    """Be the workload controllers: every workload of the run reports all its replicas ready."""
    for kind in ("Deployment", "StatefulSet", "Job"):
        for obj in emu.find(kind, namespace, f"{constants.LABEL_INSTANCE}={name}"):
            meta = obj["metadata"]
            if kind == "Job":
                status = {"active": 1, "ready": 1}
            else:
                n = obj["spec"].get("replicas", 1)
                status = {"observedGeneration": meta["generation"], "replicas": n, "readyReplicas": n,
                          "updatedReplicas": n, "availableReplicas": n}
            await api.merge_patch(kind, namespace, meta["name"], {"status": status}, subresource="status")


async def create_pod(api: KubeApi, namespace: str, run: str, component: str, ip: str, index: int = 1) -> None:
    """A Running, Ready pod of the run with a loopback podIP."""
    name = f"{run}-{component}-x{index}"
    await api.create({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": name, "namespace": namespace,
                                   "labels": {constants.LABEL_INSTANCE: run, constants.LABEL_COMPONENT: component}},
                      "spec": {"containers": [{"name": "main", "image": "runtime"}]}})
    await api.merge_patch("Pod", namespace, name, {"status": {
        "phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}, subresource="status")


def spec_writes(emu: FidelityEmulator, name: str) -> list[Any]:
    """Writes to the RLRun itself (not its status) that carry a spec."""
    return [w for w in emu.writes if w.kind == constants.KIND and w.name == name and w.subresource is None
            and w.method != "POST" and isinstance(w.body, dict) and "spec" in w.body]


class Cluster:
    """The metrics servers of one run: orchestrator, a prefill pod and a decode pod."""

    def __init__(self) -> None:
        self.orchestrator = MetricsServer(constants.ORCHESTRATOR_METRICS_PORT, ORCHESTRATOR_TEXT)
        self.prefill = MetricsServer(constants.INFERENCE_PORT, vllm_text(waiting=12, running=4, kv=0.5))
        self.decode = MetricsServer(constants.INFERENCE_PORT, vllm_text(running=2, kv=0.3, capacity=0, deferred=6))

    async def create_pods(self, api: KubeApi, namespace: str, run: str) -> None:
        await create_pod(api, namespace, run, constants.COMPONENT_ORCHESTRATOR, self.orchestrator.ip)
        await create_pod(api, namespace, run, constants.COMPONENT_PREFILL, self.prefill.ip)
        await create_pod(api, namespace, run, constants.COMPONENT_DECODE, self.decode.ip)

    def close(self) -> None:
        for server in (self.orchestrator, self.prefill, self.decode):
            server.close()


def test_prefill_heavy_load_grows_prefill_then_holds_and_a_restart_keeps_the_replicas() -> None:
    async def scenario() -> None:
        cluster = Cluster()
        try:
            async with serve_kubernetes() as (emu, url):
                api = KubeApi(get_api_client(url))
                created = await api.create(make_run("auto", "ns1"))
                spec_before = copy.deepcopy(created["spec"])
                async with run_operator(url, status_interval=INTERVAL):
                    await wait_for(lambda: (one(emu, constants.KIND, "ns1", "auto").get("status") or {})
                                   .get("observedGeneration") == 1)
                    await play_ready(api, emu, "ns1", "auto")
                    await cluster.create_pods(api, "ns1", "auto")
                    # Prefill queues 12 per replica (> scaleUpWaiting 4); decode's queue is all deferred
                    # (KV arriving from prefill), which is not decode load: prefill grows, decode does not.
                    await wait_for(lambda: replicas(emu, "ns1", "auto-prefill") == 2, timeout=30)
                    await wait_for(lambda: history(emu, "ns1", "auto"))  # the status write follows the patch
                    assert replicas(emu, "ns1", "auto-decode") == 1
                    (entry,) = history(emu, "ns1", "auto")
                    assert {k: entry[k] for k in ("prefillBefore", "prefill", "decodeBefore", "decode", "action",
                                                  "code", "dryRun")} == {
                        "prefillBefore": 1, "prefill": 2, "decodeBefore": 1, "decode": 1, "action": "grow",
                        "code": "prefill-queue", "dryRun": False}
                    assert entry["inputs"]["prefillWaiting"] == 12 and entry["inputs"]["decodeWaiting"] == 0
                    await wait_for(lambda: events(emu, "ns1", "auto", constants.EVENT_SCALED_PREFILL))
                    assert not events(emu, "ns1", "auto", constants.EVENT_SCALED_DECODE)
                    scale_writes = [w for w in emu.writes if w.kind == "Deployment" and w.method == "PATCH"
                                    and w.subresource is None]
                    assert [(w.name, w.body[-1]) for w in scale_writes] == [
                        ("auto-prefill", {"op": "replace", "path": "/spec/replicas", "value": 2})]
                    labels = {"namespace": "ns1", "name": "auto", "role": "prefill"}
                    assert operator_metrics.REGISTRY.get_sample_value(
                        constants.OPERATOR_METRIC_DESIRED_REPLICAS, labels) == 2
                    assert operator_metrics.REGISTRY.get_sample_value(
                        f"{constants.OPERATOR_METRIC_SCALING_DECISIONS}_total",
                        {"namespace": "ns1", "name": "auto", "action": "grow", "code": "prefill-queue"}) == 1

                    # The new pod comes up; the queue drains. Nothing changes: no write across many ticks
                    # (several autoscaler intervals: balanced holds, the down cooldown keeps prefill at 2).
                    cluster.prefill.text = vllm_text(waiting=0, running=0, kv=0.1)
                    await create_pod(api, "ns1", "auto", constants.COMPONENT_PREFILL, cluster.prefill.ip, index=2)
                    await play_ready(api, emu, "ns1", "auto")
                    await wait_for(lambda: (one(emu, constants.KIND, "ns1", "auto")["status"]["replicas"]
                                            ["prefill"]["ready"]) == 2)
                    await wait_for_refreshes("ns1", "auto", 3)
                    quiet_from = len(emu.writes)
                    await wait_for_refreshes("ns1", "auto", 12)  # 3 s: 3 autoscaler intervals
                    assert emu.writes[quiet_from:] == []
                    assert operator_metrics.REGISTRY.get_sample_value(
                        constants.OPERATOR_METRIC_CURRENT_REPLICAS, labels) == 2

                # A restarted operator keeps the autoscaler's replicas (and rescales nothing at once).
                before = len(emu.writes)
                async with run_operator(url, status_interval=INTERVAL):
                    await wait_for_refreshes("ns1", "auto", 8)
                assert replicas(emu, "ns1", "auto-prefill") == 2
                assert [w for w in emu.writes[before:] if w.kind == "Deployment"] == []
                assert len(history(emu, "ns1", "auto")) == 1
                # The operator never writes the RLRun's spec; no patch ever carries replicas: null.
                assert spec_writes(emu, "auto") == []
                assert one(emu, constants.KIND, "ns1", "auto")["spec"] == spec_before
                assert "None" not in str([w.body for w in emu.writes if w.kind == "Deployment"])
        finally:
            cluster.close()

    asyncio.run(scenario())


def test_dry_run_records_the_decision_once_and_patches_nothing() -> None:
    async def scenario() -> None:
        cluster = Cluster()
        try:
            async with serve_kubernetes() as (emu, url):
                api = KubeApi(get_api_client(url))
                await api.create(make_run("dry", "ns1", dry_run=True))
                async with run_operator(url, status_interval=INTERVAL):
                    await wait_for(lambda: (one(emu, constants.KIND, "ns1", "dry").get("status") or {})
                                   .get("observedGeneration") == 1)
                    await play_ready(api, emu, "ns1", "dry")
                    await cluster.create_pods(api, "ns1", "dry")
                    await wait_for(lambda: history(emu, "ns1", "dry"), timeout=30)
                    (entry,) = history(emu, "ns1", "dry")
                    assert (entry["action"], entry["code"], entry["prefill"], entry["dryRun"]) == (
                        "grow", "prefill-queue", 2, True)
                    await wait_for(lambda: events(emu, "ns1", "dry", constants.EVENT_AUTOSCALER_DRY_RUN))
                    # The same load keeps making the same decision: recorded once, not every interval.
                    await wait_for_refreshes("ns1", "dry", 16)  # 4 s: 4 autoscaler intervals
                    assert len(history(emu, "ns1", "dry")) == 1
                    assert len(events(emu, "ns1", "dry", constants.EVENT_AUTOSCALER_DRY_RUN)) == 1
                    assert replicas(emu, "ns1", "dry-prefill") == 1
                    assert replicas(emu, "ns1", "dry-decode") == 1
                    assert [w for w in emu.writes if w.kind == "Deployment" and w.method == "PATCH"
                            and w.subresource is None] == []
                    # ... although it was decided again (the pools did not move, so pressure came back).
                    assert operator_metrics.REGISTRY.get_sample_value(
                        f"{constants.OPERATOR_METRIC_SCALING_DECISIONS}_total",
                        {"namespace": "ns1", "name": "dry", "action": "grow", "code": "prefill-queue"}) >= 2
                    assert spec_writes(emu, "dry") == []
        finally:
            cluster.close()

    asyncio.run(scenario())
