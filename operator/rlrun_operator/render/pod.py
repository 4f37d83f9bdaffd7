"""Pod templates and containers shared by every role of a run (pure).

Every container runs spec.image with the run config mounted read-only, the shared storage mounted
read-write, and the env contract of docs/runtime-contract.md: ``RLRUN_CONFIG``, ``RLRUN_STORAGE_DIR``,
``RLRUN_RUN_NAME``, ``RLRUN_NAMESPACE`` and ``POD_IP`` (both from the downward API), then the role's own
variables, then ``HF_HUB_CACHE`` on the shared storage (Hugging Face model ids), then spec.pod.env and
spec.pod.envFrom. Pods run as a non-root user with the restricted Pod
Security Standard's settings (runAsNonRoot, no privilege escalation, all capabilities dropped, seccomp
RuntimeDefault), and fsGroup so the shared claim is writable.
"""

from __future__ import annotations

import copy
from typing import Any

from rlrun_api import constants as c
from rlrun_api import validation
from .metadata import RenderError, get_labels
from .storage import get_model_cache_dir, get_volume_mounts, get_volumes

GPU_RESOURCE = "nvidia.com/gpu"

# Probe timing. A model download plus load can take many minutes, so a startup probe holds off liveness:
# up to STARTUP_SECONDS before the first successful check, then liveness restarts a container that stops
# answering for LIVENESS_FAILURES x PERIOD_SECONDS.
PERIOD_SECONDS = 10
STARTUP_SECONDS = 3600
LIVENESS_FAILURES = 6
PROBE_TIMEOUT_SECONDS = 5


def env_value(name: str, value: Any) -> dict[str, Any]:
    """A core/v1 EnvVar with a literal value (stringified)."""
    return {"name": name, "value": str(value)}


def env_field(name: str, field_path: str) -> dict[str, Any]:
    """A core/v1 EnvVar from the downward API (``fieldRef.fieldPath``)."""
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def get_base_env(rlrun: dict[str, Any]) -> list[dict[str, Any]]:
    """The variables every container of the run gets first (see the module docstring)."""
    return [
        env_value(c.ENV_CONFIG, c.CONFIG_PATH),
        env_value(c.ENV_STORAGE_DIR, rlrun["spec"]["storage"]["mountPath"]),
        env_value(c.ENV_RUN_NAME, rlrun["metadata"]["name"]),
        env_field(c.ENV_NAMESPACE, "metadata.namespace"),
        env_field(c.ENV_POD_IP, "status.podIP"),
    ]


def check_pod_env(spec: dict[str, Any]) -> None:
    """Refuse spec.pod.env entries that would replace a variable of the role contract
    (``constants.RESERVED_ENV_NAMES``; the rule is ``rlrun_api.validation.check_pod_env``).

    Raises:
        RenderError: naming ``spec.pod.env[i].name`` and the fix.
    """
    errors = validation.check_pod_env(spec.get("pod") or {})
    if errors:
        raise RenderError(str(errors[0]))


def get_env(rlrun: dict[str, Any], role_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Base env + ``role_env`` + the model cache (``HF_HUB_CACHE``, storage.get_model_cache_dir, when it
    applies) + spec.pod.env, in that order (later entries may use ``$(EARLIER)``; a spec.pod.env entry named
    HF_HUB_CACHE comes later and wins, the kubelet keeping the last value of a name); render() has refused a
    spec.pod.env that names a reserved variable (check_pod_env) before any container is built."""
    user = rlrun["spec"].get("pod", {}).get("env") or []
    cache_dir = get_model_cache_dir(rlrun["spec"])
    cache = [env_value(c.ENV_HF_HUB_CACHE, cache_dir)] if cache_dir else []
    return get_base_env(rlrun) + [copy.deepcopy(e) for e in role_env] + cache + copy.deepcopy(user)


def get_resources(extra: dict[str, Any] | None, gpus: int) -> dict[str, Any]:
    """Container resources: ``extra`` (requests/limits from the spec) with ``nvidia.com/gpu`` = gpus when > 0.

    GPUs are an extended resource: requests must equal limits, so both are set; a GPU count in ``extra``
    is replaced (the spec's gpusPerNode / gpusPerReplica is the only source of GPU counts).
    """
    out = copy.deepcopy(extra) if extra else {}
    for key in ("requests", "limits"):
        if gpus > 0:
            out.setdefault(key, {})[GPU_RESOURCE] = gpus
        elif key in out:
            out[key].pop(GPU_RESOURCE, None)
    return out


def get_http_probes(path: str, port_name: str, readiness_path: str | None = None) -> dict[str, Any]:
    """startupProbe, readinessProbe and livenessProbe: ``httpGet path`` on the named container port
    (readiness on ``readiness_path`` when given)."""

    def probe(failure_threshold: int, path: str = path) -> dict[str, Any]:
        return {
            "httpGet": {"path": path, "port": port_name},
            "timeoutSeconds": PROBE_TIMEOUT_SECONDS,
            "periodSeconds": PERIOD_SECONDS,
            "failureThreshold": failure_threshold,
        }

    return {
        "startupProbe": probe(STARTUP_SECONDS // PERIOD_SECONDS),
        "readinessProbe": probe(3, readiness_path or path),
        "livenessProbe": probe(LIVENESS_FAILURES),
    }


def get_container_security_context() -> dict[str, Any]:
    """Container securityContext meeting the restricted Pod Security Standard."""
    return {
        "runAsNonRoot": True,
        "runAsUser": c.RUNTIME_UID,
        "runAsGroup": c.RUNTIME_GID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def get_pod_security_context() -> dict[str, Any]:
    """Pod securityContext: non-root, fsGroup (the shared claim is group-writable), seccomp RuntimeDefault.

    fsGroupChangePolicy OnRootMismatch skips the recursive ownership change of a large claim on every start.
    """
    return {
        "runAsNonRoot": True,
        "runAsUser": c.RUNTIME_UID,
        "runAsGroup": c.RUNTIME_GID,
        "fsGroup": c.RUNTIME_GID,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def render_container(
    rlrun: dict[str, Any],
    *,
    component: str,
    command: list[str],
    role_env: list[dict[str, Any]],
    ports: list[tuple[str, int]],
    resources: dict[str, Any],
    probes: dict[str, Any],
    shm: bool,
) -> dict[str, Any]:
    """One role's container (named after the component).

    Args:
        ports: (name, containerPort) pairs, TCP.
        probes: from get_http_probes.
        shm: mount a memory-backed /dev/shm.
    """
    spec = rlrun["spec"]
    container: dict[str, Any] = {
        "name": component,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": list(command),
        "env": get_env(rlrun, role_env),
    }
    env_from = spec.get("pod", {}).get("envFrom")
    if env_from:
        container["envFrom"] = copy.deepcopy(env_from)
    container["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports]
    if resources:
        container["resources"] = resources
    container.update(copy.deepcopy(probes))
    container["volumeMounts"] = get_volume_mounts(rlrun, shm)
    container["securityContext"] = get_container_security_context()
    return container


def render_pod_template(
    rlrun: dict[str, Any],
    *,
    component: str,
    container: dict[str, Any],
    config_map_name: str,
    claim_name: str,
    config_hash: str,
    shm: bool,
    service_account: str | None = None,
    restart_policy: str | None = None,
) -> dict[str, Any]:
    """PodTemplateSpec of one role.

    Labels: the five standard ones for ``component``. Annotation ``constants.ANNOTATION_CONFIG_HASH`` =
    ``config_hash``. spec.pod's nodeSelector, tolerations, affinity and priorityClassName apply to every
    pod. ``service_account`` (the router's own) replaces spec.pod.serviceAccountName and is the only
    case where the API token is mounted: no other role talks to the Kubernetes API.
    """
    spec = rlrun["spec"]
    pod_overrides = spec.get("pod", {})
    pod: dict[str, Any] = {}
    if service_account:
        pod["serviceAccountName"] = service_account
        pod["automountServiceAccountToken"] = True
    else:
        if pod_overrides.get("serviceAccountName"):
            pod["serviceAccountName"] = pod_overrides["serviceAccountName"]
        pod["automountServiceAccountToken"] = False
    pod["enableServiceLinks"] = False
    if restart_policy:
        pod["restartPolicy"] = restart_policy
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        if pod_overrides.get(key):
            pod[key] = copy.deepcopy(pod_overrides[key])
    if spec.get("imagePullSecrets"):
        pod["imagePullSecrets"] = [{"name": s["name"]} for s in spec["imagePullSecrets"]]
    pod["securityContext"] = get_pod_security_context()
    pod["containers"] = [container]
    pod["volumes"] = get_volumes(config_map_name, claim_name, shm)
    return {
        "metadata": {
            "labels": get_labels(rlrun["metadata"]["name"], component),
            "annotations": {c.ANNOTATION_CONFIG_HASH: config_hash},
        },
        "spec": pod,
    }
