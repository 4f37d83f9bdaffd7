"""The trainer: a headless Service and a StatefulSet running torchrun, one pod per node (pure)."""

from __future__ import annotations

from typing import Any

from rlrun_api import constants as c
from .config import get_config_hash
from .metadata import get_metadata, get_selector_labels
from .network import render_service
from .pod import env_field, env_value, get_http_probes, get_resources, render_container, render_pod_template

PORT_RENDEZVOUS = "rendezvous"
PORT_METRICS = c.TRAINER_METRICS_PORT_NAME  # also what the trainer NetworkPolicy admits from anywhere


def get_trainer_command() -> list[str]:
    """torchrun's command line; ``$(VAR)`` is expanded by the kubelet from the container env (and by
    ``rlrun local``). torchrun's flags are documented in PyTorch's "torchrun (Elastic Launch)" page."""
    return [
        "torchrun",
        f"--nnodes=$({c.ENV_NNODES})",
        f"--nproc-per-node=$({c.ENV_NPROC_PER_NODE})",
        f"--node-rank=$({c.ENV_NODE_RANK})",
        f"--master-addr=$({c.ENV_MASTER_ADDR})",
        f"--master-port=$({c.ENV_MASTER_PORT})",
        "-m",
        "rlrun_runtime",
        "trainer",
        "--config",
        c.CONFIG_PATH,
    ]


def get_trainer_env(rlrun: dict[str, Any], service_name: str, statefulset_name: str) -> list[dict[str, Any]]:
    """torchrun's rendezvous env.

    NNODES = trainer.nodes; NPROC_PER_NODE = trainer.gpusPerNode, or 1 on CPU; NODE_RANK = the pod's
    ordinal (label ``apps.kubernetes.io/pod-index``, set by the StatefulSet controller since Kubernetes
    1.28); MASTER_ADDR = pod 0's stable DNS name ``<statefulset>-0.<headless service>``.
    """
    trainer = rlrun["spec"]["trainer"]
    return [
        env_value(c.ENV_NNODES, trainer["nodes"]),
        env_value(c.ENV_NPROC_PER_NODE, trainer["gpusPerNode"] or 1),
        env_field(c.ENV_NODE_RANK, f"metadata.labels['{c.LABEL_POD_INDEX}']"),
        env_value(c.ENV_MASTER_ADDR, f"{statefulset_name}-0.{service_name}"),
        env_value(c.ENV_MASTER_PORT, c.TRAINER_MASTER_PORT),
        env_value(c.ENV_TRAINER_METRICS_PORT, c.TRAINER_METRICS_PORT),
    ]


def render_trainer(rlrun: dict[str, Any], names: dict[str, str], claim_name: str) -> list[dict[str, Any]]:
    """[headless Service, StatefulSet], both named names["trainer"].

    The Service publishes not-ready pods, because the rendezvous on pod 0 happens before any pod is ready.
    The StatefulSet has replicas = trainer.nodes (0 when spec.suspend), podManagementPolicy Parallel (all
    nodes start together; torchrun waits for every one), GPUs = trainer.gpusPerNode. Probes hit /metrics
    on TRAINER_METRICS_PORT. With a push weight transport (gloo, nccl) the pods and the Service also expose
    WEIGHT_PUSH_PORT.
    """
    spec = rlrun["spec"]
    run_name = rlrun["metadata"]["name"]
    name = names["trainer"]
    ports = [(PORT_RENDEZVOUS, c.TRAINER_MASTER_PORT), (PORT_METRICS, c.TRAINER_METRICS_PORT)]
    if spec["weightSync"]["transport"] in c.PUSH_TRANSPORTS:
        # The push transports: rank 0's TCPStore, which the orchestrator and the inference workers dial
        # (docs/weight-transport.md). Their gloo/NCCL data connections use ephemeral ports.
        ports.append((c.WEIGHT_PUSH_PORT_NAME, c.WEIGHT_PUSH_PORT))
    container = render_container(
        rlrun,
        component=c.COMPONENT_TRAINER,
        command=get_trainer_command(),
        role_env=get_trainer_env(rlrun, name, name),
        ports=ports,
        resources=get_resources(spec["trainer"].get("resources"), spec["trainer"]["gpusPerNode"]),
        probes=get_http_probes("/metrics", PORT_METRICS),
        shm=True,
    )
    template = render_pod_template(
        rlrun,
        component=c.COMPONENT_TRAINER,
        container=container,
        config_map_name=names["config"],
        claim_name=claim_name,
        config_hash=get_config_hash(spec, c.COMPONENT_TRAINER),
        shm=True,
    )
    service = render_service(rlrun, name, c.COMPONENT_TRAINER, ports, headless=True, publish_not_ready=True)
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_TRAINER),
        "spec": {
            "replicas": 0 if spec["suspend"] else spec["trainer"]["nodes"],
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": get_selector_labels(run_name, c.COMPONENT_TRAINER)},
            "template": template,
        },
    }
    return [service, statefulset]
