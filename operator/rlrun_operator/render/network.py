"""Services and the NetworkPolicies of a run: the inference pods' (always) and the trainer pods' (push weight
transports) (pure)."""

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


def render_trainer_network_policy(rlrun: dict[str, Any], name: str) -> dict[str, Any] | None:
    """NetworkPolicy ``name`` isolating the run's trainer pods, for the push weight transports
    (spec.weightSync.transport in constants.PUSH_TRANSPORTS); None for the filesystem transport (no policy
    selects its trainer pods: their ingress is not restricted, as before push transports existed).

    A push joins trainer rank 0 and every inference worker in one gloo (or NCCL) group per engine: the workers
    dial rank 0's TCPStore on the fixed, named port constants.WEIGHT_PUSH_PORT_NAME (29600), and the group's
    data connections then use ephemeral ports in both directions. Ingress to the trainer pods is therefore
    allowed for (a) all TCP from the run's trainer pods (torchrun's rendezvous on TRAINER_MASTER_PORT and the
    ranks' own connections) and its inference pods (inference, prefill, decode; same namespace, label
    instance = the run's name); (b) the orchestrator of the run on WEIGHT_PUSH_PORT_NAME only (it posts push
    requests to the store); (c) anyone on the metrics port (TRAINER_METRICS_PORT_NAME: read-only Prometheus
    text, scraped by the chart's PodMonitor from Prometheus' namespace). Everything else is denied; egress is
    not restricted. The inference pods' own policy (render_network_policy) already admits every pod of the
    run on any port, so together all TCP between the run's trainer and inference pods is admitted and none
    from outside the run reaches those ports.
    """
    if rlrun["spec"]["weightSync"]["transport"] not in c.PUSH_TRANSPORTS:
        return None
    run_name = rlrun["metadata"]["name"]
    peers = {
        "matchLabels": get_run_selector_labels(run_name),
        "matchExpressions": [{"key": c.LABEL_COMPONENT, "operator": "In",
                              "values": [c.COMPONENT_TRAINER, *c.POOL_COMPONENTS]}],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_TRAINER),
        "spec": {
            "podSelector": {"matchLabels": get_selector_labels(run_name, c.COMPONENT_TRAINER)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": peers}], "ports": [{"protocol": "TCP"}]},
                {
                    "from": [{"podSelector": {"matchLabels": get_selector_labels(run_name, c.COMPONENT_ORCHESTRATOR)}}],
                    "ports": [{"protocol": "TCP", "port": c.WEIGHT_PUSH_PORT_NAME}],
                },
                {"ports": [{"protocol": "TCP", "port": c.TRAINER_METRICS_PORT_NAME}]},
            ],
        },
    }
