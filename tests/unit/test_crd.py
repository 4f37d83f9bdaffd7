"""The CRD (crds/rlrun.yaml): packaging, structural-schema rules, documentation, CEL rules, examples."""

from __future__ import annotations

import re
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

from example_runs import EXAMPLES, ROOT
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


# A printer column's jsonPath: dotted fields, optionally through a list filtered by one field's value.
COLUMN_PATH = re.compile(r'^((?:\.\w+)+?)(?:\[\?\(@\.(\w+)=="(\w+)"\)\]((?:\.\w+)+))?$')


def test_printer_columns_point_at_declared_fields() -> None:
    columns = CRD["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == [
        "Phase", "Step", "Reward", "Inference", "Prefill", "Decode", "Age"]  # README's `kubectl get rlr` line
    assert [c["name"] for c in columns if c.get("priority")] == ["Ready", "Reason", "Trainer", "Policy"]
    assert "# NAME " + " ".join(c["name"].upper() for c in columns if not c.get("priority")) in \
        (ROOT / "README.md").read_text()
    nodes = dict(walk(SCHEMA))
    for column in columns:
        match = COLUMN_PATH.match(column["jsonPath"])
        assert match, column
        head, key, _value, tail = match.groups()
        if head == ".metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        path = head.lstrip(".") if key is None else f"{head.lstrip('.')}[]{tail}"
        assert path in nodes, column
        if key is not None:
            assert f"{head.lstrip('.')}[].{key}" in nodes, column
        assert nodes[path]["type"] == column["type"], column
        assert column.get("description"), column


def test_storage_size_has_no_schema_default_and_says_who_fills_it_in() -> None:
    """A schema default would reach runs with storage.claimName (the API server defaults before CEL runs),
    which refuse a size: the renderer fills in constants.DEFAULT_STORAGE_SIZE, and the field says so."""
    size = SCHEMA["properties"]["spec"]["properties"]["storage"]["properties"]["size"]
    assert "default" not in size
    assert constants.DEFAULT_STORAGE_SIZE in size["description"] and "claimName" in size["description"]
    defaulted = spec.apply_defaults({"spec": {"storage": {"claimName": "existing"}}})
    assert defaulted["spec"]["storage"] == {"claimName": "existing", "mountPath": "/data"}


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


def _cel_outcome(program: Any, activation: dict[str, Any]) -> tuple[str, Any]:
    try:
        value = program.evaluate(activation)
    except cel.celpy.CELEvalError as exc:
        return "error", exc.args[0] if exc.args else None
    return type(value).__name__, value


def _rule_inputs(rule: cel.Rule) -> Iterator[Any]:
    """The nodes ``rule`` is evaluated on in every example, and variants of each: every field removed, set
    to 0, -1, 2.5, a string, true, an empty list (wrong types and missing fields give CEL errors)."""
    for path in EXAMPLES:
        obj = spec.apply_defaults(yaml.safe_load(path.read_text()))
        for value, node_schema, _ in cel._nodes(obj, SCHEMA, rule.schema_path, ""):
            yield value, node_schema
            for key in value if isinstance(value, dict) else []:
                yield {k: v for k, v in value.items() if k != key}, node_schema
                for other in (0, -1, 2.5, "nccl", True, [], {"enabled": True, "replicas": 1}):
                    yield {**value, key: other}, node_schema


@pytest.mark.parametrize("rule", [r for r in RULES if "oldSelf" not in r.rule], ids=lambda r: r.rule[:60])
def test_closure_programs_give_what_cel_pythons_interpreter_gives(rule: cel.Rule) -> None:
    """cel.compile_rule translates the CRD's rules into closures for speed: on every rule, over examples and
    broken variants of them, the result (value and type, or the error's message) is the interpreter's."""
    fast, reference = cel.compile_rule(rule.rule), cel.compile_interpreted(rule.rule)
    assert isinstance(fast, cel.ClosureProgram)  # every rule of the CRD is covered, none falls back
    count = 0
    for value, node_schema in _rule_inputs(rule):
        activation = {"self": cel.to_cel(value, node_schema)}
        assert _cel_outcome(fast, activation) == _cel_outcome(reference, activation), value
        count += 1
    assert count >= 10


def test_rule_outside_the_closure_subset_runs_on_the_interpreter() -> None:
    program = cel.compile_rule("self.all(x, x > 0)")
    assert not isinstance(program, cel.ClosureProgram)
    assert bool(program.evaluate({"self": cel.to_cel([1, 2], {"type": "array", "items": {"type": "integer"}})}))


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
