"""Write docs/reference.md, the RLRun field reference, from the CRD (crds/rlrun.yaml).

Usage: ``python docs/gen_reference.py`` (rewrites docs/reference.md) or ``python docs/gen_reference.py --check``
(exit 1 when docs/reference.md differs from what the CRD gives; tests/unit/test_docs.py runs the same check).

Every property of the CRD's openAPIV3Schema under ``spec`` and ``status`` gets one table row: its path, type,
default, description, and its constraints (enum, bounds, pattern, lengths). Every CEL rule
(``x-kubernetes-validations``) is listed with the object it is declared on, the field it is reported on and
its message. Nothing is written by hand: edit the CRD, then rerun this script.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "rlrun.yaml"
REFERENCE_PATH = ROOT / "docs" / "reference.md"

HEADER = """\
# RLRun reference (`rlrun.dev/v1alpha1`)

Generated from `crds/rlrun.yaml` by `docs/gen_reference.py`; do not edit by hand (`tests/unit/test_docs.py` fails
when this file is stale). The same text is in the cluster: `kubectl explain rlrun.spec.<field>`.

A default marked *(operator)* has no schema default: the API server leaves the field out and rlrun applies the
value named in the description when it reads the spec (so that a new default never rewrites existing runs'
ConfigMaps). CEL rules are checked by the API server and by `rlrun validate`; their messages are what both print.
"""


def load_schema(path: Path = CRD_PATH) -> dict[str, Any]:
    """The openAPIV3Schema of the CRD's only version.

    Raises:
        KeyError: the file is not an RLRun CRD with one version.
    """
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def get_type(node: dict[str, Any]) -> str:
    """A short type: ``string``, ``integer``, ``array of string``, ``map of string``, ``int-or-string``, ..."""
    if node.get("x-kubernetes-int-or-string"):
        return "int-or-string (quantity)" if "pattern" in node else "int-or-string"
    kind = node.get("type")
    if kind == "array":
        return "array of " + get_type(node.get("items") or {})
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return "map of " + get_type(node["additionalProperties"])
    if kind == "object" and node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (free-form)"
    if not kind and "anyOf" in node:
        return " or ".join(get_type(option) for option in node["anyOf"])
    return kind or "any"


def get_constraints(node: dict[str, Any]) -> list[str]:
    """Human-readable constraints of one schema node (enum, bounds, lengths, pattern, list semantics)."""
    out = []
    if "enum" in node:
        out.append("One of: " + ", ".join(f"`{json.dumps(v) if v == '' else v}`" for v in node["enum"]) + ".")
    if "minimum" in node:
        out.append(("Above " if node.get("exclusiveMinimum") else "Minimum ") + f"{node['minimum']}.")
    if "maximum" in node:
        out.append(("Below " if node.get("exclusiveMaximum") else "Maximum ") + f"{node['maximum']}.")
    for key, label in (("minLength", "Minimum length"), ("maxLength", "Maximum length"),
                       ("maxItems", "At most items:")):
        if key in node:
            out.append(f"{label} {node[key]}.")
    if "pattern" in node:
        out.append(f"Pattern `{node['pattern']}`.")
    if node.get("format"):
        out.append(f"Format {node['format']}.")
    if node.get("x-kubernetes-list-type") == "map":
        out.append("A list keyed by " + ", ".join(node.get("x-kubernetes-list-map-keys") or []) + ".")
    return out


def get_default(node: dict[str, Any], description: str) -> str:
    """The default cell: the schema default as JSON, *(operator)* when the description names one that rlrun
    applies (the CRD has no schema default there), else empty."""
    if "default" in node:
        return "`" + json.dumps(node["default"]) + "`"
    lowered = description.lower()
    if "when left out" in lowered or "default:" in lowered or "applied by the operator" in lowered:
        return "*(operator)*"
    return ""


def one_line(text: str) -> str:
    """``text`` on one line, runs of whitespace as one space."""
    return " ".join(text.split())


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell (one line, pipes escaped)."""
    return one_line(text).replace("|", "\\|")


def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(path, schema node, required) of every property below ``node``, depth first, in the CRD's order.
    Array items and map values are descended into as ``path[]`` and ``path.<key>``."""
    required = set(node.get("required") or [])
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}"
        yield child_path, child, name in required
        yield from walk_below(child, child_path)


def walk_below(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """The properties inside one node: its own, its array items' and its map values'."""
    yield from walk(node, path)
    items = node.get("items")
    if isinstance(items, dict) and items.get("properties"):
        yield from walk(items, path + "[]")
    values = node.get("additionalProperties")
    if isinstance(values, dict) and values.get("properties"):
        yield from walk(values, path + ".<key>")


def rules_below(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path of the object declaring it, rule) for every CEL rule at or below ``node``."""
    for rule in node.get("x-kubernetes-validations") or []:
        yield path, rule
    for child_path, child, _ in walk_below(node, path):
        for rule in child.get("x-kubernetes-validations") or []:
            yield child_path, rule


def render_section(node: dict[str, Any], path: str) -> list[str]:
    """One section: the object's description, its fields' table and its CEL rules."""
    lines = [f"## `{path}`", "", cell(node.get("description", "")), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for field_path, child, required in walk_below(node, path):
        description = child.get("description", "")
        text = " ".join([description.strip(), *get_constraints(child)]).strip()
        if required:
            text = "**Required.** " + text
        lines.append(f"| `{field_path}` | {cell(get_type(child))} | {get_default(child, description)} | {cell(text)} |")
    lines.append("")
    rules = list(rules_below(node, path))
    if rules:
        lines += ["CEL rules (checked by the API server and by `rlrun validate`):", ""]
        for owner, rule in rules:
            target = owner + rule.get("fieldPath", "")
            # a list item, not a table cell: pipes stay as they are
            lines.append(f"- on `{target}`: {one_line(rule['message'])} (rule `{one_line(rule['rule'])}`, "
                         f"declared on `{owner}`)")
        lines.append("")
    return lines


def render_reference(schema: dict[str, Any]) -> str:
    """The whole docs/reference.md text from the openAPIV3Schema."""
    lines = [HEADER]
    top = schema["properties"]
    name = top["metadata"]["properties"]["name"]
    lines += ["## `metadata.name`", "", cell(" ".join([name["description"], *get_constraints(name)])), ""]
    spec = top["spec"]
    lines += ["## `spec`", "", cell(spec.get("description", "")), "",
              "Required: " + ", ".join(f"`spec.{r}`" for r in spec.get("required") or []) + ".", ""]
    own_rules = spec.get("x-kubernetes-validations") or []
    if own_rules:
        lines += ["CEL rules across sections (declared on `spec`):", ""]
        for rule in own_rules:
            lines.append(f"- on `spec{rule.get('fieldPath', '')}`: {cell(rule['message'])} (rule `{cell(rule['rule'])}`)")
        lines.append("")
    plain = [(key, child) for key, child in spec["properties"].items() if child.get("type") != "object"]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for key, child in plain:
        description = child.get("description", "")
        text = " ".join([description.strip(), *get_constraints(child)])
        lines.append(f"| `spec.{key}` | {cell(get_type(child))} | {get_default(child, description)} | {cell(text)} |")
    lines.append("")
    for key, child in spec["properties"].items():
        if child.get("type") == "object" or (child.get("items") or {}).get("properties"):
            lines += render_section(child, f"spec.{key}")
    status = top["status"]
    lines += render_section(status, "status")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/reference.md is stale; write nothing")
    args = parser.parse_args(argv)
    text = render_reference(load_schema())
    if args.check:
        current = REFERENCE_PATH.read_text(encoding="utf-8") if REFERENCE_PATH.exists() else ""
        if current != text:
            print(f"{REFERENCE_PATH.relative_to(ROOT)} is stale: run python docs/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    REFERENCE_PATH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
