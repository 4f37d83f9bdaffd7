"""What the operator observes about a run: its workloads and pods (API reads) and the Prometheus metrics
of its orchestrator and inference pods (HTTP scrapes). Parsing is pure (`get_*`); reading is `read_*`.

The orchestrator pod is found by the labels instance=<run> and component=orchestrator; its metrics are at
``http://<status.podIP>:<constants.ORCHESTRATOR_METRICS_PORT>/metrics`` (metric names in constants). The
queue depth of an inference pool is the sum of vLLM's ``vllm:num_requests_waiting`` over its running pods,
scraped at ``http://<podIP>:<constants.INFERENCE_PORT>/metrics`` and read with ``rlrun_api.prometheus``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rlrun_api import constants
from rlrun_api.prometheus import get_samples
from rlrun_operator import autoscale
from rlrun_operator.kubeapi import KubeApi
from rlrun_operator.status import Progress, find_role

SCRAPE_TIMEOUT_S = 2.0
WORKLOAD_KINDS = ("StatefulSet", "Deployment", "Job")


def get_run_labels(name: str) -> dict[str, str]:
    """Labels that select every child of run ``name`` made by this operator."""
    return {constants.LABEL_INSTANCE: name, constants.LABEL_MANAGED_BY: constants.MANAGED_BY}


def get_progress(text: str) -> Progress:
    """The orchestrator's progress (constants.METRIC_STEP, METRIC_POLICY_VERSION, METRIC_LAST_REWARD,
    METRIC_WEIGHT_UPDATE_IN_FLIGHT, METRIC_STALLED_ENGINES, METRIC_ENGINES_OUT_OF_SERVICE, and of the held-out
    evaluation METRIC_EVAL_REWARD, METRIC_EVAL_POLICY_VERSION) from its /metrics text; absent metrics are None."""
    samples = get_samples(text)

    def pick(name: str) -> float | None:
        return samples.get(name)

    step, version = pick(constants.METRIC_STEP), pick(constants.METRIC_POLICY_VERSION)
    reward, flight = pick(constants.METRIC_LAST_REWARD), pick(constants.METRIC_WEIGHT_UPDATE_IN_FLIGHT)
    stalled, paused = pick(constants.METRIC_STALLED_ENGINES), pick(constants.METRIC_ENGINES_OUT_OF_SERVICE)
    eval_reward, eval_version = pick(constants.METRIC_EVAL_REWARD), pick(constants.METRIC_EVAL_POLICY_VERSION)
    return Progress(step=None if step is None else int(step),
                    policy_version=None if version is None else int(version),
                    last_reward=reward, weight_update_in_flight=None if flight is None else flight > 0,
                    stalled_engines=None if stalled is None else int(stalled),
                    engines_out_of_service=None if paused is None else int(paused),
                    eval_reward=eval_reward, eval_policy_version=None if eval_version is None else int(eval_version))


def get_pod_targets(pods: list[dict[str, Any]]) -> tuple[str | None, dict[str, list[str]]]:
    """(orchestrator metrics URL or None, {pool component: [inference metrics URL, ...]}) from the run's
    pods; only Running pods with a podIP count (pure)."""
    orchestrator: str | None = None
    pools: dict[str, list[str]] = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or (pod.get("status") or {}).get("phase") != "Running":
            continue
        component = (pod.get("metadata", {}).get("labels") or {}).get(constants.LABEL_COMPONENT)
        if component == constants.COMPONENT_ORCHESTRATOR:
            orchestrator = f"http://{ip}:{constants.ORCHESTRATOR_METRICS_PORT}/metrics"
        elif component in constants.POOL_COMPONENTS:
            pools.setdefault(component, []).append(f"http://{ip}:{constants.INFERENCE_PORT}/metrics")
    return orchestrator, pools


def get_orchestrator_failure(pods: list[dict[str, Any]]) -> str | None:
    """The termination message of the orchestrator's most recent failed container (pure), or None.

    The orchestrator writes why it gave up (e.g. "3 consecutive batches without a trainable sample ...;
    environment builtin/reverse-words ...") to ``/dev/termination-log`` (constants.TERMINATION_MESSAGE_PATH);
    the kubelet copies it into ``status.containerStatuses[].state.terminated.message`` (or
    ``lastState.terminated`` once the container restarted). Of several pods, the latest ``finishedAt`` wins.
    """
    found: list[tuple[str, str]] = []
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        if labels.get(constants.LABEL_COMPONENT) != constants.COMPONENT_ORCHESTRATOR:
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            for key in ("state", "lastState"):
                terminated = (container.get(key) or {}).get("terminated") or {}
                message = str(terminated.get("message") or "").strip()
                if message and terminated.get("exitCode", 0) != 0:
                    found.append((str(terminated.get("finishedAt") or ""), message))
    return max(found)[1] if found else None


# The run's other child kinds (what the drift check lists besides the workloads).
OTHER_CHILD_KINDS = ("ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Service",
                     "NetworkPolicy")


async def read_children(api: KubeApi, namespace: str, name: str,
                        kinds: tuple[str, ...] = OTHER_CHILD_KINDS) -> list[dict[str, Any]]:
    """The run's objects of ``kinds`` (``kind`` filled in), by label selector, one list call per kind."""
    labels = get_run_labels(name)
    lists = await asyncio.gather(*(api.list(kind, namespace, labels) for kind in kinds))
    return [{**obj, "kind": obj.get("kind") or kind} for kind, items in zip(kinds, lists) for obj in items]


async def read_workloads(api: KubeApi, namespace: str, name: str) -> list[dict[str, Any]]:
    """The run's StatefulSets, Deployments and Jobs (``kind`` filled in), by label selector."""
    return await read_children(api, namespace, name, WORKLOAD_KINDS)


async def read_pods(api: KubeApi, namespace: str, name: str) -> list[dict[str, Any]]:
    """The run's pods (label instance=<name>; pods carry no managed-by guarantee from every controller)."""
    return await api.list("Pod", namespace, {constants.LABEL_INSTANCE: name})


async def read_metrics_text(session: aiohttp.ClientSession, url: str,
                            timeout_s: float = SCRAPE_TIMEOUT_S) -> str | None:
    """GET a /metrics URL; None on any connection error, timeout or non-200 answer."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return None
            return await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


@dataclass(frozen=True)
class Scrape:
    """One scrape of a run: the orchestrator's progress and queue depth per pool (as before), plus the texts
    read (by URL; unreachable ones absent) for the autoscaler's observations."""

    progress: Progress | None = None
    depth: dict[str, float] = field(default_factory=dict)
    texts: dict[str, str] = field(default_factory=dict)
    orchestrator_url: str | None = None


async def read_scrape(session: aiohttp.ClientSession, pods: list[dict[str, Any]]) -> Scrape:
    """Scrape the orchestrator (progress, None when unreachable or unparsable) and every running inference
    pod (queue depth per pool: sum of vllm:num_requests_waiting; pools with no readable pod are absent), with
    the texts kept (one GET per running pod with a podIP)."""
    orchestrator, pools = get_pod_targets(pods)
    urls = ([orchestrator] if orchestrator else []) + [u for us in pools.values() for u in us]
    texts = dict(zip(urls, await asyncio.gather(*(read_metrics_text(session, u) for u in urls))))
    progress = None
    if orchestrator and texts.get(orchestrator) is not None:
        try:
            progress = get_progress(texts[orchestrator] or "")
        except ValueError:
            progress = None
    depth: dict[str, float] = {}
    for pool, pool_urls in pools.items():
        for url in pool_urls:
            text = texts.get(url)
            if text is None:
                continue
            try:
                waiting = get_samples(text).get(constants.VLLM_METRIC_WAITING)
            except ValueError:
                continue
            if waiting is not None:
                depth[pool] = depth.get(pool, 0.0) + waiting
    return Scrape(progress=progress, depth=depth, texts={u: t for u, t in texts.items() if t is not None},
                  orchestrator_url=orchestrator)


def is_pod_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True and it is not terminating (a warming-up or stopping pod is not)."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def get_pool_observation(workloads: list[dict[str, Any]], pods: list[dict[str, Any]], scrape: Scrape,
                         pool: str) -> autoscale.PoolObservation:
    """A pool's Deployment (desired = spec.replicas, the live value: a hand edit is the current value; ready
    = status.readyReplicas once the controller observed the current generation, else 0) and one sample per
    Running pod whose /metrics was read (pods not Ready are marked warming). Pure."""
    obj = find_role(workloads, pool) or {}
    spec_replicas = (obj.get("spec") or {}).get("replicas", 1)
    desired = int(spec_replicas) if isinstance(spec_replicas, (int, float)) else 1
    st = obj.get("status") or {}
    observed = st.get("observedGeneration") == obj.get("metadata", {}).get("generation")
    ready = int(st.get("readyReplicas") or 0) if observed else 0
    samples = []
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if labels.get(constants.LABEL_COMPONENT) != pool or not ip or (pod.get("status") or {}).get("phase") != "Running":
            continue
        text = scrape.texts.get(f"http://{ip}:{constants.INFERENCE_PORT}/metrics")
        if text is None:
            continue  # unreachable: unknown, not a sample
        try:
            samples.append(autoscale.get_pod_sample(pod["metadata"].get("name", ""), pool, text,
                                                    warming=not is_pod_ready(pod)))
        except ValueError:
            continue
    return autoscale.PoolObservation(desired=desired, ready=ready, pods=tuple(samples))


def get_observations(workloads: list[dict[str, Any]], pods: list[dict[str, Any]],
                     scrape: Scrape) -> autoscale.Observations:
    """The autoscaler's Observations of a disaggregated run (pure); the orchestrator's loop sample is None
    when it could not be read (its absent counters read as 0, absent resume time as None)."""
    loop = None
    text = scrape.texts.get(scrape.orchestrator_url or "")
    if text is not None:
        try:
            loop = autoscale.get_loop_sample(text)
        except ValueError:
            loop = None
    return autoscale.Observations(
        prefill=get_pool_observation(workloads, pods, scrape, constants.COMPONENT_PREFILL),
        decode=get_pool_observation(workloads, pods, scrape, constants.COMPONENT_DECODE), loop=loop)
