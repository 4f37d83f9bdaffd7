"""The RLRun CRD as data: loading it, and structural defaulting the way the API server does it (pure)."""

from __future__ import annotations

import copy
import functools
from importlib import resources
from typing import Any

import yaml

CRD_RESOURCE = "data/rlrun.yaml"


@functools.lru_cache(maxsize=1)
def _crd_text() -> str:
    return resources.files("rlrun_api").joinpath(CRD_RESOURCE).read_text(encoding="utf-8")


def crd_text() -> str:
    """The CRD YAML exactly as shipped (a copy of crds/rlrun.yaml packaged as data)."""
    return _crd_text()


@functools.lru_cache(maxsize=1)
def _parsed_crd() -> dict[str, Any]:
    return yaml.safe_load(_crd_text())


def crd_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the served version (read-only by convention: do not mutate)."""
    return _parsed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


_JSON_SCALARS = (str, int, float, bool, type(None))


def _copy_tree(value: Any, depth: int = 0) -> Any:
    """A deep copy of JSON-like data (dicts, lists, str/int/float/bool/None), about 5x faster than
    copy.deepcopy; raises TypeError for anything else, and beyond 100 levels (a cycle)."""
    kind = type(value)
    if kind is dict:
        if depth > 100:
            raise TypeError("too deep")
        return {k: v if type(v) in _JSON_SCALARS else _copy_tree(v, depth + 1) for k, v in value.items()}
    if kind is list:
        if depth > 100:
            raise TypeError("too deep")
        return [v if type(v) in _JSON_SCALARS else _copy_tree(v, depth + 1) for v in value]
    if kind in _JSON_SCALARS:
        return value
    raise TypeError(kind.__name__)


def copy_json(value: Any) -> Any:
    """copy.deepcopy, through _copy_tree for plain JSON-like trees. A tree copy turns two references to
    one node (a YAML alias) into two nodes, each then defaulted by its own schema node, as the API server
    (which receives JSON) does; copy.deepcopy is used for anything else (other types, cycles)."""
    try:
        return _copy_tree(value)
    except TypeError:
        return copy.deepcopy(value)


def _default(node: Any, schema: dict[str, Any]) -> Any:
    if isinstance(node, dict) and schema.get("type") == "object":
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in node and "default" in sub:
                node[key] = copy_json(sub["default"])
            if key in node:
                node[key] = _default(node[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in node:
                if key not in props:
                    node[key] = _default(node[key], extra)
    elif isinstance(node, list) and isinstance(schema.get("items"), dict):
        return [_default(item, schema["items"]) for item in node]
    return node


def apply_defaults(rlrun: dict[str, Any]) -> dict[str, Any]:
    """Return a deep copy of ``rlrun`` with every schema default filled in.

    Mirrors Kubernetes structural-schema defaulting (top-down: a defaulted ``{}`` parent then gets its
    children's defaults; list items are defaulted by the items schema). The API server does this for
    objects it stores; the CLI and the operator do it again so that objects from a test server or a file
    see the same values. Values that are present are never changed, even if invalid.
    """
    out = copy_json(rlrun)
    if isinstance(out, dict):
        _default(out, crd_schema())
    return out
