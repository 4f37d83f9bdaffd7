"""The CRD's CEL rules (`x-kubernetes-validations`), found in the schema and evaluated with cel-python.

The API server evaluates these same expressions when an RLRun is created or updated; `rlrun validate` and
the operator evaluate them here, so there is one source for every cross-field rule.

How the Kubernetes semantics are reproduced (Kubernetes docs, "Validation rules" in
"Extend the Kubernetes API with CustomResourceDefinitions"):
- a rule is evaluated on every node of the object that its schema node describes, with ``self`` bound to
  that node's value (every item of a list, every value of a map); absent nodes are not evaluated;
- ``self`` is typed by the schema: ``type: number`` fields are CEL doubles even when written as ``8``,
  ``integer`` fields are ints, objects are maps (``has(self.x)`` tests presence);
- ``fieldPath`` (relative to the node, e.g. ``.algorithm.batchSize``) gives the error's path; the error
  message is ``message`` (or ``messageExpression`` when present);
- a rule that evaluates to false, or fails with an evaluation error (e.g. a missing field), is a
  validation error, as on the API server.
Transition rules (those using ``oldSelf``) need the stored object and are skipped here.
cel-python implements core CEL, not the Kubernetes CEL libraries (``quantity()``, ``url()``, ...): the
CRD's rules keep to core CEL.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import celpy
from celpy import celtypes

_OLD_SELF = re.compile(r"\boldSelf\b")


class CELRuleError(ValueError):
    """A rule in the CRD does not parse as CEL; the message quotes the rule and cel-python's error."""


@dataclass(frozen=True)
class Rule:
    """One ``x-kubernetes-validations`` entry, located in the schema.

    Attributes:
        schema_path: path of the schema node that carries the rule, as object keys from the root
            (``("spec", "algorithm")``); ``"[]"`` marks list items and ``"{}"`` map values.
        rule: the CEL expression.
        message: the CRD's message (or the rule text when it has none).
        message_expression: the CRD's messageExpression, or None.
        field_path: the CRD's fieldPath relative to the node (``".batchSize"``), or "".
    """

    schema_path: tuple[str, ...]
    rule: str
    message: str
    message_expression: str | None
    field_path: str


@dataclass(frozen=True)
class Violation:
    """A rule that failed on one node: ``path`` is the full dotted field path (``spec.algorithm.batchSize``)."""

    path: str
    message: str
    rule: str


def find_rules(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[Rule]:
    """Yield every rule of ``schema`` (an openAPIV3Schema), walking properties, items and additionalProperties."""
    if not isinstance(schema, dict):
        return
    for entry in schema.get("x-kubernetes-validations", []) or []:
        yield Rule(
            schema_path=path,
            rule=entry["rule"],
            message=entry.get("message") or f"failed rule: {entry['rule']}",
            message_expression=entry.get("messageExpression"),
            field_path=entry.get("fieldPath", ""),
        )
    for key, sub in (schema.get("properties") or {}).items():
        yield from find_rules(sub, (*path, key))
    if isinstance(schema.get("items"), dict):
        yield from find_rules(schema["items"], (*path, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from find_rules(schema["additionalProperties"], (*path, "{}"))


_RULES: dict[int, tuple[dict[str, Any], tuple[Rule, ...]]] = {}


def _rules_of(schema: dict[str, Any]) -> tuple[Rule, ...]:
    """find_rules(schema), remembered per schema object (the CRD's schema is parsed once and never
    mutated; the schema is kept referenced so that its id is not reused)."""
    found = _RULES.get(id(schema))
    if found is None or found[0] is not schema:
        found = _RULES[id(schema)] = (schema, tuple(find_rules(schema)))
    return found[1]


@functools.lru_cache(maxsize=256)
def compile_rule(expression: str) -> celpy.Runner:
    """Parse ``expression`` and return a cel-python program (cached per expression text).

    Raises:
        CELRuleError: the expression is not valid CEL.
    """
    env = celpy.Environment()
    try:
        return env.program(env.compile(expression))
    except celpy.CELParseError as exc:
        raise CELRuleError(f"CEL rule {expression!r} does not parse: {exc}") from exc


def to_cel(value: Any, schema: dict[str, Any] | None,
           memo: dict[tuple[int, int], celtypes.Value] | None = None) -> celtypes.Value:
    """Convert a JSON value to a CEL value typed by its schema node (``number`` -> double, ...).

    Nodes without a usable schema (free-form, ``x-kubernetes-preserve-unknown-fields``) fall back to
    cel-python's JSON conversion. ``memo`` (keyed by the ids of value and schema node; valid only while
    both are alive and unchanged, e.g. during one evaluate_rules call) reuses conversions of shared
    subtrees: a rule on ``spec`` and a rule on ``spec.algorithm`` convert ``spec.algorithm`` once.
    """
    if memo is not None and isinstance(value, (dict, list)):
        key = (id(value), id(schema))
        found = memo.get(key)
        if found is None:
            found = memo[key] = _to_cel(value, schema, memo)
        return found
    return _to_cel(value, schema, memo)


def _to_cel(value: Any, schema: dict[str, Any] | None,
            memo: dict[tuple[int, int], celtypes.Value] | None) -> celtypes.Value:
    schema = schema or {}
    kind = schema.get("type")
    if value is None:
        return None
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return celtypes.DoubleType(value)
    if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
        return celtypes.IntType(value)
    if kind == "array" and isinstance(value, list):
        return celtypes.ListType([to_cel(item, schema.get("items"), memo) for item in value])
    if kind == "object" and isinstance(value, dict) and ("properties" in schema or "additionalProperties" in schema):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            out[celtypes.StringType(key)] = to_cel(item, sub, memo)
        return celtypes.MapType(out)
    return celpy.json_to_cel(value)


def _nodes(value: Any, schema: dict[str, Any], schema_path: tuple[str, ...], data_path: str) -> Iterator[tuple[Any, dict, str]]:
    """Yield (value, schema node, dotted data path) for every present node addressed by ``schema_path``."""
    if not schema_path:
        yield value, schema, data_path
        return
    head, rest = schema_path[0], schema_path[1:]
    if head == "[]":
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _nodes(item, schema.get("items", {}), rest, f"{data_path}[{i}]")
    elif head == "{}":
        if isinstance(value, dict):
            for key, item in value.items():
                if key not in (schema.get("properties") or {}):
                    yield from _nodes(item, schema.get("additionalProperties", {}), rest, _join(data_path, key))
    elif isinstance(value, dict) and head in value and value[head] is not None:
        yield from _nodes(value[head], schema["properties"][head], rest, _join(data_path, head))


def _within(path: str, node: str) -> bool:
    """True when dotted ``path`` is ``node`` itself or lies below it (every path lies below the root "")."""
    return not node or path == node or path.startswith((node + ".", node + "["))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def evaluate_rules(obj: dict[str, Any], schema: dict[str, Any], skip_paths: frozenset[str] = frozenset()) -> list[Violation]:
    """Evaluate every rule of ``schema`` on ``obj`` (the whole, already defaulted object).

    Args:
        obj: the object (e.g. a full RLRun dict).
        schema: its openAPIV3Schema.
        skip_paths: dotted data paths of nodes that failed the structural schema; a rule is not evaluated on
            a node whose own path, or any path below it, is listed (its values may have the wrong types).

    Returns:
        One Violation per rule that is false or fails to evaluate on a node, in schema order.

    Raises:
        CELRuleError: a rule of the schema is not valid CEL (a bug in the CRD, not in the object).
    """
    out: list[Violation] = []
    memo: dict[tuple[int, int], celtypes.Value] = {}
    for rule in _rules_of(schema):
        if _OLD_SELF.search(rule.rule):
            continue
        program = compile_rule(rule.rule)
        for value, node_schema, data_path in _nodes(obj, schema, rule.schema_path, ""):
            if any(_within(p, data_path) for p in skip_paths):
                continue
            activation = {"self": to_cel(value, node_schema, memo)}
            try:
                result = program.evaluate(activation)
            except celpy.CELEvalError as exc:
                result = exc
            if isinstance(result, celtypes.BoolType) and bool(result):
                continue
            message = rule.message
            if rule.message_expression:
                try:
                    message = str(compile_rule(rule.message_expression).evaluate(activation))
                except (celpy.CELEvalError, CELRuleError):
                    pass
            if not isinstance(result, celtypes.BoolType):
                message = f"{message} (the rule could not be evaluated: {_short(result)})"
            out.append(Violation(path=data_path + rule.field_path if data_path else rule.field_path.lstrip("."),
                                 message=message, rule=rule.rule))
    return out


def _short(result: Any) -> str:
    if isinstance(result, celpy.CELEvalError) and result.args:
        return str(result.args[0])
    return repr(result)
