"""vLLM inference: one Deployment, or prefill and decode Deployments, each behind a headless Service (pure).

The vLLM command line itself (model, parallelism, KV-transfer config kv_producer / kv_consumer, vllmArgs)
is built by the runtime's inference role from the run config; the pod only says which role it plays
(``RLRUN_INFERENCE_ROLE``) and carries the config hash of what that role reads, so a vllmArgs change
rolls the pods.

Replicas of the pool Deployments are the spec's sizes (``inference.replicas``, or
``sizing.size_pd(ratio, replicas)``): the seed at creation, and the target when those size fields change
with autoscaling off. Otherwise the live value is kept (apply.plan_replicas decides; the sizes it compares
are stamped at apply time, never rendered, so they touch no hash).
"""

from __future__ import annotations

from typing import Any

from rlrun_api import constants as c
from .config import get_config_hash
from .metadata import get_metadata, get_selector_labels
from .network import render_service
from .pod import env_value, get_http_probes, get_resources, render_container, render_pod_template
from rlrun_api.sizing import size_pd

PORT_HTTP = "http"
PORT_NIXL = "nixl"

# component -> RLRUN_INFERENCE_ROLE value
INFERENCE_ROLES = {
    c.COMPONENT_INFERENCE: c.INFERENCE_ROLE_BOTH,
    c.COMPONENT_PREFILL: c.INFERENCE_ROLE_PREFILL,
    c.COMPONENT_DECODE: c.INFERENCE_ROLE_DECODE,
}


def get_inference_pools(rlrun: dict[str, Any]) -> dict[str, int]:
    """Inference components and their seed replicas (before suspend), in render order.

    {"inference": inference.replicas} when disaggregation is off, else {"prefill": p, "decode": d}
    from sizing.size_pd(disaggregation.ratio, disaggregation.replicas).

    Raises:
        sizing.SizingError: the ratio or replica budget cannot be split (names the field).
    """
    inference = rlrun["spec"]["inference"]
    dis = inference["disaggregation"]
    if not dis["enabled"]:
        return {c.COMPONENT_INFERENCE: inference["replicas"]}
    size = size_pd(dis["ratio"], dis["replicas"])
    return {c.COMPONENT_PREFILL: size.prefill, c.COMPONENT_DECODE: size.decode}


def get_inference_env(rlrun: dict[str, Any], component: str) -> list[dict[str, Any]]:
    """Env of an inference container (after the base env, so ``$(POD_IP)`` is defined).

    VLLM_SERVER_DEV_MODE=1 turns on vLLM's RL admin endpoints (pause, reload weights, resume). NIXL's side
    channel (the handshake between prefill and decode) listens on NIXL_SIDE_CHANNEL_PORT at the pod IP; it
    is set only for prefill and decode. VLLM_CPU_KVCACHE_SPACE (GiB, vLLM's CPU backend) only when the pod
    has no GPU.
    """
    inference = rlrun["spec"]["inference"]
    env = [
        env_value(c.ENV_INFERENCE_ROLE, INFERENCE_ROLES[component]),
        env_value(c.ENV_INFERENCE_PORT, c.INFERENCE_PORT),
        env_value(c.ENV_VLLM_DEV_MODE, 1),
    ]
    if component != c.COMPONENT_INFERENCE:
        env += [
            env_value(c.ENV_NIXL_SIDE_CHANNEL_PORT, c.NIXL_SIDE_CHANNEL_PORT),
            env_value(c.ENV_NIXL_SIDE_CHANNEL_HOST, f"$({c.ENV_POD_IP})"),
        ]
    if inference["gpusPerReplica"] == 0:
        env.append(env_value(c.ENV_VLLM_CPU_KVCACHE_SPACE, c.CPU_KVCACHE_SPACE_GIB))
    return env


def get_inference_command() -> list[str]:
    """The inference container's command."""
    return ["rlrun-runtime", "inference", "--config", c.CONFIG_PATH]


def render_inference(rlrun: dict[str, Any], names: dict[str, str], claim_name: str) -> tuple[list, list]:
    """(Services, Deployments) of the inference pools, one headless Service + Deployment per component.

    Deployment replicas = the seed of get_inference_pools, 0 when spec.suspend. GPUs = gpusPerReplica.
    Probes: get_inference_probes. The prefill and decode Services publish not-ready pods (the orchestrator
    must reach a joining pod to load the current version into it; the router adds only Ready pods).
    terminationGracePeriodSeconds = INFERENCE_TERMINATION_GRACE_SECONDS: the server drains on SIGTERM.
    With GPUs (gpusPerReplica > 0) the rollout strategy is RollingUpdate with maxSurge 0, maxUnavailable 1
    (get_gpu_rollout): Kubernetes' default (25 % surge) would need spare GPUs for the extra pod and stall
    in a cluster sized for the run; instead one old pod at a time is stopped before its replacement starts.
    CPU pools keep the default.
    """
    spec = rlrun["spec"]
    run_name = rlrun["metadata"]["name"]
    inference = spec["inference"]
    services, deployments = [], []
    for component, seed in get_inference_pools(rlrun).items():
        name = names[component]
        ports = [(PORT_HTTP, c.INFERENCE_PORT)]
        if component != c.COMPONENT_INFERENCE:
            ports.append((PORT_NIXL, c.NIXL_SIDE_CHANNEL_PORT))
        container = render_container(
            rlrun,
            component=component,
            command=get_inference_command(),
            role_env=get_inference_env(rlrun, component),
            ports=ports,
            resources=get_resources(inference.get("resources"), inference["gpusPerReplica"]),
            probes=get_inference_probes(component),
            shm=True,
        )
        template = render_pod_template(
            rlrun,
            component=component,
            container=container,
            config_map_name=names["config"],
            claim_name=claim_name,
            config_hash=get_config_hash(spec, component),
            shm=True,
        )
        # vLLM drains on SIGTERM for up to INFERENCE_DRAIN_SECONDS (Kubernetes' default grace is 30 s).
        template["spec"]["terminationGracePeriodSeconds"] = c.INFERENCE_TERMINATION_GRACE_SECONDS
        services.append(render_service(rlrun, name, component, [(PORT_HTTP, c.INFERENCE_PORT)], headless=True,
                                       publish_not_ready=component != c.COMPONENT_INFERENCE))
        deployments.append(
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": get_metadata(rlrun, name, component),
                "spec": {
                    "replicas": 0 if spec["suspend"] else seed,
                    "selector": {"matchLabels": get_selector_labels(run_name, component)},
                    **({"strategy": get_gpu_rollout()} if inference["gpusPerReplica"] > 0 else {}),
                    "template": template,
                },
            }
        )
    return services, deployments


def get_inference_probes(component: str) -> dict[str, Any]:
    """Probes of an inference container: startup and liveness on vLLM's ``/health`` (the startup probe allows
    an hour for download and load); readiness on ``/health`` for a single pool, and on
    ``constants.INFERENCE_READY_PATH`` for prefill and decode: 200 only while the server serves the version
    the orchestrator last loaded on every engine (``rlrun_runtime.vllm_plugin.ReadinessMiddleware``).

    Why only P/D: a prefill or decode server always starts from the initial model (NIXL's handshake compares
    the ``--model`` path, ``rlrun_runtime.inference.get_start_weights``), so a pod that joins after an update
    (scale-up, or a replaced pod) serves version 0 until the orchestrator's weight loop loads the current
    version into it (it finds the pod through the Service, which publishes not-ready pods); the router's
    Kubernetes discovery adds a pod only once it is Ready, so it gets no traffic before that. A single pool's
    pod starts from the newest published weights and keeps vLLM's ``/health``.
    """
    if component == c.COMPONENT_INFERENCE:
        return get_http_probes("/health", PORT_HTTP)
    return get_http_probes("/health", PORT_HTTP, readiness_path=c.INFERENCE_READY_PATH)


def get_gpu_rollout() -> dict[str, Any]:
    """Deployment strategy of GPU inference pools: replace pods one at a time without a surge pod, so a
    roll never waits for a GPU the cluster does not have (Kubernetes Deployment docs: maxSurge 0 with
    maxUnavailable 1 stops one old pod before starting its replacement)."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def get_inference_endpoints(rlrun: dict[str, Any], names: dict[str, str]) -> str:
    """RLRUN_INFERENCE_ENDPOINTS: comma-separated ``<headless service>:<port>`` of every inference pool."""
    return ",".join(f"{names[component]}:{c.INFERENCE_PORT}" for component in get_inference_pools(rlrun))
