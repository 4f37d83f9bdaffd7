"""The CRD (crds/rlrun.yaml): packaging, structural-schema rules, documentation, CEL rules, examples."""

from __future__ import annotations

import re
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

from conftest import EXAMPLES, ROOT
from rlrun_api import cel, constants, documents, spec, validation

CRD_PATH = ROOT / "crds" / "rlrun.yaml"
PACKAGED_PATH = ROOT / "api" / "rlrun_api" / "data" / "rlrun.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path: properties by name, list items as [], map values as {}."""
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_packaged_copy_is_byte_identical() -> None:
    assert PACKAGED_PATH.read_bytes() == CRD_PATH.read_bytes(), "run `make sync-crd`"
    assert spec.crd_text() == CRD_PATH.read_text()


def test_names_scope_and_status_subresource() -> None:
    assert CRD["metadata"]["name"] == f"{constants.PLURAL}.{constants.GROUP}"
    s = CRD["spec"]
    assert (s["group"], s["scope"]) == (constants.GROUP, "Namespaced")
    assert s["names"]["kind"] == constants.KIND and s["names"]["plural"] == constants.PLURAL
    assert s["names"]["shortNames"] == ["rlr"]
    [version] = s["versions"]
    assert (version["name"], version["served"], version["storage"]) == (constants.VERSION, True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns_point_at_declared_fields() -> None:
    columns = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["Phase", "Step", "Reward", "Prefill", "Decode", "Age"]
    declared = {p for p, _ in walk(SCHEMA)}
    for column in columns:
        path = column["jsonPath"].lstrip(".")
        if path == "metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        assert path in declared, column
        node = dict(walk(SCHEMA))[path]
        assert node["type"] == column["type"], column


def test_every_field_has_a_description() -> None:
    missing = [p or "<root>" for p, node in walk(SCHEMA) if not str(node.get("description", "")).strip()]
    assert missing == []
    assert len(list(walk(SCHEMA))) > 150  # the walk reaches the whole tree


def test_schema_is_structural() -> None:
    """Rules of structural schemas (Kubernetes docs, "Specifying a structural schema")."""
    for path, node in walk(SCHEMA):
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{path}: no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        for key in ("allOf", "anyOf", "oneOf", "not"):
            if key == "anyOf" and node.get("x-kubernetes-int-or-string"):
                # The one form int-or-string allows (the same docs).
                assert node[key] == [{"type": "integer"}, {"type": "string"}], path
                assert "type" not in node, path
                continue
            assert key not in node, f"{path}: {key} needs care in structural schemas"
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in item.get("required", []), f"{path}: map key {key} must be required"
    # metadata may only be restricted in name and generateName; status is not required; spec is
    metadata = SCHEMA["properties"]["metadata"]
    assert set(metadata) <= {"type", "description", "properties"}
    assert set(metadata.get("properties", {})) <= {"name", "generateName"}
    for field in metadata.get("properties", {}).values():
        assert set(field) <= {"type", "description", "pattern", "maxLength", "minLength"}
    assert SCHEMA["required"] == ["spec"]


def test_defaults_are_valid_against_their_own_schema() -> None:
    checked = 0
    for path, node in walk(SCHEMA):
        if "default" in node:
            errors = list(jsonschema.Draft4Validator(validation.to_jsonschema(node)).iter_errors(node["default"]))
            assert errors == [], f"{path}: default {node['default']!r}: {errors[0].message}"
            checked += 1
    assert checked > 50


def test_fully_defaulted_minimal_spec_passes_schema_and_rules() -> None:
    minimal = yaml.safe_load((ROOT / "examples" / "rlrun-minimal.yaml").read_text())
    defaulted = spec.apply_defaults(minimal)
    assert defaulted["spec"]["algorithm"]["loss"]["ratioHigh"] == 8.0  # nested defaults were applied
    assert validation.check_schema(defaulted) == []
    assert validation.check_cel(defaulted) == []


RULES = list(cel.find_rules(SCHEMA))


def test_rules_are_found() -> None:
    assert len(RULES) >= 15
    assert {r.schema_path for r in RULES} >= {("spec",), ("spec", "algorithm"), ("spec", "trainer"),
                                               ("spec", "inference"), ("spec", "autoscaling")}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.rule)
def test_rule_compiles_and_names_a_declared_field(rule: cel.Rule) -> None:
    cel.compile_rule(rule.rule)
    node = SCHEMA
    for key in rule.schema_path:
        node = node["properties"][key]
    for key in filter(None, rule.field_path.split(".")):
        node = node["properties"][key]  # KeyError: fieldPath names an undeclared field
    assert rule.message and rule.message != rule.rule
    # the API server rejects messages with line breaks or surrounding blanks
    assert "\n" not in rule.message and rule.message == rule.message.strip()
    assert re.search(r"\b(set|raise|lower|change|enable|drop|list|use|give)\b", rule.message), \
        f"message of {rule.rule!r} does not say how to fix it"


def _guaranteed(schema: dict[str, Any], chain: list[str]) -> bool:
    """True when every field of ``chain`` below ``schema`` is required or defaulted (present after defaulting)."""
    for key in chain:
        props = schema.get("properties") or {}
        if key not in props:
            return False
        if key not in schema.get("required", []) and "default" not in props[key]:
            return False
        schema = props[key]
    return True


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.rule)
def test_rule_reads_only_fields_present_after_defaulting_or_guarded(rule: cel.Rule) -> None:
    node = SCHEMA
    for key in rule.schema_path:
        node = node["properties"][key]
    guarded = set(re.findall(r"has\(self((?:\.\w+)+)\)", rule.rule))
    for chain in re.findall(r"self((?:\.\w+)+)", rule.rule):
        fields = [f for f in chain.split(".")[1:] if f != "size"]
        if chain in guarded:
            continue
        assert _guaranteed(node, fields), f"{rule.rule!r}: self{chain} may be absent; guard it with has()"


def test_rule_catches_a_bad_cel_expression() -> None:
    with pytest.raises(cel.CELRuleError, match="does not parse"):
        cel.compile_rule("self.a +")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates_without_errors(path) -> None:
    docs = documents.load_documents(path)
    for doc in docs:
        assert validation.validate(doc) == []


def test_examples_cover_disaggregation_and_cpu() -> None:
    docs = {p.name: documents.load_documents(p)[0] for p in EXAMPLES}
    assert docs["rlrun-complete.yaml"]["spec"]["inference"]["disaggregation"]["enabled"] is True
    assert docs["rlrun-tiny.yaml"]["spec"]["trainer"]["gpusPerNode"] == 0


def test_crd_object_is_a_valid_customresourcedefinition() -> None:
    """The CRD document itself against the apiextensions.k8s.io/v1 schema (kubernetes-validate, strict):
    catches misspelt keys such as `fieldpath` in a rule or a mistyped printer column."""
    import kubernetes_validate

    kubernetes_validate.validate(CRD, "1.37", strict=True)  # raises ValidationError
