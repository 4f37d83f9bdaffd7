"""The run's shared storage: the PersistentVolumeClaim rlrun creates, and the volumes every pod mounts (pure)."""

from __future__ import annotations

from typing import Any

from rlrun_api import constants as c
from .metadata import get_metadata

CONFIG_VOLUME = "config"
STORAGE_VOLUME = "storage"
SHM_VOLUME = "dshm"


def get_claim_name(rlrun: dict[str, Any], created_name: str) -> str:
    """The claim every pod mounts: spec.storage.claimName if set, else ``created_name`` (the PVC rlrun creates)."""
    return rlrun["spec"]["storage"].get("claimName") or created_name


def get_storage_defaulted(rlrun: dict[str, Any]) -> dict[str, Any]:
    """``rlrun`` with spec.storage.size set to constants.DEFAULT_STORAGE_SIZE when rlrun creates the claim
    (no claimName) and the spec leaves the size out; else ``rlrun`` itself. A shallow copy: the input is
    not changed.

    The CRD has no schema default for the size (it would reach claimName runs too, which refuse a size),
    so the renderer fills it in; everything rendered from the spec (the PVC, the ConfigMap's document, the
    roles' config hashes) sees the size as before, when the API server defaulted it.
    """
    storage = rlrun["spec"].get("storage") or {}
    if storage.get("claimName") or "size" in storage:
        return rlrun
    return {**rlrun, "spec": {**rlrun["spec"], "storage": {**storage, "size": c.DEFAULT_STORAGE_SIZE}}}


def render_pvc(rlrun: dict[str, Any], name: str) -> dict[str, Any] | None:
    """PersistentVolumeClaim ``name`` (ReadWriteMany, spec.storage.size or constants.DEFAULT_STORAGE_SIZE,
    storageClassName if set).

    Returns None when spec.storage.claimName names an existing claim (rlrun then creates none). The claim
    must be ReadWriteMany because the trainer, inference and orchestrator pods, on different nodes, all
    write to it.
    """
    storage = rlrun["spec"]["storage"]
    if storage.get("claimName"):
        return None
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": storage.get("size") or c.DEFAULT_STORAGE_SIZE}},
    }
    if storage.get("storageClassName"):
        spec["storageClassName"] = storage["storageClassName"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_STORAGE),
        "spec": spec,
    }


def is_hugging_face_id(model_name: str) -> bool:
    """Whether spec.model.name is a Hugging Face model id: neither constants.TINY_MODEL_NAME nor a path
    (a name starting with ``/``, ``.`` or ``~``; the rule `rlrun local` uses too)."""
    return model_name != c.TINY_MODEL_NAME and not model_name.startswith(("/", ".", "~"))


def get_model_cache_dir(spec: dict[str, Any]) -> str | None:
    """The Hugging Face hub cache directory every container of the run gets (``HF_HUB_CACHE``):
    ``<storage.mountPath>/constants.MODEL_CACHE_DIR`` when model.name is a Hugging Face id and
    spec.storage.modelCache is not false (left out: constants.DEFAULT_MODEL_CACHE, true); else None.

    On the shared claim the trainer and every inference pod find what the first one downloaded
    (huggingface_hub, transformers and vLLM all read HF_HUB_CACHE); only the hub cache moves, not HF_HOME,
    so a token stays wherever the image or spec.pod.env/envFrom put it.
    """
    storage = spec.get("storage") or {}
    if not storage.get("modelCache", c.DEFAULT_MODEL_CACHE):
        return None
    if not is_hugging_face_id(str(spec["model"]["name"])):
        return None
    return storage["mountPath"].rstrip("/") + "/" + c.MODEL_CACHE_DIR


def get_volumes(config_map_name: str, claim_name: str, shm: bool) -> list[dict[str, Any]]:
    """Pod volumes: the run-config ConfigMap, the shared claim, and (``shm``) a memory-backed /dev/shm.

    The default /dev/shm of a container is 64 MiB, too small for PyTorch's and vLLM's shared-memory
    transfers between processes of one pod (torchrun workers, tensor-parallel workers).
    """
    volumes: list[dict[str, Any]] = [
        {"name": CONFIG_VOLUME, "configMap": {"name": config_map_name}},
        {"name": STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": claim_name}},
    ]
    if shm:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    return volumes


def get_volume_mounts(rlrun: dict[str, Any], shm: bool) -> list[dict[str, Any]]:
    """Container mounts: config read-only at CONFIG_MOUNT_DIR, storage at spec.storage.mountPath, /dev/shm."""
    mounts: list[dict[str, Any]] = [
        {"name": CONFIG_VOLUME, "mountPath": c.CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": STORAGE_VOLUME, "mountPath": rlrun["spec"]["storage"]["mountPath"]},
    ]
    if shm:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return mounts
