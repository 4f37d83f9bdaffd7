"""The router: vllm-router Deployment + Service, and the RBAC that lets it discover inference pods (pure).

The runtime's router role builds vllm-router's arguments from the env below and the run config: API and
metrics on 0.0.0.0, Kubernetes pod discovery in RLRUN_NAMESPACE on SERVICE_DISCOVERY_PORT, label selectors
``app.kubernetes.io/instance=<run>`` + component prefill / decode (or inference), P/D mode when
disaggregation is on. Discovery needs get/list/watch on pods, and nothing else: the Role grants exactly
that, in the run's namespace only.
"""

from __future__ import annotations

import copy
from typing import Any

from rlrun_api import constants as c
from .config import get_config_hash
from .metadata import get_metadata, get_selector_labels
from .network import render_service
from .pod import env_value, get_http_probes, get_resources, render_container, render_pod_template

PORT_HTTP = "http"
PORT_METRICS = "metrics"
# vllm-router 0.1.17, measured: /liveness answers 200 while the process serves; /readiness 503 until a
# worker is healthy; /health 503 as soon as ANY worker is unhealthy, so it must not be the liveness check
# (an inference pod restarting would get the router killed).
LIVENESS_PATH = "/liveness"
READINESS_PATH = "/readiness"
POD_DISCOVERY_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def render_router_rbac(rlrun: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """[ServiceAccount, Role, RoleBinding], all named ``name``: get/list/watch on pods in the run's namespace."""
    namespace = rlrun["metadata"]["namespace"]
    meta = get_metadata(rlrun, name, c.COMPONENT_ROUTER)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": get_metadata(rlrun, name, c.COMPONENT_ROUTER),
            "rules": copy.deepcopy(POD_DISCOVERY_RULES),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": get_metadata(rlrun, name, c.COMPONENT_ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def get_router_env() -> list[dict[str, Any]]:
    """Env of the router container (RLRUN_NAMESPACE comes with the base env, from the downward API)."""
    return [
        env_value(c.ENV_ROUTER_DISCOVERY, c.ROUTER_DISCOVERY_KUBERNETES),
        env_value(c.ENV_ROUTER_PORT, c.ROUTER_PORT),
        env_value(c.ENV_ROUTER_METRICS_PORT, c.ROUTER_METRICS_PORT),
    ]


def render_router(rlrun: dict[str, Any], names: dict[str, str], claim_name: str) -> tuple[dict, dict]:
    """(Service, Deployment) named names["router"]: 1 replica (0 when spec.suspend), the router's own
    ServiceAccount, ports ROUTER_PORT and ROUTER_METRICS_PORT; liveness on /liveness, readiness on
    /readiness (at least one healthy inference worker)."""
    spec = rlrun["spec"]
    run_name = rlrun["metadata"]["name"]
    name = names["router"]
    ports = [(PORT_HTTP, c.ROUTER_PORT), (PORT_METRICS, c.ROUTER_METRICS_PORT)]
    container = render_container(
        rlrun,
        component=c.COMPONENT_ROUTER,
        command=["rlrun-runtime", "router", "--config", c.CONFIG_PATH],
        role_env=get_router_env(),
        ports=ports,
        resources=get_resources(spec["router"].get("resources"), 0),
        probes=get_http_probes(LIVENESS_PATH, PORT_HTTP, READINESS_PATH),
        shm=False,
    )
    template = render_pod_template(
        rlrun,
        component=c.COMPONENT_ROUTER,
        container=container,
        config_map_name=names["config"],
        claim_name=claim_name,
        config_hash=get_config_hash(spec, c.COMPONENT_ROUTER),
        shm=False,
        service_account=name,
    )
    service = render_service(rlrun, name, c.COMPONENT_ROUTER, ports)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_ROUTER),
        "spec": {
            "replicas": 0 if spec["suspend"] else 1,
            "selector": {"matchLabels": get_selector_labels(run_name, c.COMPONENT_ROUTER)},
            "template": template,
        },
    }
    return service, deployment
