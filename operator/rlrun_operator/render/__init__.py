"""RLRun -> the Kubernetes objects that run it (pure: no I/O, no clock; same input, same output).

``render(rlrun)`` is what the operator applies and what ``rlrun render`` prints. The role-specific parts
live in this package's modules: ``config`` (ConfigMap, config hashes), ``storage`` (PVC, volumes), ``pod``
(containers, pod templates, env contract, security), ``network`` (Services, NetworkPolicy), ``trainer``,
``inference``, ``router``, ``orchestrator``; names, labels and ownerReferences in ``metadata``.
"""

from __future__ import annotations

from typing import Any

from rlrun_api.constants import DEFAULT_OPERATOR_NAMESPACE
from .config import get_config_hash, render_config_map
from .inference import get_inference_pools, render_inference
from .metadata import RenderError, check_run_name, get_child_names
from .network import render_network_policy, render_trainer_network_policy
from .orchestrator import render_orchestrator

from .pod import check_pod_env
from .router import render_router, render_router_rbac
from .storage import get_claim_name, get_storage_defaulted, render_pvc
from .trainer import render_trainer

__all__ = ["RenderError", "get_child_names", "get_config_hash", "get_inference_pools", "render"]

# Kinds in the order render() returns (and the operator applies) them.
APPLY_ORDER = (
    "ConfigMap",
    "PersistentVolumeClaim",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Service",
    "NetworkPolicy",
    "StatefulSet",
    "Deployment",
    "Job",
)


def render(rlrun: dict[str, Any], *, operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE) -> list[dict[str, Any]]:
    """Every child object of a run, in apply order (APPLY_ORDER; within a kind: trainer, inference pools,
    router, orchestrator).

    Args:
        rlrun: a whole RLRun, already defaulted (spec.apply_defaults) and valid against the CRD, with
            metadata.name and metadata.namespace set; the renderer's own default (spec.storage.size, see
            storage.get_storage_defaulted) is filled in here. metadata.uid, when present, gives every child an
            ownerReference (controller) to the run; when absent (``rlrun render``) none is written.
        operator_namespace: the namespace of the operator's pods, the only one whose operator pods the
            inference NetworkPolicy admits (metrics scrapes). Default constants.DEFAULT_OPERATOR_NAMESPACE
            ("rlrun-system", the namespace the README installs the chart in); the operator passes its own
            (constants.ENV_OPERATOR_NAMESPACE, from the downward API).

    Returns:
        Plain dicts (apiVersion, kind, metadata, ...): ConfigMap ``<name>-config``; PVC ``<name>-storage``
        unless spec.storage.claimName; ServiceAccount, Role, RoleBinding ``<name>-router``; Services for
        trainer (headless), inference or prefill + decode (headless), router, orchestrator; NetworkPolicies
        ``<name>-trainer`` (push weight transports only: network.render_trainer_network_policy) and
        ``<name>-inference``; StatefulSet ``<name>-trainer``; Deployments for the inference pools and the
        router; Job ``<name>-orchestrator``. With spec.suspend every workload has 0 replicas and the Job is
        suspended; ConfigMap and PVC stay. Prefill/decode replicas are always the creation seed
        (sizing.size_pd); the operator keeps the live values on update.

    Raises:
        RenderError: metadata.name cannot name the children, or spec.pod.env names a variable rlrun sets.
        sizing.SizingError: the disaggregation ratio/replicas cannot be split.
        Both are ValueErrors whose message names the field and the fix.
    """
    check_run_name(rlrun.get("metadata", {}).get("name"))
    if not rlrun.get("metadata", {}).get("namespace"):
        raise RenderError("metadata.namespace: missing; set the RLRun's namespace (or pass one on the command line)")
    check_pod_env(rlrun["spec"])
    rlrun = get_storage_defaulted(rlrun)
    names = get_child_names(rlrun)
    claim_name = get_claim_name(rlrun, names["storage"])

    config_map = render_config_map(rlrun, names["config"])
    pvc = render_pvc(rlrun, names["storage"])
    rbac = render_router_rbac(rlrun, names["router"])
    trainer_service, statefulset = render_trainer(rlrun, names, claim_name)
    inference_services, inference_deployments = render_inference(rlrun, names, claim_name)
    router_service, router_deployment = render_router(rlrun, names, claim_name)
    orchestrator_service, job = render_orchestrator(rlrun, names, claim_name)
    network_policy = render_network_policy(rlrun, names["network-policy"], operator_namespace)
    trainer_network_policy = render_trainer_network_policy(rlrun, names["trainer-network-policy"])

    objects: list[dict[str, Any]] = [config_map]
    if pvc is not None:
        objects.append(pvc)
    objects += rbac
    objects += [trainer_service, *inference_services, router_service, orchestrator_service]
    if trainer_network_policy is not None:
        objects.append(trainer_network_policy)
    objects.append(network_policy)
    objects.append(statefulset)
    objects += [*inference_deployments, router_deployment]
    objects.append(job)
    return objects
