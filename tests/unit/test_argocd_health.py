"""deploy/argocd/health.lua, the Argo CD health check of RLRuns, run with lupa's Lua 5.1 the way Argo CD runs it
(util/lua/lua.go in argoproj/argo-cd: gopher-lua, a Lua 5.1; only the base, table and package libraries
and a reduced os library are opened; the object is the global ``obj``; the returned table's status must be
one of six codes, else Argo CD reports Unknown), against RLRuns the real operator wrote
(tests/data/argocd/*.yaml, recorded and kept current by tests/flow/test_gitops.py); and the argocd-cm
snippet of docs/gitops.md, which must embed the script as it is.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import lupa.lua51
import pytest
import yaml

from rlrun_api import constants

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "argocd" / "health.lua"
FIXTURES = ROOT / "tests" / "data" / "argocd"
DOC = ROOT / "docs" / "gitops.md"
HEALTH_CODES = ("Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown")
CONFIG_KEY = f"resource.customizations.health.{constants.GROUP}_{constants.KIND}"
INVALID_STATUS = ("Unknown", "Lua returned an invalid health status")  # what Argo CD makes of a bad code


def to_lua(lua: Any, value: Any) -> Any:
    """A JSON value as Argo CD's decodeValue hands it to Lua: objects and arrays as tables (arrays from 1),
    numbers as Lua numbers, null as nil."""
    if isinstance(value, dict):
        table = lua.table()
        for key, item in value.items():
            if item is not None:
                table[key] = to_lua(lua, item)
        return table
    if isinstance(value, list):
        table = lua.table()
        for index, item in enumerate(value, start=1):
            table[index] = to_lua(lua, item)
        return table
    return value


def run_health(obj: dict[str, Any], script: str | None = None) -> tuple[str, str]:
    """(status, message) that Argo CD would show for ``obj``.

    Raises:
        lupa.lua51.LuaError: the script failed (Argo CD then shows the error on the resource).
        TypeError: the script returned something Argo CD refuses (not a table or nil; a non-string message).
    """
    lua = lupa.lua51.LuaRuntime(register_eval=False, register_builtins=False)
    # Argo CD's state: SkipOpenLibs, then base, table and package (and a safe os, which this script needs
    # not: left out). No string library, hence no string methods either.
    lua.execute("debug.setmetatable('', nil); string, math, io, os, debug, coroutine, python = nil")
    lua.globals().obj = to_lua(lua, copy.deepcopy(obj))
    result = lua.execute(SCRIPT.read_text(encoding="utf-8") if script is None else script)
    if result is None:
        return "", ""
    if lupa.lua51.lua_type(result) != "table":
        raise TypeError(f"expect table output from Lua script, not {lupa.lua51.lua_type(result)}")
    status, message = result["status"], result["message"]
    if message is not None and not isinstance(message, str):
        raise TypeError(f"message must be a string, not {message!r}")
    if status not in HEALTH_CODES:
        return INVALID_STATUS
    return status, message or ""


def load_fixture(name: str) -> dict[str, Any]:
    return yaml.safe_load((FIXTURES / f"{name}.yaml").read_text(encoding="utf-8"))


# Every recorded fixture -> the health Argo CD shows for it.
EXPECTED = {
    "no-status": ("Progressing", "waiting for the operator to report the run's status"),
    "initializing": ("Progressing", "rolling out: trainer 0/1 updated, inference 0/1 updated, router 0/1 updated, "
                                    "orchestrator 0/1 updated"),
    "ready": ("Healthy", "AllRolesReady: every role runs the current generation"),
    "rolling-out": ("Progressing", "rolling out: inference 0/1 updated"),
    "rolling-out-unavailable": ("Progressing", "rolling out: inference 0/1 updated"),
    "generation-not-observed": ("Progressing", "the operator has not evaluated generation 3 yet"),
    "degraded-replicas-unavailable": ("Degraded", "ReplicasUnavailable: fewer ready replicas than desired: trainer"),
    "degraded-orchestrator-restarted": (
        "Degraded", "OrchestratorRestarted: orchestrator pods failed 1 time(s); last: 3 consecutive batches "
                    "without a trainable sample; environment builtin/reverse-words"),
    "suspended": ("Suspended", "Suspended: the run is suspended"),
    "succeeded": ("Healthy", "the run succeeded at step 3"),
    "failed": ("Degraded", "OrchestratorFailed: the orchestrator Job failed: 3 consecutive batches without a "
                           "trainable sample; environment builtin/reverse-words"),
    "invalid-spec": ("Degraded", "InvalidSpec: spec.algorithm.microBatchSize: algorithm.microBatchSize must be <= "
                                 "algorithm.batchSize while microBatchTokens is unset (a micro-batch is a slice of "
                                 "one step's batch); lower microBatchSize, or set microBatchTokens (microBatchSize "
                                 "is then ignored)"),
    "invalid-update": ("Degraded", "InvalidSpec: spec.environment.name: 'no-such-task' is not a builtin task; use "
                                   "one of: reverse-words"),
}


def test_every_fixture_has_an_expected_health() -> None:
    assert sorted(p.stem for p in FIXTURES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_health_of_what_the_operator_wrote(fixture: str) -> None:
    assert run_health(load_fixture(fixture)) == EXPECTED[fixture]


def test_the_fixtures_cover_every_health_an_rlrun_can_have() -> None:
    assert {status for status, _ in EXPECTED.values()} == {"Healthy", "Progressing", "Degraded", "Suspended"}
    assert {load_fixture(f).get("status", {}).get("phase") for f in EXPECTED} == {
        None, "Pending", "Initializing", "Running", "Suspended", "Succeeded", "Failed"}


def test_a_status_older_than_the_spec_is_progressing_whatever_it_says() -> None:
    for fixture in ("ready", "degraded-replicas-unavailable", "suspended", "failed"):
        obj = load_fixture(fixture)
        obj["metadata"]["generation"] += 1
        assert run_health(obj) == (
            "Progressing", f"the operator has not evaluated generation {obj['metadata']['generation']} yet"), fixture


def test_conditions_of_the_current_generation_before_its_children_are_progressing() -> None:
    obj = load_fixture("ready")  # the operator saw generation 2 (conditions) but has not applied it yet
    obj["metadata"]["generation"] = 2
    for cond in obj["status"]["conditions"]:
        cond["observedGeneration"] = 2
    assert run_health(obj) == ("Progressing", "generation 2 is not applied to the children yet")


def test_status_without_conditions_or_ready_is_progressing() -> None:
    waiting = ("Progressing", "waiting for the operator to report the run's status")
    obj = load_fixture("ready")
    obj["status"] = {"phase": "Running"}
    assert run_health(obj) == waiting
    obj["status"]["conditions"] = [c for c in load_fixture("ready")["status"]["conditions"] if c["type"] != "Ready"]
    assert run_health(obj) == waiting


def test_the_harness_runs_it_as_argo_cd_does() -> None:
    # No string library in Argo CD's state: the harness must fail a script that uses it, and accept what
    # Argo CD accepts.
    with pytest.raises(lupa.lua51.LuaError):
        run_health({}, 'return {status = string.upper("healthy")}')
    with pytest.raises(lupa.lua51.LuaError):
        run_health({}, 'local s = "x"; return {status = "Healthy", message = s:rep(2)}')
    assert run_health({}, 'return {status = "Healthy", message = table.concat({"a", "b"}, ", ")}') == (
        "Healthy", "a, b")
    assert run_health({}, 'return {status = "Fine"}') == INVALID_STATUS
    assert run_health({"a": [10, 20]}, 'return {status = "Healthy", message = tostring(obj.a[2])}') == (
        "Healthy", "20")
    assert lupa.lua51.LuaRuntime().eval("_VERSION") == "Lua 5.1"


def test_the_script_uses_no_library_argo_cd_leaves_closed() -> None:
    text = SCRIPT.read_text(encoding="utf-8")
    used = set(re.findall(r"\b(string|math|io|os|debug|coroutine)\s*\.", text))
    assert used == set()


def get_doc_documents() -> list[dict[str, Any]]:
    """Every YAML document of docs/gitops.md's ```yaml blocks."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return [d for block in blocks for d in yaml.safe_load_all(block) if d]


def test_the_doc_embeds_the_script_exactly() -> None:
    (config,) = [d for d in get_doc_documents() if d.get("kind") == "ConfigMap"
                 and d["metadata"]["name"] == "argocd-cm"]
    assert config["data"][CONFIG_KEY] == SCRIPT.read_text(encoding="utf-8")
    assert config["data"]["application.resourceTrackingMethod"] == "annotation"
    # The embedded script is the one that runs: it still gives the fixtures' health.
    assert run_health(load_fixture("ready"), config["data"][CONFIG_KEY]) == EXPECTED["ready"]


def test_the_doc_syncs_the_crd_then_the_operator_then_the_runs() -> None:
    documents = get_doc_documents()
    apps = {d["metadata"]["name"]: d for d in documents if d.get("kind") == "Application"}
    order = ["rlrun-crd", "rlrun-operator", "rlrun-runs"]
    assert sorted(apps) == sorted(order)
    waves = [int(apps[name]["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"]) for name in order]
    assert waves == sorted(set(waves))
    crd = apps["rlrun-crd"]["spec"]
    assert {"Prune=false", "Delete=false"} <= set(crd["syncPolicy"]["syncOptions"])
    assert not crd["syncPolicy"]["automated"].get("prune")
    source = yaml.safe_load((ROOT / crd["source"]["path"] / crd["source"]["directory"]["include"]).read_text())
    assert (source["kind"], source["metadata"]["name"]) == ("CustomResourceDefinition", f"rlruns.{constants.GROUP}")
    chart = apps["rlrun-operator"]["spec"]["source"]
    assert (ROOT / chart["path"] / "Chart.yaml").is_file() and chart["helm"]["skipCrds"] is True
    assert apps["rlrun-runs"]["spec"]["syncPolicy"]["automated"]["prune"] is False
    # Waves wait on the Applications' health only with Argo CD's Application health check restored.
    (config,) = [d for d in documents if d.get("kind") == "ConfigMap"]
    app_health = config["data"]["resource.customizations.health.argoproj.io_Application"]
    assert run_health({"status": {"health": {"status": "Degraded", "message": "x"}}}, app_health) == ("Degraded", "x")
    assert run_health({"status": {"health": {"status": "Healthy"}}}, app_health) == ("Healthy", "")
    assert run_health({}, app_health) == ("Progressing", "")
