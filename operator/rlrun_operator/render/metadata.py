"""Names, labels, selectors and ownerReferences of an RLRun's children (pure).

Every child of a run is named ``<run name>-<suffix>`` (deterministic: no ``generateName``) and carries the
five ``app.kubernetes.io`` labels below. The run's own labels are never copied: they may hold a GitOps
tool's tracking label (Argo CD's ``app.kubernetes.io/instance``), and copying it would make the tool
think it owns the children.
"""

from __future__ import annotations

from typing import Any

from rlrun_api import constants as c
from rlrun_api.names import DNS_1035_LABEL, MAX_RUN_NAME_LENGTH


class RenderError(ValueError):
    """The RLRun cannot be rendered into valid Kubernetes objects; the message names the field and the fix."""


def check_run_name(name: Any) -> str:
    """Return ``name`` if every child name derived from it is valid, else raise RenderError.

    Children include Services, whose names must be DNS-1035 labels (lower-case letters, digits, '-',
    starting with a letter), which is stricter than the DNS-1123 subdomain an RLRun name may be.
    """
    if not isinstance(name, str) or not name:
        raise RenderError("metadata.name: missing; give the RLRun a name")
    if not DNS_1035_LABEL.match(name) or len(name) > MAX_RUN_NAME_LENGTH:
        raise RenderError(
            f"metadata.name: {name!r} cannot name the run's Services and StatefulSet; use at most "
            f"{MAX_RUN_NAME_LENGTH} characters of lower-case letters, digits and '-', starting with a letter "
            "and ending with a letter or digit"
        )
    return name


def get_child_names(rlrun: dict[str, Any]) -> dict[str, str]:
    """Names of every child rlrun may create for this run, keyed by child.

    Keys: config (ConfigMap), storage (PVC rlrun creates; unused when spec.storage.claimName is set),
    trainer (Service + StatefulSet), inference / prefill / decode (Deployment + headless Service; which
    exist depends on spec.inference.disaggregation.enabled), router (Deployment, Service, ServiceAccount,
    Role, RoleBinding), orchestrator (Job + Service), network-policy (NetworkPolicy). All keys are always
    present, so an operator can also find children of the other disaggregation mode to delete them. The
    suffixes are constants.CHILD_NAME_SUFFIXES.

    Raises:
        RenderError: metadata.name cannot name the children (see check_run_name).
    """
    name = check_run_name(rlrun.get("metadata", {}).get("name"))
    return {key: name + suffix for key, suffix in c.CHILD_NAME_SUFFIXES.items()}


def get_selector_labels(run_name: str, component: str) -> dict[str, str]:
    """Labels that select one component's pods of one run: name, instance, component."""
    return {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: run_name, c.LABEL_COMPONENT: component}


def get_run_selector_labels(run_name: str) -> dict[str, str]:
    """Labels that select every pod of one run (any component)."""
    return {c.LABEL_NAME: c.APP_NAME, c.LABEL_INSTANCE: run_name}


def get_labels(run_name: str, component: str) -> dict[str, str]:
    """The five standard labels of a child object or pod template (Kubernetes recommended labels)."""
    return {
        **get_selector_labels(run_name, component),
        c.LABEL_PART_OF: c.APP_NAME,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
    }


def get_owner_references(rlrun: dict[str, Any]) -> list[dict[str, Any]]:
    """ownerReferences pointing at the RLRun (controller, blocking deletion); [] when metadata.uid is absent."""
    meta = rlrun.get("metadata", {})
    uid = meta.get("uid")
    if not uid:
        return []
    return [
        {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "name": meta["name"],
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def get_metadata(rlrun: dict[str, Any], name: str, component: str) -> dict[str, Any]:
    """ObjectMeta of a child: name, the run's namespace, standard labels, ownerReferences when uid is known."""
    meta = rlrun["metadata"]
    out: dict[str, Any] = {
        "name": name,
        "namespace": meta["namespace"],
        "labels": get_labels(meta["name"], component),
    }
    owners = get_owner_references(rlrun)
    if owners:
        out["ownerReferences"] = owners
    return out
