"""The real `rlrun` console script from the venv, run as a subprocess."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from example_runs import EXAMPLES, ROOT
from rlrun_api import __version__

RLRUN = Path(sys.executable).parent / "rlrun"
TINY = ROOT / "examples" / "rlrun-tiny.yaml"


def rlrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(RLRUN), *map(str, args)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return result


def test_console_script_is_installed() -> None:
    assert RLRUN.exists(), "install with `pip install -e .[runtime,test]`"


def test_version() -> None:
    result = rlrun("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"rlrun {__version__}")


def test_no_command_is_a_usage_error() -> None:
    result = rlrun()
    assert result.returncode == 2 and "usage: rlrun" in result.stderr


def test_validate_examples_ok() -> None:
    result = rlrun("validate", *EXAMPLES)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"{p}: OK" for p in EXAMPLES]


def tiny_with(**changes: object) -> str:
    """The tiny example as YAML text with dotted spec paths set (None deletes the key)."""
    rlrun = yaml.safe_load(TINY.read_text())
    for dotted, value in changes.items():
        node = rlrun["spec"]
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return yaml.safe_dump(rlrun, sort_keys=False)


def test_validate_invalid_file_prints_one_line_per_error(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(tiny_with(**{"algorithm.batchSize": 68, "algorithm.microBatchSize": 4,
                                "environment.name": "reverse-word", "algorithm.sampling.temperature": None,
                                "algorithm.sampling.temprature": 1.0}))
    result = rlrun("validate", bad, TINY)
    assert result.returncode == 2
    lines = result.stdout.splitlines()
    assert lines == [
        f"{bad}: spec.algorithm.sampling.temprature: unknown field; did you mean 'temperature'?",
        f"{TINY}: OK",
    ]
    bad.write_text(tiny_with(**{"algorithm.batchSize": 68, "algorithm.microBatchSize": 4,
                                "environment.name": "reverse-word"}))
    lines = rlrun("validate", bad).stdout.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["spec.algorithm.batchSize", "spec.environment.name"]
    assert "did you mean 'reverse-words'?" in lines[1]


@pytest.mark.parametrize("content,message", [
    (b"", "holds no YAML document"),
    (b"spec: {model: [\n", "is not valid YAML"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "is not UTF-8 text"),
    (b"- 1\n- 2\n", "not a mapping"),
    (b"apiVersion: apps/v1\nkind: Deployment\n", "not an RLRun"),
])
def test_validate_bad_files_exit_2_without_traceback(tmp_path, content, message) -> None:
    path = tmp_path / "f.yaml"
    path.write_bytes(content)
    result = rlrun("validate", path)
    assert result.returncode == 2
    assert result.stdout.startswith(f"{path}: ") and message in result.stdout


def test_validate_missing_file() -> None:
    result = rlrun("validate", "/nonexistent/run.yaml")
    assert result.returncode == 2 and "/nonexistent/run.yaml: no such file" in result.stdout


def test_crd_prints_the_source_crd_exactly() -> None:
    result = rlrun("crd")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "crds" / "rlrun.yaml").read_text()


def test_render_prints_manifests_in_the_default_namespace() -> None:
    result = rlrun("render", TINY)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "StatefulSet", "Deployment", "Job", "Service"} <= kinds
    assert {d["metadata"]["namespace"] for d in docs} == {"default"}
    assert all(d["metadata"]["name"].startswith("tiny-reverse-") for d in docs)


def test_render_prints_what_the_operator_creates_with_its_spec_hash() -> None:
    from rlrun_api import constants, spec
    from rlrun_operator import apply, reconcile
    from rlrun_operator.render import render

    result = rlrun("render", TINY)
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    run = spec.apply_defaults(yaml.safe_load(Path(TINY).read_text()))
    run["metadata"]["namespace"] = "default"
    rendered = render(run)
    sizes = reconcile.get_pool_sizes(run["spec"])
    assert docs == [apply.get_creatable(m, suspended=False, sizes=sizes) for m in rendered]
    inference = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tiny-reverse-inference")
    assert inference["metadata"]["annotations"][constants.ANNOTATION_APPLIED_SIZES] == '{"spec.inference.replicas":1}'
    for doc, manifest in zip(docs, rendered):
        # The hash the operator compares with on every reconcile (plan_child).
        assert doc["metadata"]["annotations"][constants.ANNOTATION_SPEC_HASH] == apply.get_spec_hash(manifest)
        assert "ownerReferences" not in doc["metadata"]
    assert "ownerReferences" in rlrun("render", "--help").stdout


def test_render_namespace_flag_and_conflict(tmp_path) -> None:
    result = rlrun("render", TINY, "-n", "team-a")
    assert result.returncode == 0
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(result.stdout)} == {"team-a"}
    complete = ROOT / "examples" / "rlrun-complete.yaml"  # declares metadata.namespace: rl
    result = rlrun("render", complete, "-n", "team-a")
    assert result.returncode == 2
    assert "metadata.namespace is 'rl' but -n/--namespace is 'team-a'" in result.stderr


def test_render_operator_namespace_flag() -> None:
    def operator_peer(*args: str) -> dict:
        result = rlrun("render", TINY, *args)
        assert result.returncode == 0, result.stderr
        policy = next(d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "NetworkPolicy")
        return policy["spec"]["ingress"][0]["from"][1]["namespaceSelector"]["matchLabels"]

    assert operator_peer() == {"kubernetes.io/metadata.name": "rlrun-system"}
    assert operator_peer("--operator-namespace", "ops") == {"kubernetes.io/metadata.name": "ops"}
    result = rlrun("render", TINY, "--operator-namespace", "Not_A_Namespace")
    assert (result.returncode, result.stdout) == (2, "")
    assert "--operator-namespace 'Not_A_Namespace' is not a namespace name" in result.stderr
    assert "Traceback" not in result.stderr


def test_render_refuses_an_invalid_run(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(tiny_with(**{"algorithm.sampling.maxTokens": 128}))
    result = rlrun("render", bad)
    assert (result.returncode, result.stdout) == (2, "")
    assert f"{bad}: spec.algorithm.sampling.maxTokens: " in result.stderr


def test_render_bad_yaml(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [")
    result = rlrun("render", bad)
    assert result.returncode == 2 and "is not valid YAML" in result.stderr


def test_local_without_the_runtime_says_how_to_install_it(tmp_path) -> None:
    # A Python in which vLLM cannot be imported: sitecustomize marks the module as absent (sys.modules[name]
    # = None is how Python records a module that must not be imported).
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = rlrun("local", TINY, env=env)
    assert result.returncode == 2
    assert "vllm" in result.stderr.splitlines()[0]
    assert "pip install -e '.[runtime]'" in result.stderr and "make local" in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("rlrun_runtime.local") is None,
                    reason="rlrun_runtime.local (rlrun local) has not landed yet")
def test_local_hands_every_argument_to_the_runtime() -> None:
    ours = rlrun("local", "--help")
    theirs = subprocess.run([str(RLRUN.parent / "rlrun-runtime"), "local", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert ours.returncode == theirs.returncode == 0
    assert ours.stdout == theirs.stdout and ours.stdout


def test_dash_reads_standard_input() -> None:
    result = subprocess.run([str(RLRUN), "validate", "-"], input=TINY.read_text(), capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "-: OK\n")
    result = subprocess.run([str(RLRUN), "validate", "-"], input="kind: [", capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stdout.startswith("-: is not valid YAML")
    assert "Traceback" not in result.stderr
