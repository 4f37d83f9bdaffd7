"""The orchestrator: a Job (its completion is the run's completion) and a Service for its metrics (pure).

The orchestrator sends completions through the router, calls every inference engine directly for weight
updates (the headless Services resolve to every pod) and serves its progress as Prometheus metrics on
ORCHESTRATOR_METRICS_PORT, which the operator scrapes. A Job's pod template is immutable: when the
orchestrator's config hash changes, the operator must recreate the Job (the orchestrator resumes from
its state file on storage).
"""

from __future__ import annotations

from typing import Any

from rlrun_api import constants as c
from .config import get_config_hash
from .inference import get_inference_endpoints, get_inference_pools
from .metadata import get_metadata
from .network import render_service
from .pod import env_value, get_http_probes, get_resources, render_container, render_pod_template

PORT_METRICS = "metrics"
# Pod restarts tolerated before the Job, and so the run, fails (restartPolicy OnFailure counts container
# restarts against it).
BACKOFF_LIMIT = 4


def get_orchestrator_env(rlrun: dict[str, Any], names: dict[str, str]) -> list[dict[str, Any]]:
    """RLRUN_ROUTER_URL (completions), RLRUN_INFERENCE_ENDPOINTS (admin calls), with disaggregation
    RLRUN_PREFILL_ENDPOINTS (the prefill pool among them: the P/D order of a weight update), RLRUN_METRICS_PORT,
    and the W&B API key of spec.tracking (:func:`get_tracking_env`)."""
    env = [
        env_value(c.ENV_ROUTER_URL, f"http://{names['router']}:{c.ROUTER_PORT}"),
        env_value(c.ENV_INFERENCE_ENDPOINTS, get_inference_endpoints(rlrun, names)),
    ]
    if c.COMPONENT_PREFILL in get_inference_pools(rlrun):
        env.append(env_value(c.ENV_PREFILL_ENDPOINTS, f"{names[c.COMPONENT_PREFILL]}:{c.INFERENCE_PORT}"))
    return env + [env_value(c.ENV_METRICS_PORT, c.ORCHESTRATOR_METRICS_PORT)] + get_tracking_env(rlrun)


def get_tracking_env(rlrun: dict[str, Any]) -> list[dict[str, Any]]:
    """``WANDB_API_KEY`` from the Secret that spec.tracking.wandb.apiKeySecret names (``secretKeyRef`` name and
    key, the key defaulted by the CRD to ``constants.DEFAULT_WANDB_API_KEY_SECRET_KEY``), when W&B is enabled
    and a Secret is named; otherwise nothing (runs without spec.tracking render as before)."""
    wandb = (rlrun["spec"].get("tracking") or {}).get("wandb") or {}
    secret = wandb.get("apiKeySecret")
    if not wandb.get("enabled") or not secret:
        return []
    return [{"name": c.ENV_WANDB_API_KEY, "valueFrom": {"secretKeyRef": {
        "name": secret["name"], "key": secret.get("key", c.DEFAULT_WANDB_API_KEY_SECRET_KEY)}}}]


def render_orchestrator(rlrun: dict[str, Any], names: dict[str, str], claim_name: str) -> tuple[dict, dict]:
    """(Service, Job) named names["orchestrator"].

    Job: one pod, restartPolicy OnFailure, backoffLimit BACKOFF_LIMIT, ``suspend: true`` when spec.suspend
    (resuming sets it back to false). Probes on /metrics.
    """
    spec = rlrun["spec"]
    name = names["orchestrator"]
    ports = [(PORT_METRICS, c.ORCHESTRATOR_METRICS_PORT)]
    container = render_container(
        rlrun,
        component=c.COMPONENT_ORCHESTRATOR,
        command=["rlrun-runtime", "orchestrator", "--config", c.CONFIG_PATH],
        role_env=get_orchestrator_env(rlrun, names),
        ports=ports,
        resources=get_resources(spec["orchestrator"].get("resources"), 0),
        probes=get_http_probes("/metrics", PORT_METRICS),
        shm=False,
    )
    template = render_pod_template(
        rlrun,
        component=c.COMPONENT_ORCHESTRATOR,
        container=container,
        config_map_name=names["config"],
        claim_name=claim_name,
        config_hash=get_config_hash(spec, c.COMPONENT_ORCHESTRATOR),
        shm=False,
        restart_policy="OnFailure",
    )
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_ORCHESTRATOR),
        "spec": {
            "suspend": bool(spec["suspend"]),
            "backoffLimit": BACKOFF_LIMIT,
            "completions": 1,
            "parallelism": 1,
            "template": template,
        },
    }
    return render_service(rlrun, name, c.COMPONENT_ORCHESTRATOR, ports), job
