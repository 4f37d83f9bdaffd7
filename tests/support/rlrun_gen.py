"""Hypothesis strategies for RLRuns generated from the CRD's own schema, and mutations of them (the bad
input of tests/unit/test_bad_input.py and tests/flow/test_bad_input_operator.py).

``from_schema`` walks the CRD's openAPIV3Schema itself: the subset the CRD uses (object
properties/required/additionalProperties, x-kubernetes-preserve-unknown-fields, x-kubernetes-int-or-string
with its anyOf and pattern, arrays, enums, patterns, lengths, bounds, Draft 4's boolean exclusiveMinimum).
hypothesis-jsonschema was tried first: 0.23.1, its newest release, fails inside hypothesis 6.170 ("'many'
object has no attribute 'more'"), and it knows none of the x-kubernetes extensions. ``repair`` makes a
schema-valid spec satisfy the CRD's CEL rules and the semantic checks, so valid runs are not left to chance;
``mutations`` then breaks them.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any, Iterator

import yaml
from hypothesis import HealthCheck
from hypothesis import strategies as st

from rlrun_api import constants, names, sizing, spec, validation

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
SCHEMA = spec.crd_schema()
TINY = yaml.safe_load((ROOT / "examples" / "rlrun-tiny.yaml").read_text())
# Every message says what to do: one of these words (or phrases) appears after the problem.
FIX_WORDS = re.compile(r"\b(set|use|write|remove|add|lower|raise|change|pick|drop|shorten|fix|did you mean|"
                       r"enable|give|list|quote|flatten|split|make|keep|rename|name|replace|pass|save)\b")
JSON_LEAVES = st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8) | \
    st.floats(-1e6, 1e6, allow_nan=False)
JSON = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) |
                    st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


# --- a schema-valid value of any node of the CRD's schema ------------------------------------------

def _string(node: dict[str, Any]) -> st.SearchStrategy[str]:
    if "enum" in node:
        return st.sampled_from(node["enum"])
    low, high = node.get("minLength", 0), node.get("maxLength")
    if "pattern" in node:
        strategy = st.from_regex(node["pattern"], fullmatch=True)
        return strategy.filter(lambda s: len(s) >= low and (high is None or len(s) <= high))
    return st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=max(low, 0),
                   max_size=min(high or 12, 12) if high is None or high >= low else low)


def _number(node: dict[str, Any], integer: bool) -> st.SearchStrategy[Any]:
    low, high = node.get("minimum"), node.get("maximum")
    ex_low, ex_high = node.get("exclusiveMinimum") is True, node.get("exclusiveMaximum") is True
    int_low = None if low is None else (math.floor(low) + 1 if ex_low else math.ceil(low))
    int_high = None if high is None else (math.ceil(high) - 1 if ex_high else math.floor(high))
    ints = st.integers(-(2 ** 40) if int_low is None else int_low, 2 ** 40 if int_high is None else int_high)
    if integer:
        return ints
    floats = st.floats(min_value=low, max_value=high, exclude_min=ex_low and low is not None,
                       exclude_max=ex_high and high is not None, allow_nan=False, allow_infinity=False)
    return floats | ints


def from_schema(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values the CRD schema node ``node`` accepts (structural schema checks only, not its CEL rules)."""
    if node.get("x-kubernetes-int-or-string"):
        return st.integers(0, 10 ** 6) | st.from_regex(node["pattern"], fullmatch=True)
    kind = node.get("type")
    if kind == "string":
        return _string(node)
    if kind in ("integer", "number"):
        return _number(node, kind == "integer")
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(from_schema(node["items"]), max_size=3)
    if kind == "object":
        props = node.get("properties") or {}
        if not props and "additionalProperties" not in node:  # x-kubernetes-preserve-unknown-fields
            return st.dictionaries(st.text(max_size=6), JSON, max_size=3)
        required = set(node.get("required") or [])
        fixed = st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                      optional={k: from_schema(v) for k, v in props.items() if k not in required})
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=10)
            more = st.dictionaries(keys.filter(lambda k: k not in props), from_schema(extra), max_size=3)
            return st.tuples(fixed, more).map(lambda parts: {**parts[1], **parts[0]})
        return fixed
    raise AssertionError(f"schema node the generator does not know: {node}")


SPECS = from_schema(SCHEMA["properties"]["spec"])
RUN_NAMES = _string(SCHEMA["properties"]["metadata"]["properties"]["name"])


# --- schema-valid -> valid: the CEL rules and the semantic checks ----------------------------------

def repair(run_spec: dict[str, Any]) -> dict[str, Any]:
    """The schema-valid spec changed just enough to satisfy every CEL rule and semantic check."""
    # The autoscaler is not implemented (autoscaling.enabled must be false) and its section is still being
    # designed: it keeps its defaults here (the mutations below still reach it).
    run_spec = {k: v for k, v in run_spec.items() if k != "autoscaling"}
    out = spec.apply_defaults({"spec": copy.deepcopy(run_spec)})["spec"]
    alg = out["algorithm"]
    alg["batchSize"] = alg["rolloutsPerPrompt"] * max(1, alg["batchSize"] // alg["rolloutsPerPrompt"])
    if "microBatchSize" in alg:  # deprecated, no default
        alg["microBatchSize"] = min(alg["microBatchSize"], alg["batchSize"])
    alg["maxOffPolicySteps"] = max(alg["maxOffPolicySteps"], alg["maxAsyncLevel"])
    if alg["loss"]["ratioLow"] >= 1:
        alg["loss"]["ratioLow"] = 0.5
    if alg["loss"]["ratioHigh"] <= 1:
        alg["loss"]["ratioHigh"] = 2.0
    out["model"]["maxModelLen"] = max(out["model"]["maxModelLen"], alg["sampling"]["maxTokens"] + 1)
    if "maxTokens" in (out.get("evaluation") or {}):
        out["model"]["maxModelLen"] = max(out["model"]["maxModelLen"], out["evaluation"]["maxTokens"] + 1)
    trainer = out["trainer"]
    trainer.update(quantization="none", parallelism={"fsdp": -1, "ep": 1, "cp": 1})
    trainer["lora"]["rank"] = 0
    if trainer["gpusPerNode"] == 0:
        trainer["nodes"] = 1
    inference = out["inference"]
    if inference["gpusPerReplica"]:
        inference["tensorParallel"], inference["dataParallel"] = inference["gpusPerReplica"], 1
    disagg = inference["disaggregation"]
    if disagg["enabled"]:
        disagg["replicas"] = max(2, disagg["replicas"])
        try:
            sizing.size_pd(disagg["ratio"], disagg["replicas"])
        except sizing.SizingError:
            disagg.update(ratio="1:1", replicas=2)
    out["weightSync"]["transport"] = "filesystem"
    storage = out["storage"]
    if storage.get("claimName") is not None:
        storage.pop("storageClassName", None)
        if storage["claimName"]:
            storage.pop("size", None)
    env = out["environment"]
    if env["type"] == "builtin":
        env["name"] = constants.BUILTIN_ENVIRONMENTS[0]
    elif env["type"] == "python" and not validation.PYTHON_IMPORT_PATH.match(env["name"]):
        env["name"] = "my_package.envs:Env"
    pod = out["pod"]
    if "env" in pod:
        pod["env"] = [e for e in pod["env"] if e["name"] not in constants.RESERVED_ENV_NAMES]
    return out


@st.composite
def valid_runs(draw: st.DrawFn) -> dict[str, Any]:
    namespace = draw(st.from_regex(names.DNS_1123_LABEL, fullmatch=True).filter(lambda s: len(s) <= 63))
    return {"apiVersion": constants.API_VERSION, "kind": constants.KIND,
            "metadata": {"name": draw(RUN_NAMES), "namespace": namespace}, "spec": repair(draw(SPECS))}


# --- mutations -------------------------------------------------------------------------------------

def walk(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every path (tuple of keys and list indices) in ``value``, the root included."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from walk(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from walk(item, (*path, i))


def schema_at(path: tuple) -> dict[str, Any]:
    """The CRD schema node that describes ``path`` ({} where none does, e.g. inside free-form fields)."""
    node = SCHEMA
    for part in path:
        if isinstance(part, int):
            node = node.get("items") or {}
        else:
            props = node.get("properties") or {}
            extra = node.get("additionalProperties")
            node = props.get(part) or (extra if isinstance(extra, dict) else {})
    return node


def get_at(value: Any, path: tuple) -> Any:
    for part in path:
        value = value[part]
    return value


def set_at(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    get_at(value, path[:-1])[path[-1]] = new
    return value


BAD_VALUES = [None, "", "x" * 5000, "\x00", -1, 0, 1.5, True, [], {}, [None], {"": None}, "1", [[[]]],
              2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30, math.nan, math.inf, -math.inf, 1e308,
              {"spec": {}}, "Spec", "éü" * 3]
UNKNOWN_KEYS = ["", "x", "Spec", "batchsize", "gpus", "naem", "é", "a.b", "0", "x" * 300, "status"]


def out_of_range(node: dict[str, Any]) -> list[Any]:
    """Values just outside the bounds of a number or string schema node (none for other nodes)."""
    out: list[Any] = []
    if "minimum" in node:
        out += [node["minimum"] - 1, node["minimum"] - 0.5]
        if node.get("exclusiveMinimum") is True:
            out.append(node["minimum"])
    if "maximum" in node:
        out += [node["maximum"] + 1, node["maximum"] + 0.5]
    if "maxLength" in node:
        out.append("a" * (node["maxLength"] + 1))
    if "minLength" in node:
        out.append("")
    if "enum" in node:
        out += [str(node["enum"][0]).upper() + "x", ""]
    if "pattern" in node:
        out += ["-", " " + "1"]
    return out


@st.composite
def mutations(draw: st.DrawFn, roots: tuple[str, ...] = ("spec", "metadata")) -> dict[str, Any]:
    """A valid generated run with one to three mutations at random paths below ``roots`` (never the whole
    run: one that is not a mapping at all is test_non_mapping_documents)."""
    run = draw(valid_runs())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from([p for p in walk(run) if p[:1] in {(r,) for r in roots}]))
        target = get_at(run, path)
        how = draw(st.sampled_from(["replace", "replace", "unknown", "delete", "range", "json"]))
        if how == "delete" and len(path) == 1 and len(roots) == 1:
            how = "replace"  # keep the root the caller asked for
        if how == "unknown":
            target = target if isinstance(target, dict) else (run if len(roots) > 1 else run[roots[0]])
            target[draw(st.sampled_from(UNKNOWN_KEYS))] = draw(st.sampled_from(BAD_VALUES[:14]) | JSON)
        elif how == "delete":
            del get_at(run, path[:-1])[path[-1]]
        elif how == "range" and out_of_range(schema_at(path)):
            set_at(run, path, draw(st.sampled_from(out_of_range(schema_at(path)))))
        elif how == "json":
            set_at(run, path, draw(JSON))
        else:
            set_at(run, path, copy.deepcopy(draw(st.sampled_from(BAD_VALUES))))
    return run
