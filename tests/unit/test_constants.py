"""api/rlrun_api/constants.py names each thing once: no name is assigned twice, and no two names of one kind
(metric, env var, port, label, annotation, Event reason, component) share a value unless listed below."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from rlrun_api import constants

SOURCE = Path(constants.__file__)

# Kinds of constants whose values must differ, by how their names look.
KINDS = {
    "metric": lambda name: "METRIC_" in name,          # METRIC_*, VLLM_METRIC_*, OPERATOR_METRIC_*
    "env": lambda name: name.startswith("ENV_"),
    "port": lambda name: name.endswith("_PORT") and not name.startswith("ENV_"),
    "label": lambda name: name.startswith("LABEL_"),
    "annotation": lambda name: name.startswith("ANNOTATION_"),
    "event": lambda name: name.startswith("EVENT_"),
    "component": lambda name: name.startswith("COMPONENT_"),
}
# Equal values that are meant: (kind, value) -> the names that share it.
INTENTIONAL = {
    # vLLM (inference pods) and vllm-router (its own pod) both serve on 8000; the router discovers engines
    # on the inference port by definition.
    ("port", 8000): {"INFERENCE_PORT", "ROUTER_PORT", "SERVICE_DISCOVERY_PORT"},
}


def get_assignments(source: str) -> list[tuple[str, int]]:
    """(name, line) of every module-level assignment of ``source`` (=, annotated and augmented)."""
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            targets = [node.target]
        else:
            continue
        out.extend((t.id, node.lineno) for t in targets)
    return out


def get_reassigned(source: str) -> dict[str, list[int]]:
    """{name: lines} of the names assigned more than once at module level."""
    lines: dict[str, list[int]] = defaultdict(list)
    for name, line in get_assignments(source):
        lines[name].append(line)
    return {name: found for name, found in lines.items() if len(found) > 1}


def metric_key(value: str) -> str:
    """The exposed name a metric constant claims: prometheus_client exposes a counter ``x`` as
    ``x_total``, so ``x`` and ``x_total`` are one name."""
    return value.removesuffix("_total")


def get_clashes(names: list[str], values: dict[str, object]) -> dict[tuple[str, object], set[str]]:
    """{(kind, value): names} of the constants of one kind sharing a value, beyond INTENTIONAL."""
    shared: dict[tuple[str, object], set[str]] = defaultdict(set)
    for kind, matches in KINDS.items():
        for name in names:
            value = values[name]
            if not matches(name) or not isinstance(value, (str, int)) or isinstance(value, bool):
                continue
            key = metric_key(value) if kind == "metric" and isinstance(value, str) else value
            shared[(kind, key)].add(name)
    return {key: group for key, group in shared.items() if len(group) > 1 and INTENTIONAL.get(key) != group}


def test_no_constant_is_assigned_twice():
    assert get_reassigned(SOURCE.read_text()) == {}


def test_no_two_constants_of_a_kind_share_a_value():
    names = sorted({name for name, _ in get_assignments(SOURCE.read_text())})
    assert get_clashes(names, vars(constants)) == {}


def test_every_intentional_equal_value_still_exists():
    """A stale entry in INTENTIONAL would hide a future clash of that value."""
    for (kind, value), group in INTENTIONAL.items():
        assert {getattr(constants, name) for name in group} == {value}, (kind, group)


@pytest.mark.parametrize("source, expected", [
    ("A = 1\nB = 2\nA = 3\n", {"A": [1, 3]}),
    ("A: int = 1\nA += 1\n", {"A": [1, 2]}),
    ("A, B = 1, 2\nB = 3\n", {"B": [1, 2]}),
    ("A = 1\ndef f():\n    A = 2\n", {}),   # a local is not a module constant
])
def test_a_reassignment_is_found(source, expected):
    assert get_reassigned(source) == expected


def test_a_clash_is_found_and_intentional_ones_are_not():
    values = {"METRIC_A": "x_wait", "METRIC_B": "x_wait_total", "ENV_A": "E", "ENV_B": "E",
              "INFERENCE_PORT": 8000, "ROUTER_PORT": 8000, "SERVICE_DISCOVERY_PORT": 8000,
              "TRAINER_METRICS_PORT": 9091, "TRAINER_PORT_COUNT": 9091, "COMPONENT_X": "prefill",
              "INFERENCE_ROLE_X": "prefill"}
    assert get_clashes(sorted(values), values) == {("metric", "x_wait"): {"METRIC_A", "METRIC_B"},
                                                    ("env", "E"): {"ENV_A", "ENV_B"}}
    values["OTHER_PORT"] = 8000
    assert get_clashes(sorted(values), values) == {
        ("metric", "x_wait"): {"METRIC_A", "METRIC_B"}, ("env", "E"): {"ENV_A", "ENV_B"},
        ("port", 8000): {"INFERENCE_PORT", "ROUTER_PORT", "SERVICE_DISCOVERY_PORT", "OTHER_PORT"}}
