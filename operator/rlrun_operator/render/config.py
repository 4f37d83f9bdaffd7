"""The run-config ConfigMap every pod mounts, and the per-role config hashes that roll pods (pure).

Every role reads the whole RLRun from ``constants.CONFIG_PATH`` at start-up, so a pod only sees a spec
change when it restarts. Each pod template therefore carries ``constants.ANNOTATION_CONFIG_HASH``: a hash
of exactly the spec fields its role reads at start-up: the projection its typed view is built from
(``rlrun_api.views``, ``ROLE_VIEWS``). A change there changes the template and rolls the role's pods; a change
elsewhere (e.g. autoscaling bounds) leaves them running.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import yaml

from rlrun_api import constants as c
from rlrun_api.views import InferenceView, OrchestratorView, RouterView, SpecView, TrainerView
from .metadata import get_metadata

# component -> the view of the role its pods run (prefill and decode pods run the inference role).
ROLE_VIEWS: dict[str, type[SpecView]] = {
    c.COMPONENT_INFERENCE: InferenceView,
    c.COMPONENT_PREFILL: InferenceView,
    c.COMPONENT_DECODE: InferenceView,
    c.COMPONENT_ROUTER: RouterView,
    c.COMPONENT_TRAINER: TrainerView,
    c.COMPONENT_ORCHESTRATOR: OrchestratorView,
}


def get_config_view(spec: dict[str, Any], component: str) -> dict[str, Any]:
    """The part of ``spec`` that ``component``'s role reads at start-up: its view's projection (a new dict).

    Raises:
        KeyError: unknown component.
    """
    return ROLE_VIEWS[component].project(spec)


def get_config_hash(spec: dict[str, Any], component: str) -> str:
    """16 hex digits of SHA-256 over the canonical JSON (sorted keys) of ``get_config_view``.

    Stable across dict ordering and processes; changes exactly when the role's view changes.
    """
    text = json.dumps(get_config_view(spec, component), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def get_config_document(rlrun: dict[str, Any], copy_spec: bool = True) -> dict[str, Any]:
    """The RLRun as the roles read it: apiVersion, kind, metadata name/namespace, the (defaulted) spec (a
    deep copy; with ``copy_spec=False`` the rlrun's own spec, for a caller that only reads it).

    Labels, annotations, uid and status are left out, so that the ConfigMap only changes with the spec.
    """
    meta = rlrun["metadata"]
    return {
        "apiVersion": rlrun.get("apiVersion", c.API_VERSION),
        "kind": rlrun.get("kind", c.KIND),
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": copy.deepcopy(rlrun["spec"]) if copy_spec else rlrun["spec"],
    }


# libyaml's emitter when PyYAML was built with it (4x faster than the pure-Python one; same text for our
# documents, which tests/unit/test_render.py checks), else PyYAML's own.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def render_config_map(rlrun: dict[str, Any], name: str) -> dict[str, Any]:
    """ConfigMap ``name`` with key ``constants.CONFIG_FILE_NAME`` = get_config_document as YAML (sorted keys)."""
    # Without the deep copy of the spec: the dump only reads it, and a deep copy keeps the spec's shared
    # nodes shared (YAML anchors), so the text is the same.
    text = yaml.dump(get_config_document(rlrun, copy_spec=False), Dumper=_DUMPER, sort_keys=True,
                     default_flow_style=False)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": get_metadata(rlrun, name, c.COMPONENT_CONFIG),
        "data": {c.CONFIG_FILE_NAME: text},
    }


class _BlockDumper(yaml.SafeDumper):
    """SafeDumper writing every multi-line string as a literal block (``|``), so the ConfigMap's run config
    reads as YAML instead of one double-quoted string with ``\\n`` escapes. The value is the same string."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.nodes.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _represent_str)


def dump_manifests(manifests: list[dict[str, Any]]) -> str:
    """``manifests`` as a YAML stream (``---`` between documents, keys in their order, block style), each
    multi-line string a literal block; yaml.safe_load_all gives the manifests back unchanged.

    PyYAML writes a literal block only when the text allows one (no trailing spaces before a line break, no
    special characters); any other string keeps PyYAML's own quoting, so the round trip holds for every input.
    """
    return yaml.dump_all(manifests, Dumper=_BlockDumper, sort_keys=False, default_flow_style=False)
