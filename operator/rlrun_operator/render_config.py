"""The run-config ConfigMap every pod mounts, and the per-role config hashes that roll pods (pure).

Every role reads the whole RLRun from ``constants.CONFIG_PATH`` at start-up, so a pod only sees a spec
change when it restarts. Each pod template therefore carries ``constants.ANNOTATION_CONFIG_HASH``: a hash
of exactly the spec fields its role reads at start-up (``CONFIG_HASH_VIEWS``). A change there changes the
template and rolls the role's pods; a change elsewhere (e.g. autoscaling bounds) leaves them running.

Fields that are rendered into the pod template directly (image, resources, pod overrides, replica counts,
suspend) are left out of every hash: the template already changes when they do, or they must not roll pods
(replica seeds; suspend only scales to zero).
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

from rlrun_api import constants as c
from .render_metadata import get_metadata

FieldPath = tuple[str, ...]

# Replica seeds: the operator owns replicas after creation, so seeds never roll pods.
_REPLICA_SEEDS: tuple[FieldPath, ...] = (
    ("inference", "replicas"),
    ("inference", "disaggregation", "replicas"),
    ("inference", "disaggregation", "ratio"),
)
_RESOURCES: tuple[FieldPath, ...] = (
    ("trainer", "resources"),
    ("inference", "resources"),
    ("router", "resources"),
    ("orchestrator", "resources"),
)
# Fields only the inference and router roles read (the vLLM and vllm-router command lines).
_INFERENCE_ONLY: tuple[FieldPath, ...] = (
    ("inference", "vllmArgs"),
    ("inference", "gpusPerReplica"),
    ("inference", "tensorParallel"),
    ("inference", "dataParallel"),
    ("inference", "disaggregation", "kvConnector"),
    ("router",),
)

# role -> (spec paths the role reads, paths removed from them again). A path () is the whole spec.
CONFIG_HASH_VIEWS: dict[str, tuple[tuple[FieldPath, ...], tuple[FieldPath, ...]]] = {
    # The inference role builds the vLLM command line from model (name, revision, dtype, maxModelLen) and
    # inference (parallelism, KV connector, vllmArgs); weightSync.transport decides how weights arrive.
    # Sampling parameters travel with each request, so algorithm.sampling does not roll these pods.
    c.COMPONENT_INFERENCE: (
        (("model",), ("inference",), ("weightSync",)),
        _REPLICA_SEEDS + (("inference", "resources"),),
    ),
    # The router builds vllm-router's arguments: policy, extra args, P/D mode or not.
    c.COMPONENT_ROUTER: (
        (("router",), ("inference", "disaggregation", "enabled")),
        (("router", "resources"),),
    ),
    # The trainer: the model, the algorithm (loss, optimiser, schedule, sampling temperature for its
    # logprobs), its own layout and checkpoints, and the weight transport. Storage paths reach it through
    # the pod template (mount path, claim); the environment is the orchestrator's.
    c.COMPONENT_TRAINER: (
        (("model",), ("algorithm",), ("trainer",), ("weightSync",)),
        (("trainer", "resources"),),
    ),
    # The orchestrator reads nearly everything; it is a Job, whose pod template is immutable, so the
    # operator recreates the Job when this hash changes (it resumes from orchestrator/state.json). Of the
    # inference section it reads only disaggregation.enabled (the request shape, rlrun_runtime.orchestrator);
    # the vLLM command line and the router's configuration are other roles' business, so changing them
    # rolls those pods without replacing the orchestrator.
    c.COMPONENT_ORCHESTRATOR: (
        ((),),
        (("autoscaling",), ("pod",), ("suspend",), ("image",), ("imagePullPolicy",), ("imagePullSecrets",))
        + _REPLICA_SEEDS
        + _RESOURCES
        + _INFERENCE_ONLY,
    ),
}
# Prefill and decode pods run the inference role.
CONFIG_HASH_VIEWS[c.COMPONENT_PREFILL] = CONFIG_HASH_VIEWS[c.COMPONENT_INFERENCE]
CONFIG_HASH_VIEWS[c.COMPONENT_DECODE] = CONFIG_HASH_VIEWS[c.COMPONENT_INFERENCE]


def _get_path(spec: dict[str, Any], path: FieldPath) -> tuple[bool, Any]:
    node: Any = spec
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _set_path(view: dict[str, Any], path: FieldPath, value: Any) -> dict[str, Any]:
    if not path:
        return copy.deepcopy(value)
    node = view
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = copy.deepcopy(value)
    return view


def _drop_path(view: dict[str, Any], path: FieldPath) -> None:
    node: Any = view
    for key in path[:-1]:
        if not isinstance(node, dict) or key not in node:
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)


def get_config_view(spec: dict[str, Any], component: str) -> dict[str, Any]:
    """The part of ``spec`` that ``component``'s role reads at start-up (a new dict; see CONFIG_HASH_VIEWS).

    Raises:
        KeyError: unknown component.
    """
    include, exclude = CONFIG_HASH_VIEWS[component]
    view: dict[str, Any] = {}
    for path in include:
        found, value = _get_path(spec, path)
        if found:
            view = _set_path(view, path, value)
    for path in exclude:
        _drop_path(view, path)
    return view


def get_config_hash(spec: dict[str, Any], component: str) -> str:
    """16 hex digits of SHA-256 over the canonical JSON (sorted keys) of ``get_config_view``.

    Stable across dict ordering and processes; changes exactly when the role's view changes.
    """
    text = json.dumps(get_config_view(spec, component), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def get_config_document(rlrun: dict[str, Any]) -> dict[str, Any]:
    """The RLRun as the roles read it: apiVersion, kind, metadata name/namespace, the (defaulted) spec.

    Labels, annotations, uid and status are left out, so that the ConfigMap only changes with the spec.
    """
    meta = rlrun["metadata"]
    return {
        "apiVersion": rlrun.get("apiVersion", c.API_VERSION),
        "kind": rlrun.get("kind", c.KIND),
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": copy.deepcopy(rlrun["spec"]),
    }


# libyaml's emitter when PyYAML was built with it (4x faster than the pure-Python one; same text for our
# documents, which tests/test_render.py checks), else PyYAML's own.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def render_config_map(rlrun: dict[str, Any], name: str) -> dict[str, Any]:
    """ConfigMap ``name`` with key ``constants.CONFIG_FILE_NAME`` = get_config_document as YAML (sorted keys)."""
    text = yaml.dump(get_config_document(rlrun), Dumper=_DUMPER, sort_keys=True, default_flow_style=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_CONFIG),
        "data": {c.CONFIG_FILE_NAME: text},
    }
