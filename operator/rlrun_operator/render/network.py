"""Services and the inference NetworkPolicy of a run (pure)."""

from __future__ import annotations

from typing import Any

from rlrun_api import constants as c
from .metadata import get_metadata, get_run_selector_labels, get_selector_labels



def render_service(
    rlrun: dict[str, Any],
    name: str,
    component: str,
    ports: list[tuple[str, int]],
    *,
    headless: bool = False,
    publish_not_ready: bool = False,
) -> dict[str, Any]:
    """Service ``name`` selecting ``component``'s pods of the run, one TCP port per (name, port) pair.

    ``headless`` (clusterIP None): the name resolves to every pod's IP, which the orchestrator needs to
    call each inference engine directly and torchrun needs for pod 0's stable DNS name.
    ``publish_not_ready``: publish pods before they are ready (the trainer rendezvous happens before).
    """
    spec: dict[str, Any] = {
        "selector": get_selector_labels(rlrun["metadata"]["name"], component),
        "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports],
    }
    if headless:
        spec["clusterIP"] = "None"
    if publish_not_ready:
        spec["publishNotReadyAddresses"] = True
    return {"apiVersion": "v1", "kind": "Service", "metadata": get_metadata(rlrun, name, component), "spec": spec}


def render_network_policy(rlrun: dict[str, Any], name: str,
                          operator_namespace: str = c.DEFAULT_OPERATOR_NAMESPACE) -> dict[str, Any]:
    """NetworkPolicy ``name`` isolating the run's inference pods (inference, prefill and decode).

    vLLM serves its weight-update endpoints (VLLM_SERVER_DEV_MODE) on the completions port, so ingress
    to these pods is allowed only from (a) pods of the same run (label instance = the run's name, in the
    run's namespace): router, orchestrator, trainer, and prefill<->decode KV transfer on any port,
    NIXL's side channel included; (b) the operator's pods (``app.kubernetes.io/name`` =
    constants.OPERATOR_APP_NAME) in ``operator_namespace`` only (selected by its
    ``kubernetes.io/metadata.name`` label, which the API server sets on every namespace since Kubernetes
    1.22), which scrape /metrics: a pod labelled like the operator in another namespace gets nothing.
    Everything else is denied. Egress is not restricted.
    """
    run_name = rlrun["metadata"]["name"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_INFERENCE),
        "spec": {
            "podSelector": {
                "matchLabels": get_run_selector_labels(run_name),
                "matchExpressions": [
                    {"key": c.LABEL_COMPONENT, "operator": "In", "values": list(c.POOL_COMPONENTS)}
                ],
            },
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": get_run_selector_labels(run_name)}},
                        {
                            "namespaceSelector": {"matchLabels": {c.LABEL_NAMESPACE_NAME: operator_namespace}},
                            "podSelector": {"matchLabels": {c.LABEL_NAME: c.OPERATOR_APP_NAME}},
                        },
                    ]
                }
            ],
        },
    }
