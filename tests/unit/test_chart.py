"""The operator's Helm chart, checked with a real helm binary and the official Kubernetes schemas."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlrun_api import constants

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlrun-operator"
HELM = Path(sys.executable).parent / "helm"
KUBE_VERSION = "1.33.0"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def _helm_installed() -> None:
    if not HELM.exists():
        pytest.fail(f"{HELM} missing: `make install` fetches it (tests/tools/fetch_helm.py)")


def test_chart_crd_is_the_source_crd() -> None:
    assert (CHART / "crds" / "rlrun.yaml").read_bytes() == (ROOT / "crds" / "rlrun.yaml").read_bytes()


def test_helm_lint_passes() -> None:
    result = helm("lint", str(CHART), "--strict")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("cluster_wide", ["true", "false"])
def test_rendered_chart_validates_against_kubernetes_schemas(cluster_wide: str, tmp_path: Path) -> None:
    import kubernetes_validate

    result = helm("template", "rlrun", str(CHART), "-n", "rlrun-system", "--set", f"clusterWide={cluster_wide}")
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = sorted(d["kind"] for d in docs)
    if cluster_wide == "true":
        assert kinds.count("ClusterRole") == 2 and "Role" not in kinds
    else:
        assert "ClusterRole" not in kinds and "Role" in kinds
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    # The operator learns its namespace (the NetworkPolicy peer of every run) from the downward API.
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": constants.ENV_OPERATOR_NAMESPACE,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in env


def test_values_schema_rejects_a_typo() -> None:
    result = helm("template", "rlrun", str(CHART), "--set", "clusterWyde=true")
    assert result.returncode != 0
    assert "clusterWyde" in result.stderr


def test_operator_accepts_every_flag_the_chart_passes() -> None:
    result = helm("template", "rlrun", str(CHART), "--set", "clusterWide=false", "-n", "ns")
    deployment = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    operator = shutil.which("rlrun-operator", path=str(Path(sys.executable).parent))
    assert operator, "the rlrun-operator console script is not installed"
    help_text = subprocess.run([operator, "--help"], capture_output=True, text=True, timeout=60).stdout
    for arg in container["args"]:
        flag = arg.split("=", 1)[0]
        assert flag in help_text, f"rlrun-operator --help does not list {flag}"
