"""Property-based bad input (issue 11 §4): RLRuns generated from the CRD's own schema, then mutated
(the strategies are tests/support/rlrun_gen.py).

Properties:
- every generated valid run passes ``validate()`` and renders (rlrun_operator.render) without raising;
- every mutation of it (wrong types at random paths, unknown fields, out-of-range numbers, empty and huge
  strings, null where an object is expected, values JSON cannot carry) gives ``validate()`` errors that never
  come from an exception, each at a field path (``spec.x.y``) with a fix, or no error and a run that renders;
- ``rlrun validate FILE`` on such files, on YAML that is not an object, on several documents, on deeply
  nested or recursive YAML exits 2 with ``FILE: field: ...`` lines and no traceback.
The operator side (InvalidSpec, no child) is tests/flow/test_bad_input_operator.py.

Deterministic: ``derandomize=True`` and no example database, so CI sees the same examples every run.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from example_runs import ROOT
from rlrun_api import spec, validation
from rlrun_cli.main import main as rlrun_main, prepare_for_render
from rlrun_gen import (BAD_VALUES, FIX_WORDS, SCHEMA, SETTINGS, TINY, get_at, mutations, out_of_range, schema_at,
                       set_at, valid_runs, walk)
from rlrun_operator import reconcile
from rlrun_operator.render import render

validation.validate(TINY)  # compiles the CEL rules now: lark raises the recursion limit, which hypothesis warns of


def check_errors(run: dict[str, Any], errors: list[validation.FieldError]) -> None:
    """Each error comes from a check, not an exception, names a field of ``run`` first and says how to fix it."""
    for error in errors:
        assert "this is a bug in rlrun" not in error.message, error
        heads = {*run, *SCHEMA["properties"]} if isinstance(run, dict) else set()
        assert error.path.startswith("[") or any(error.path == head or error.path.startswith((f"{head}.", f"{head}["))
                                                 for head in heads if isinstance(head, str)), f"no field path: {error}"
        assert FIX_WORDS.search(error.message), f"no fix: {error}"


def check_renders(run: dict[str, Any]) -> None:
    """``rlrun render``'s path: defaults, the namespace (metadata.namespace or "default"), render."""
    manifests = render(prepare_for_render(run, None))
    assert {m["kind"] for m in manifests} >= {"ConfigMap", "StatefulSet", "Deployment", "Job"}


@settings(max_examples=60, **SETTINGS)
@given(run=valid_runs())
def test_generated_valid_runs_validate_and_render(run) -> None:
    assert validation.validate(run) == []
    check_renders(run)


def regression(**changes: Any) -> dict[str, Any]:
    """The tiny example with dotted paths set (a crash found by the generator, kept as an @example)."""
    run = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = run
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return run


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def alias_bomb(levels: int) -> list[Any]:
    """What ``a: &a [x, x, ...]; b: &b [*a, *a, ...]; ...`` loads as: 10 ** levels leaves, shared."""
    value: list[Any] = ["x"] * 10
    for _ in range(levels):
        value = [value] * 10
    return value


def cyclic() -> dict[str, Any]:
    """What ``spec: &s {model: *s}`` loads as: a mapping that contains itself."""
    run = copy.deepcopy(TINY)
    run["spec"]["environment"]["args"]["self"] = run["spec"]["environment"]
    return run


# Crashes the generator found (each gave "cannot be validated (...); this is a bug in rlrun", or passed
# validation with a value no run can use), kept as regressions.
CRASHES = [
    regression(**{"spec.algorithm.learningRate": math.nan}),  # NaN passed every bound: "OK"
    regression(**{"spec.algorithm.sampling.topP": math.inf}),
    regression(**{"spec.model.maxModelLen": 2 ** 64}),  # CEL conversion: ValueError overflow
    regression(**{"spec.environment.seed": -(2 ** 63) - 1}),
    regression(**{"spec.environment.args.big": 10 ** 30}),  # inside a free-form field too
    regression(**{"spec.": 1}),  # an unknown field named "": the error had no path at all
    regression(**{"spec.pod.nodeSelector": {1: "a"}}),  # YAML `1: a`: _closest() called .lower() on 1
    regression(**{"spec.algorithm.3": 1}),
    regression(**{"spec.environment.args.when": datetime.date(2026, 1, 2)}),  # CEL: unexpected type
    regression(**{"spec.model.name": b"bytes"}),  # YAML !!binary
    regression(**{"spec.environment.args.deep": nested(400)}),  # RecursionError
    regression(**{"spec.environment.args.bomb": alias_bomb(8)}),  # 10 ** 9 shared leaves: never returned
    cyclic(),  # RecursionError
]


@settings(max_examples=250, **SETTINGS)
@given(run=mutations())
@example(run=regression(**{"spec.inference": "x"}))
@example(run=regression(**{"spec.inference.disaggregation": [1]}))
@example(run=regression(spec=[]))
def test_mutated_runs_give_field_named_errors_never_exceptions(run) -> None:
    errors = validation.validate(run)
    check_errors(run, errors)
    if not errors:
        check_renders(run)
        return
    if not isinstance(run.get("metadata"), dict):
        return  # the API server stores no such object
    # The operator's own path for a stored invalid run (no uid: nothing is memoised): the same errors,
    # and a status Ready=False reason InvalidSpec that names them. (The API server checks what the operator
    # writes to status against the schema, so a stored status is never an odd value.)
    run = {k: v for k, v in run.items() if k != "status"}
    assert reconcile.get_invalid(run) == [f"{e.path}: {e.message}" for e in errors]
    change = reconcile.plan_status(run, [], None, None, reconcile.get_invalid(run), now=lambda: "2026-01-01T00:00:00Z")
    ready = next(c for c in change.patch["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert errors[0].path in ready["message"]


@settings(max_examples=400, **SETTINGS)
@given(run=mutations() | valid_runs())
@example(run=regression(**{"spec.algorithm.batchSize": True}))  # a bool is no integer in either
@example(run=regression(**{"spec.algorithm.batchSize": 4.0}))  # nor is 4.0 in Draft 4
@example(run=regression(**{"status.conditions": [{"type": "Ready", "status": "True", "reason": "R", "message": "",
                                                   "lastTransitionTime": "yesterday"}]}))  # date-time
def test_fast_schema_check_agrees_with_jsonschema(run) -> None:
    """check_schema says "valid" from fastjsonschema's compiled schema alone: it must never pass what
    jsonschema (whose errors it reports otherwise) refuses, nor refuse what jsonschema passes."""
    if not isinstance(run, dict) or validation.check_values(run):
        return  # validate() stops before the schema
    defaulted = spec.apply_defaults(run)
    slow = list(validation._validator().iter_errors(defaulted))
    assert validation.is_schema_valid(defaulted) == (not slow), [e.message for e in slow]


def test_fast_schema_check_agrees_with_jsonschema_at_every_field_of_the_example() -> None:
    """The same agreement, swept: every field of the defaulted tiny example set in turn to each value just out
    of its bounds, each bad value and, for a string, the value with a newline before or after it (Python's
    ``$`` matches before a final newline, fastjsonschema's and the API server's do not)."""
    base = spec.apply_defaults(copy.deepcopy(TINY))
    checked = refused = 0
    for path in walk(base):
        if not path:
            continue
        value = get_at(base, path)
        candidates = out_of_range(schema_at(path)) + BAD_VALUES
        if isinstance(value, str):
            candidates += [value + "\n", "\n" + value]
        for bad in candidates:
            run = set_at(copy.deepcopy(base), path, copy.deepcopy(bad))
            if validation.check_values(run):
                continue  # validate() stops before the schema
            slow = list(validation._validator().iter_errors(run))
            assert validation.is_schema_valid(run) == (not slow), (path, bad, [e.message for e in slow])
            checked, refused = checked + 1, refused + bool(slow)
    assert checked > 1500 and refused > checked // 2, (checked, refused)


@pytest.mark.parametrize("dotted, value", [("metadata.name", "tiny-reverse\n"), ("spec.storage.size", "10Gi\n"),
                                           ("spec.inference.disaggregation.ratio", "1:1\n")])
def test_a_final_newline_does_not_pass_a_pattern(dotted, value) -> None:
    """The API server's RE2 ``$`` is the end of the text; Python's also matches before a final newline, which
    let these values through before (validation.end_of_text)."""
    errors = validation.validate(regression(**{dotted: value}))
    assert [e.path for e in errors] == [dotted], errors


@pytest.mark.parametrize("run", CRASHES, ids=lambda run: "")
def test_found_crashes_are_field_named_errors(run) -> None:
    errors = validation.validate(run)
    assert errors
    check_errors(run, errors)


@pytest.mark.parametrize("document", [None, [], [{}], "spec", 5, 1.5, True, b"x", {1: 2}])
def test_non_mapping_documents(document) -> None:
    (error,) = validation.validate(document)
    assert "this is a bug" not in error.message and FIX_WORDS.search(error.message), error


# --- `rlrun validate FILE` -------------------------------------------------------------------------

def validate_file(text: str | bytes) -> tuple[int, str, list[str]]:
    """``rlrun validate FILE`` in-process on ``text``: (exit status, FILE, output lines)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = rlrun_main(["validate", str(path)])
    assert err.getvalue() == "" and "Traceback" not in out.getvalue()
    return status, str(path), out.getvalue().splitlines()


def check_cli_lines(path: str, lines: list[str]) -> None:
    """Every line is ``FILE: field: problem; fix`` (``FILE (document i): ...`` in a stream)."""
    for line in lines:
        assert line.startswith(path), line
        rest = line[len(path):]
        rest = re.sub(r"^ \(document \d+\)", "", rest)
        assert rest.startswith(": ") and "this is a bug" not in rest and FIX_WORDS.search(rest), line


@settings(max_examples=40, **SETTINGS)
@given(run=mutations(), stream=st.sampled_from(["one", "first", "second"]))
@example(run=regression(**{"metadata.namespace": None}), stream="one")  # valid: CI drew it
def test_rlrun_validate_answers_every_mutated_file_with_field_lines(run, stream) -> None:
    text = yaml.safe_dump(run, allow_unicode=True)
    if stream != "one":  # the mutated run in a stream next to the valid tiny example
        docs = [run, TINY] if stream == "first" else [TINY, run]
        text = yaml.safe_dump_all(docs, allow_unicode=True)
    status, path, lines = validate_file(text)
    if validation.validate(run):
        check_cli_lines(path, lines)
        assert status == 2 and lines and all(re.match(r"^: |^ \(document \d\): ", line[len(path):]) for line in lines)
    else:  # a mutation can leave the run valid (e.g. metadata.namespace: null)
        assert (status, lines) == (0, [f"{path}: OK"])


TINY_TEXT = (ROOT / "examples" / "rlrun-tiny.yaml").read_text()
BAD_FILES = {
    "empty": "",
    "only-comments": "# nothing\n",
    "list": "- 1\n- 2\n",
    "scalar": "just a string\n",
    "number": "42\n",
    "null-document-then-list": "---\n---\n- a\n",
    "valid-then-list": TINY_TEXT + "---\n[1, 2]\n",
    "valid-then-invalid": TINY_TEXT + "---\n" + TINY_TEXT.replace("batchSize: 128", "batchSize: -1"),
    "not-rlrun": "apiVersion: v1\nkind: ConfigMap\n",
    "spec-null": "apiVersion: rlrun.dev/v1alpha1\nkind: RLRun\nmetadata: {name: a}\nspec:\n",
    "spec-list": "apiVersion: rlrun.dev/v1alpha1\nkind: RLRun\nmetadata: {name: a}\nspec: [1]\n",
    "metadata-string": "apiVersion: rlrun.dev/v1alpha1\nkind: RLRun\nmetadata: a\nspec: {}\n",
    "bad-syntax": "spec: {model: [\n",
    "tab-indent": "spec:\n\tmodel: {}\n",
    "duplicate-key": TINY_TEXT.replace("  model:\n", "  suspend: true\n  suspend: false\n  model:\n"),
    "python-tag": "!!python/object/apply:os.system [echo hi]\n",
    "binary": b"\x89PNG\r\n\x1a\n\x00\x00",
    "nan": TINY_TEXT.replace("learningRate: 0.001", "learningRate: .nan"),
    "inf": TINY_TEXT.replace("maxModelLen: 128", "maxModelLen: .inf"),
    "huge-int": TINY_TEXT.replace("seed: 0", "seed: 99999999999999999999999999"),
    "date": TINY_TEXT.replace("seed: 0", "seed: 2026-01-02"),
    "int-key": TINY_TEXT.replace("  model:\n", "  1: one\n  model:\n"),
    "null-key": TINY_TEXT.replace("  model:\n", "  ~: none\n  model:\n"),
    "unhashable-key": TINY_TEXT.replace("  model:\n", "  ? [a]\n  : 1\n  model:\n"),
    "binary-value": TINY_TEXT.replace("name: rlrun-tiny", "name: !!binary aGVsbG8="),
    "set-value": TINY_TEXT.replace("min_words: 4", "min_words: !!set {a, b}"),
    # PyYAML's composer recurses per level (RecursionError), its scanner is quadratic in the flow depth
    # (5000 levels: 4 s of CPU), so 2000 levels: deep enough, and quick.
    "deep-flow": "[" * 2000 + "]" * 2000,
    "deep-in-args": TINY_TEXT.replace("min_words: 4", "min_words: " + "[" * 2000 + "]" * 2000),
    "deep-args": TINY_TEXT.replace("min_words: 4", "min_words: " + "[" * 200 + "]" * 200),  # > MAX_DEPTH
    "alias-cycle": TINY_TEXT.replace("  environment:\n", "  environment: &env\n").replace(
        "min_words: 4", "min_words: *env"),
    "alias-bomb": TINY_TEXT.replace("min_words: 4", "min_words: " + "".join(
        f"\n      l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "x"] * 10) + "]" for i in range(8))),
    "huge-string": TINY_TEXT.replace("  model:\n", "  imagePullPolicy: " + "x" * 200_000 + "\n  model:\n"),
    "huge-name": TINY_TEXT.replace("name: tiny-reverse", "name: " + "a" * 10_000),
    "bom": "\ufeff" + TINY_TEXT.replace("batchSize: 128", "batchSize: 12"),
}
ODD_VALID_FILES = {
    "date-in-args": TINY_TEXT.replace("min_words: 4", "min_words: 2026-01-02"),  # a string, as kubectl reads it
    "huge-model-name": TINY_TEXT.replace("name: rlrun-tiny", "name: " + "x" * 200_000),
    "bom": "\ufeff" + TINY_TEXT,
    "crlf": TINY_TEXT.replace("\n", "\r\n"),
    "trailing-document-marker": TINY_TEXT + "---\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_rlrun_validate_bad_files_exit_2_with_field_lines(name) -> None:
    status, path, lines = validate_file(BAD_FILES[name])
    assert status == 2 and lines, lines
    check_cli_lines(path, lines)


@pytest.mark.parametrize("name", sorted(ODD_VALID_FILES))
def test_rlrun_validate_odd_but_valid_files(name) -> None:
    assert validate_file(ODD_VALID_FILES[name])[0] == 0


def test_console_script_on_bad_files_exits_2_without_traceback(tmp_path) -> None:
    files = []
    for name in ("deep-flow", "set-value", "int-key", "nan", "alias-cycle", "valid-then-list"):
        files.append(tmp_path / f"{name}.yaml")
        files[-1].write_text(BAD_FILES[name])
    result = subprocess.run([str(Path(sys.executable).parent / "rlrun"), "validate", *map(str, files)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr == "", result.stderr
    assert "Traceback" not in result.stdout
    for path in map(str, files):
        lines = [line for line in result.stdout.splitlines() if line.startswith(path)]
        assert lines, path
        check_cli_lines(path, lines)
