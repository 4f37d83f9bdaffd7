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

Speed: cel-python's interpreter walks the parse tree for every evaluation (about 0.35 ms per rule on a 2-core
machine, most of a ``validate()`` call), and its transpiler (``celpy.CompiledRunner``, 0.5.0) mistypes
``has(a) && has(b)`` (Python bools reach ``logical_and``: "no such overload"). So ``compile_rule`` turns the
parse tree into nested Python closures once (:class:`ClosureProgram`), for the part of CEL the CRD uses:
literals, ``self`` and field selection, ``!``/``-``, arithmetic, comparisons, ``in``, ``&&``/``||``, the
conditional, ``has()`` and plain function calls (``size()``, ...). Every operator is cel-python's own function
(``celpy.evaluation.base_functions``) fed the same values, errors included, and its exceptions are mapped to
the same ``CELEvalError`` messages, so the results are those of the interpreter
(tests/unit/test_crd.py compares both on every rule). An expression outside that part (macros such as
``all()``, methods, indexing, list or map literals) runs on cel-python's interpreter.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import celpy
import lark
from celpy import celtypes
from celpy.evaluation import CELEvalError, base_functions, celstr

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
def compile_rule(expression: str) -> "ClosureProgram | celpy.Runner":
    """Parse ``expression`` and return a program with ``evaluate({"self": value})`` (cached per expression
    text): a :class:`ClosureProgram` when the expression keeps to the part of CEL it covers, else
    cel-python's interpreted program.

    Raises:
        CELRuleError: the expression is not valid CEL.
    """
    env = celpy.Environment()
    try:
        ast = env.compile(expression)
    except celpy.CELParseError as exc:
        raise CELRuleError(f"CEL rule {expression!r} does not parse: {exc}") from exc
    try:
        return ClosureProgram(expression, _closure(ast))
    except _Unsupported:
        return compile_interpreted(expression)


def compile_interpreted(expression: str) -> celpy.Runner:
    """cel-python's own interpreted program of ``expression`` (the reference ClosureProgram is checked
    against). Raises CELRuleError when it does not parse."""
    env = celpy.Environment()
    try:
        return env.program(env.compile(expression))
    except celpy.CELParseError as exc:
        raise CELRuleError(f"CEL rule {expression!r} does not parse: {exc}") from exc


# --- CEL parse tree -> Python closures ------------------------------------------------------------

_Result = Any  # a celtypes value or a CELEvalError (errors are values until the end, as in CEL)
_Closure = Callable[[Mapping[str, Any]], _Result]
_VARIABLES = frozenset({"self"})  # the only name a validation rule's activation binds (oldSelf is skipped)


class _Unsupported(Exception):
    """The expression uses CEL outside what _closure translates; it runs on cel-python's interpreter."""


class ClosureProgram:
    """A CEL expression translated into Python closures; ``evaluate`` is cel-python's Runner.evaluate:
    returns the value, raises ``celpy.CELEvalError`` when the result is an error."""

    def __init__(self, expression: str, run: _Closure) -> None:
        self.expression = expression
        self._run = run

    def evaluate(self, activation: Mapping[str, Any]) -> celtypes.Value:
        value = self._run(activation)
        if isinstance(value, CELEvalError):
            raise value
        return value


_BINARY = {"relation_lt": "_<_", "relation_le": "_<=_", "relation_ge": "_>=_", "relation_gt": "_>_",
           "relation_eq": "_==_", "relation_ne": "_!=_", "relation_in": "_in_", "addition_add": "_+_",
           "addition_sub": "_-_", "multiplication_div": "_/_", "multiplication_mul": "_*_",
           "multiplication_mod": "_%_"}
# Exceptions of an operator function -> the message cel-python's Evaluator gives them (None: the
# "no matching overload" text); the same per node kind as celpy.evaluation.Evaluator.
_ARITH_ERRORS = ((ValueError, "return error for overflow"), (OverflowError, "return error for overflow"))
_NODE_ERRORS: dict[str, tuple[tuple[type[Exception], str | None], ...]] = {
    "relation": ((TypeError, None),),
    "addition": ((TypeError, None), *_ARITH_ERRORS),
    "multiplication": ((TypeError, None), (ZeroDivisionError, "modulus or divide by zero"), *_ARITH_ERRORS),
    "unary": ((TypeError, None), (ValueError, "return error for overflow")),
    "conditionalor": ((TypeError, None),),
    "conditionaland": ((TypeError, None),),
    "expr": ((TypeError, None),),
}


def _call(kind: str, label: str, func: Callable[..., _Result], *args: _Result) -> _Result:
    """``func(*args)`` with its exceptions turned into the CELEvalError cel-python's Evaluator makes."""
    try:
        return func(*args)
    except Exception as ex:  # noqa: BLE001 - mapped below exactly as the interpreter maps them
        for exc_type, message in _NODE_ERRORS[kind]:
            if isinstance(ex, exc_type):
                text = message or (f"found no matching overload for {label} applied to "
                                   f"'({', '.join(str(type(a)) for a in args)})'")
                value = CELEvalError(text, ex.__class__, ex.args)
                value.__cause__ = ex
                return value
        raise


def _only(tree: lark.Tree) -> lark.Tree:
    if len(tree.children) != 1:
        raise _Unsupported(tree.data)
    return tree.children[0]


def _closure(tree: lark.Tree) -> _Closure:  # noqa: C901 - one branch per grammar rule
    """Translate a celpy parse (sub)tree into a closure over the activation; raises _Unsupported."""
    kind, children = tree.data, tree.children
    if kind in ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication",
                "unary", "member") and len(children) == 1:
        return _closure(children[0])
    if kind == "expr" and len(children) == 3:
        cond, left, right = (_closure(c) for c in children)
        choose = base_functions["_?_:_"]
        false = celtypes.BoolType(False)

        def conditional(act: Mapping[str, Any]) -> _Result:
            value = cond(act)
            if value:
                return _call("expr", "_?_:_", choose, value, left(act), false)
            return _call("expr", "_?_:_", choose, value, false, right(act))
        return conditional
    if kind in ("conditionalor", "conditionaland") and len(children) == 2:
        left, right = (_closure(c) for c in children)
        name = "_||_" if kind == "conditionalor" else "_&&_"
        func = base_functions[name]
        return lambda act: _call(kind, name, func, left(act), right(act))
    if kind in ("relation", "addition", "multiplication") and len(children) == 2:
        op_tree, right_tree = children
        if op_tree.data not in _BINARY:
            raise _Unsupported(op_tree.data)
        left, right = _closure(_only(op_tree)), _closure(right_tree)
        func, label = base_functions[_BINARY[op_tree.data]], repr(op_tree.data)
        return lambda act: _call(kind, label, func, left(act), right(act))
    if kind == "unary" and len(children) == 2:
        op_tree, operand_tree = children
        name = {"unary_not": "!_", "unary_neg": "-_"}.get(op_tree.data)
        if name is None:
            raise _Unsupported(op_tree.data)
        operand, func, label = _closure(operand_tree), base_functions[name], repr(op_tree.data)
        return lambda act: _call("unary", label, func, operand(act))
    if kind == "member_dot":
        member_tree, token = children
        member, field_name = _closure(member_tree), token.value

        def select(act: Mapping[str, Any]) -> _Result:
            value = member(act)
            if isinstance(value, CELEvalError):
                return value
            if isinstance(value, celtypes.MapType) and not isinstance(value, celtypes.MessageType):
                try:
                    return value[field_name]
                except KeyError:
                    return CELEvalError(f"no such member in mapping: {field_name!r}", KeyError, None)
            if isinstance(value, celtypes.MessageType):
                return value.get(field_name)
            return CELEvalError(f"{value!r} with type: '{type(value)}' does not support field selection",
                                TypeError, None)
        return select
    if kind == "primary":
        return _primary(_only(tree))
    raise _Unsupported(kind)


def _primary(child: lark.Tree) -> _Closure:
    kind = child.data
    if kind == "paren_expr":
        return _closure(_only(child))
    if kind == "literal":
        value = _literal(_only(child))
        return lambda act: value
    if kind == "ident":
        name = child.children[0].value
        if name not in _VARIABLES:
            raise _Unsupported(f"identifier {name}")

        def variable(act: Mapping[str, Any]) -> _Result:
            try:
                return act[name]
            except KeyError as ex:
                return CELEvalError(f"undeclared reference to '{name}'", ex.__class__, ex.args)
        return variable
    if kind == "ident_arg":
        token = child.children[0]
        args = [_closure(c) for c in child.children[1].children] if len(child.children) == 2 else []
        if token.value == "has":
            if len(args) != 1:
                raise _Unsupported("has() arity")
            arg = args[0]
            return lambda act: celtypes.BoolType(not isinstance(arg(act), CELEvalError))
        if token.value not in base_functions or token.value == "dyn":
            raise _Unsupported(f"function {token.value}")
        func = base_functions[token.value]

        def call(act: Mapping[str, Any]) -> _Result:
            values = [a(act) for a in args]
            for value in values:
                if isinstance(value, CELEvalError):
                    return value
            try:
                return func(*values)
            except (ValueError, TypeError, AttributeError) as ex:
                text = "return error for overflow" if isinstance(ex, ValueError) else "no such overload"
                error = CELEvalError(text, ex.__class__, ex.args)
                error.__cause__ = ex
                return error
        return call
    raise _Unsupported(kind)


def _literal(token: lark.Token) -> _Result:
    """The value of a literal token, exactly as celpy.evaluation.Evaluator.literal makes it."""
    try:
        if token.type == "FLOAT_LIT":
            return celtypes.DoubleType(token.value)
        if token.type == "INT_LIT":
            return celtypes.IntType(token.value)
        if token.type in ("MLSTRING_LIT", "STRING_LIT"):
            return celstr(token)
        if token.type == "BOOL_LIT":
            return celtypes.BoolType(token.value.lower() == "true")
        if token.type == "NULL_LIT":
            return None
    except ValueError as ex:
        return CELEvalError(ex.args[0], ex.__class__, ex.args)
    raise _Unsupported(f"literal {token.type}")


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


_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _to_cel(value: Any, schema: dict[str, Any] | None,
            memo: dict[tuple[int, int], celtypes.Value] | None) -> celtypes.Value:
    # The CEL values are built with the builtin constructors of their base types (int, float, str, dict):
    # the same values cel-python's own constructors make for these inputs, without their per-call
    # dispatch (IntType's wraps a range-check closure with functools.wraps on every call). Integers
    # outside int64 still go through IntType, which raises as before.
    schema = schema or {}
    kind = schema.get("type")
    if value is None:
        return None
    vtype = type(value)
    if kind == "string" and vtype is str:
        return str.__new__(celtypes.StringType, value)
    if kind == "number" and (vtype is int or vtype is float):
        return float.__new__(celtypes.DoubleType, value)
    if kind == "integer" and vtype is int:
        return int.__new__(celtypes.IntType, value) if _INT64_MIN <= value <= _INT64_MAX else celtypes.IntType(value)
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return celtypes.DoubleType(value)
    if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
        return celtypes.IntType(value)
    if kind == "array" and isinstance(value, list):
        return celtypes.ListType([to_cel(item, schema.get("items"), memo) for item in value])
    if kind == "object" and isinstance(value, dict) and ("properties" in schema or "additionalProperties" in schema):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        extra = extra if isinstance(extra, dict) else None
        out = celtypes.MapType()
        for key, item in value.items():
            out[str.__new__(celtypes.StringType, key) if type(key) is str else celtypes.StringType(key)] = \
                to_cel(item, props.get(key, extra), memo)
        return out
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


def compile_rules(schema: dict[str, Any]) -> int:
    """Compile (and cache) every rule and message expression of ``schema`` now; returns how many.

    The first compile builds cel-python's parser (about 1 s of CPU); a long-lived process (the operator)
    calls this at start-up so that the first object it validates does not pay for it.

    Raises:
        CELRuleError: a rule of the schema is not valid CEL.
    """
    expressions = {e for rule in _rules_of(schema) for e in (rule.rule, rule.message_expression) if e}
    for expression in expressions:
        compile_rule(expression)
    return len(expressions)


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
