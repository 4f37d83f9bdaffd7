"""The operator's Helm chart, checked with a real helm binary and the official Kubernetes schemas."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from example_runs import EXAMPLES
from rlrun_api import constants
from rlrun_cli.main import prepare_for_render
from rlrun_operator import apply, observe
from rlrun_operator.config import OperatorConfig
from rlrun_operator.kubeapi import KINDS
from rlrun_operator.render import render

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlrun-operator"
HELM = Path(sys.executable).parent / "helm"
KUBE_VERSION = "1.33.0"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render_chart(*args: str) -> list[dict[str, Any]]:
    """``helm template rlrun CHART -n rlrun-system ARGS`` as documents."""
    result = helm("template", "rlrun", str(CHART), "-n", "rlrun-system", "--kube-version", KUBE_VERSION, *args)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def get_watch_args(namespaces: tuple[str, ...]) -> tuple[str, ...]:
    return ("--set", "watchNamespaces={" + ",".join(namespaces) + "}") if namespaces else ()


@pytest.fixture(scope="module", autouse=True)
def _helm_installed() -> None:
    if not HELM.exists():
        pytest.fail(f"{HELM} missing: `make install` fetches it (tests/tools/fetch_helm.py)")


def test_chart_crd_is_the_source_crd() -> None:
    assert (CHART / "crds" / "rlrun.yaml").read_bytes() == (ROOT / "crds" / "rlrun.yaml").read_bytes()


@pytest.mark.parametrize("args", [(), MONITORING_ON_LINT := ("--set", "metrics.serviceMonitor.enabled=true,"
                                   "metrics.podMonitor.enabled=true,metrics.prometheusRule.enabled=true,"
                                   "metrics.dashboard.enabled=true,watchNamespaces={a}")])
def test_helm_lint_passes(args: tuple[str, ...]) -> None:
    result = helm("lint", str(CHART), "--strict", *args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("watch", [(), ("team-a", "team-b")])
@pytest.mark.parametrize("monitoring", [False, True])
def test_rendered_chart_validates_against_kubernetes_schemas(watch: tuple[str, ...], monitoring: bool) -> None:
    import kubernetes_validate

    docs = render_chart(*get_watch_args(watch), *(MONITORING_ON if monitoring else ()))
    kinds = sorted(d["kind"] for d in docs)
    if watch:
        assert kinds.count("ClusterRole") == 1 and kinds.count("Role") == len(watch)
    else:
        assert kinds.count("ClusterRole") == 2 and "Role" not in kinds
    monitoring_kinds = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert monitoring_kinds <= set(kinds) if monitoring else not monitoring_kinds & set(kinds)
    dashboards = [d for d in docs if d["kind"] == "ConfigMap" and "rlrun.json" in d.get("data", {})]
    assert len(dashboards) == (1 if monitoring else 0)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Service"] == ["rlrun-metrics"]
    for doc in docs:
        if doc["apiVersion"].startswith(MONITORING_GROUP + "/"):
            continue  # no Kubernetes schema: checked by the monitor and promtool tests below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    # The operator learns its namespace (the NetworkPolicy peer of every run) from the downward API.
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": constants.ENV_OPERATOR_NAMESPACE,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in env


@pytest.mark.parametrize("setting, named", [
    ("watchNamespacez={a}", "watchNamespacez"),
    ("metrics.podMonitor.enabeld=true", "enabeld"),
    ("watchNamespaces={Not_A_Namespace}", "watchNamespaces"),
    ("metrics.prometheusRule.mismatchKLBound=0", "mismatchKLBound"),
    ("metrics.serviceMonitor.interval=30", "interval"),
    ("logLevel=trace", "logLevel"),
])
def test_values_schema_rejects_a_typo_or_a_bad_value(setting: str, named: str) -> None:
    result = helm("template", "rlrun", str(CHART), "--set", setting)
    assert result.returncode != 0
    assert named in result.stderr


def test_values_schema_covers_every_value() -> None:
    """Every key of values.yaml is declared in values.schema.json (which refuses undeclared keys)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: Any, sub: dict[str, Any], path: str) -> None:
        if "$ref" in sub:
            sub = schema["definitions"][sub["$ref"].rsplit("/", 1)[1]]
        assert sub.get("type") or sub.get("enum"), f"{path}: no type in values.schema.json"
        if isinstance(node, dict) and "properties" in sub:
            assert sub.get("additionalProperties") is False, f"{path}: the schema lets typos through"
            for key, value in node.items():
                assert key in sub["properties"], f"{path}.{key} is not in values.schema.json"
                walk(value, sub["properties"][key], f"{path}.{key}")

    walk(values, schema, "values")


@pytest.mark.parametrize("watch", [(), ("team-a",)])
def test_operator_accepts_every_flag_the_chart_passes(watch: tuple[str, ...]) -> None:
    deployment = next(d for d in render_chart(*get_watch_args(watch)) if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    operator = shutil.which("rlrun-operator", path=str(Path(sys.executable).parent))
    assert operator, "the rlrun-operator console script is not installed"
    help_text = subprocess.run([operator, "--help"], capture_output=True, text=True, timeout=60).stdout
    for arg in container["args"]:
        flag = arg.split("=", 1)[0]
        assert flag in help_text, f"rlrun-operator --help does not list {flag}"
    # and the operator parses them into the namespaces it serves
    config = OperatorConfig.from_args(container["args"], env={})
    assert config.namespaces == watch
    assert config.metrics_port == constants.OPERATOR_METRICS_PORT


def test_one_standalone_operator() -> None:
    """No leader election: the operator runs kopf standalone, so one replica and Recreate, always."""
    deployment = next(d for d in render_chart() if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    main = (ROOT / "operator" / "rlrun_operator" / "main.py").read_text()
    assert "standalone=True" in main


# --- Least privilege: the rules the operator needs, derived, against the chart's ---------------------

# KubeApi methods -> the RBAC verb each one uses.
API_VERBS = {"create": "create", "get": "get", "list": "list", "json_patch": "patch", "merge_patch": "patch",
             "delete": "delete"}
# Every call the operator makes on its KubeApi (module, method): what the rules below account for. A new
# call fails test_operator_api_calls_are_the_known_ones until it is accounted for here and in the chart.
KNOWN_CALLS = {
    ("apply", "get"), ("apply", "create"), ("apply", "json_patch"), ("apply", "delete"), ("apply", "list"),
    ("observe", "list"), ("reconcile", "get"), ("reconcile", "json_patch"), ("handlers", "get"),
    ("handlers", "merge_patch"),
}


def get_api_calls() -> set[tuple[str, str]]:
    """(module, method) of every ``<...>api.<method>(...)`` call in operator/rlrun_operator/*.py."""
    found = set()
    for path in (ROOT / "operator" / "rlrun_operator").glob("*.py"):
        if path.name == "kubeapi.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in API_VERBS):
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "api":
                    found.add((path.stem, node.func.attr))
    return found


def test_operator_api_calls_are_the_known_ones() -> None:
    assert get_api_calls() == KNOWN_CALLS


def get_resource(api_version: str, kind: str) -> tuple[str, str]:
    """(apiGroup, plural) of a namespaced kind the operator handles (kubeapi.KINDS)."""
    info = KINDS[kind]
    assert info.api_version == api_version, f"{kind}: rendered as {api_version}, KubeApi uses {info.api_version}"
    return (api_version.split("/")[0] if "/" in api_version else "", info.plural)


def get_needed_rules(namespaced: bool) -> tuple[dict[tuple[str, str], set[str]], dict[tuple[str, str], set[str]]]:
    """(rules in the served namespaces, cluster-scoped rules) the operator needs, as {(apiGroup, resource):
    verbs}: derived from what the renderer makes of every example, the Roles it renders (the operator may
    only grant what it holds: RBAC escalation prevention), the operator's own API calls and kopf's."""
    rules: dict[tuple[str, str], set[str]] = defaultdict(set)
    listed = set(apply.PRUNABLE_KINDS) | set(observe.OTHER_CHILD_KINDS) | set(observe.WORKLOAD_KINDS)
    for example in EXAMPLES:
        rlrun = prepare_for_render(yaml.safe_load(example.read_text()), None)
        for manifest in render(rlrun):
            kind = manifest["kind"]
            verbs = {"get", "create"}                      # apply.apply_child: read live, create if absent
            if kind not in apply.CREATE_ONLY_KINDS:
                verbs.add("patch")                         # ... else converge it (apply.plan_child)
            if kind in apply.PRUNABLE_KINDS:
                verbs.add("delete")                        # apply.apply_prune (and a changed Job's replace)
            if kind in listed:
                verbs.add("list")                          # apply.apply_prune, observe.read_children
            rules[get_resource(manifest["apiVersion"], kind)] |= verbs
            if manifest["kind"] in ("Role", "ClusterRole"):
                for rule in manifest["rules"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            rules[(group, resource)] |= set(rule["verbs"])
    group = constants.GROUP
    rules[get_resource("v1", "Pod")] |= {"list"}                 # observe.read_pods (status, scraping)
    rules[(group, constants.PLURAL)] |= {"get"}                 # handlers.publish_status reads it afresh
    rules[(group, constants.PLURAL + "/status")] |= {"patch"}   # ... and merge-patches its status
    rules[(group, constants.PLURAL)] |= {"list", "watch", "patch"}  # kopf: watch, finalizer, annotations
    rules[("", "events")] |= {"create"}                         # kopf.event
    cluster = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}  # kopf's resource observer
    if namespaced:
        cluster[("", "namespaces")] = {"list", "watch"}        # kopf's namespace observer (given namespaces)
    return dict(rules), cluster


def get_granted(docs: list[dict[str, Any]], kind: str, namespace: str | None = None,
                name: str = "rlrun") -> dict[tuple[str, str], set[str]]:
    """{(apiGroup, resource): verbs} of the chart's ``kind`` ``name`` (in ``namespace``), bound to the
    operator's ServiceAccount."""
    role = next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name
                and d["metadata"].get("namespace") == namespace)
    binding = next(d for d in docs if d["kind"] == kind + "Binding" and d["metadata"]["name"] == name
                   and d["metadata"].get("namespace") == namespace)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rlrun", "namespace": "rlrun-system"}]
    granted: dict[tuple[str, str], set[str]] = defaultdict(set)
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "no resourceNames or nonResourceURLs expected"
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted[(group, resource)] |= set(rule["verbs"])
    return dict(granted)


@pytest.mark.parametrize("watch", [(), ("team-a", "team-b")])
def test_rbac_grants_exactly_what_the_operator_needs(watch: tuple[str, ...]) -> None:
    docs = render_chart(*get_watch_args(watch))
    needed, cluster = get_needed_rules(namespaced=bool(watch))
    assert get_granted(docs, "ClusterRole", name="rlrun-kopf") == cluster
    if watch:
        for namespace in watch:
            assert get_granted(docs, "Role", namespace) == needed
    else:
        assert get_granted(docs, "ClusterRole") == needed
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert len(roles) == 1 + (len(watch) or 1), "an RBAC object the test does not account for"


# --- Monitoring: ServiceMonitor, PodMonitors, alert rules, dashboard ----------------------------------

MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_ON = ("--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
                 "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.dashboard.enabled=true")
# Fields of the Prometheus Operator's monitoring.coreos.com/v1 kinds the chart uses (its API reference).
ENDPOINT_FIELDS = {"port", "path", "interval", "honorLabels", "relabelings"}
RELABEL_FIELDS = {"sourceLabels", "separator", "targetLabel", "regex", "replacement", "action"}
RELABEL_ACTIONS = {"replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep", "hashmod", "lowercase",
                   "uppercase", "keepequal", "dropequal"}


def get_monitoring(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    found = [d for d in docs if d["kind"] == kind]
    for doc in found:
        assert doc["apiVersion"] == f"{MONITORING_GROUP}/v1"
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        assert doc["metadata"]["namespace"] == "rlrun-system"
    return found


def check_endpoint(endpoint: dict[str, Any]) -> None:
    assert set(endpoint) <= ENDPOINT_FIELDS, set(endpoint) - ENDPOINT_FIELDS
    assert endpoint["path"] == "/metrics"
    for relabel in endpoint.get("relabelings", []):
        assert set(relabel) <= RELABEL_FIELDS, set(relabel) - RELABEL_FIELDS
        assert relabel.get("action", "replace") in RELABEL_ACTIONS


def get_scrape_config(monitor: dict[str, Any], endpoint: dict[str, Any],
                      targets: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Prometheus scrape config the Prometheus Operator generates for one PodMonitor endpoint, in the
    parts that matter: the selector and the port as keep rules on the pod's discovery labels, then the
    monitor's own relabelings (Prometheus's spelling of the keys). Debian's Prometheus is built without
    Kubernetes discovery, so the targets are static: ``targets`` (static_configs entries whose labels are
    the discovery labels a pod would have; tests/integration/test_prometheus.py), else none."""
    selector = monitor["spec"]["selector"]
    relabels: list[dict[str, Any]] = []
    for key, value in selector.get("matchLabels", {}).items():
        relabels.append({"source_labels": [get_meta_label(key)], "regex": value, "action": "keep"})
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        relabels.append({"source_labels": [get_meta_label(expression["key"])],
                         "regex": "|".join(expression["values"]), "action": "keep"})
    relabels.append({"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"],
                     "action": "keep"})
    # the target labels the Prometheus Operator always adds
    relabels.append({"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"})
    relabels.append({"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"})
    for relabel in endpoint.get("relabelings", []):
        relabels.append({{"sourceLabels": "source_labels", "targetLabel": "target_label"}.get(k, k): v
                         for k, v in relabel.items()})
    return {"job_name": monitor["metadata"]["name"], "metrics_path": endpoint["path"],
            "scrape_interval": endpoint["interval"], "static_configs": targets or [],
            "relabel_configs": relabels}


def get_meta_label(label: str) -> str:
    """Prometheus's Kubernetes discovery label of pod label ``label``."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)


def get_inference_pod_ports() -> dict[str, set[str]]:
    """{component: container port names} of the pods the renderer makes (every example)."""
    ports: dict[str, set[str]] = defaultdict(set)
    for example in EXAMPLES:
        for manifest in render(prepare_for_render(yaml.safe_load(example.read_text()), None)):
            template = manifest.get("spec", {}).get("template")
            if not template:
                continue
            labels = template["metadata"]["labels"]
            for container in template["spec"]["containers"]:
                ports[labels[constants.LABEL_COMPONENT]] |= {p["name"] for p in container.get("ports", [])
                                                             if p["containerPort"] in METRICS_PORTS}
            assert labels[constants.LABEL_MANAGED_BY] == constants.MANAGED_BY
    return dict(ports)


METRICS_PORTS = {constants.INFERENCE_PORT, constants.ORCHESTRATOR_METRICS_PORT, constants.TRAINER_METRICS_PORT}


def test_monitors_select_the_rendered_pods_and_ports_and_pass_promtool(tmp_path: Path) -> None:
    docs = render_chart(*MONITORING_ON)
    (service_monitor,) = get_monitoring(docs, "ServiceMonitor")
    (endpoint,) = service_monitor["spec"]["endpoints"]
    check_endpoint(endpoint)
    service = next(d for d in docs if d["kind"] == "Service")
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert endpoint["honorLabels"] is True  # the operator's namespace/name labels are the runs'
    ports = get_inference_pod_ports()
    monitors = {d["metadata"]["name"]: d for d in get_monitoring(docs, "PodMonitor")}
    assert set(monitors) == {"rlrun-vllm", "rlrun-runs"}
    wanted = {"rlrun-vllm": set(constants.POOL_COMPONENTS),
              "rlrun-runs": {constants.COMPONENT_ORCHESTRATOR, constants.COMPONENT_TRAINER}}
    scrape_configs = [{"job_name": "operator", "honor_labels": True,
                       "static_configs": [{"targets": [f"127.0.0.1:{constants.OPERATOR_METRICS_PORT}"]}]}]
    for name, monitor in monitors.items():
        spec = monitor["spec"]
        assert spec["namespaceSelector"] == {"any": True}
        assert spec["selector"]["matchLabels"] == {constants.LABEL_MANAGED_BY: constants.MANAGED_BY}
        (expression,) = spec["selector"]["matchExpressions"]
        assert expression["key"] == constants.LABEL_COMPONENT and set(expression["values"]) == wanted[name]
        (endpoint,) = spec["podMetricsEndpoints"]
        check_endpoint(endpoint)
        for component in wanted[name]:
            assert ports.get(component) == {endpoint["port"]}, (component, ports.get(component))
        # the run's identity as the operator's series carry it
        targets = {r.get("targetLabel"): r["sourceLabels"] for r in endpoint["relabelings"]}
        assert targets["name"] == [get_meta_label(constants.LABEL_INSTANCE)]
        assert targets["role"] == [get_meta_label(constants.LABEL_COMPONENT)]
        scrape_configs.append(get_scrape_config(monitor, endpoint))
    keep = next(r for r in monitors["rlrun-runs"]["spec"]["podMetricsEndpoints"][0]["relabelings"]
                if r.get("action") == "keep")
    assert keep["sourceLabels"][1] == get_meta_label(constants.LABEL_POD_INDEX)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, "scrape_configs": scrape_configs}))
    result = subprocess.run([promtool(), "check", "config", "--syntax-only", str(config)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    # the watched namespaces narrow the PodMonitors
    narrowed = get_monitoring(render_chart(*MONITORING_ON, *get_watch_args(("team-a",))), "PodMonitor")
    assert all(m["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]} for m in narrowed)


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool missing: `make install` installs Debian's prometheus package")
    return found


def get_rule_groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (rule,) = get_monitoring(docs, "PrometheusRule")
    return rule["spec"]["groups"]


def test_alert_rules_pass_promtool_and_follow_the_values(tmp_path: Path) -> None:
    docs = render_chart(*MONITORING_ON, "--set-json", "metrics.prometheusRule.mismatchKLBound=0.25",
                        "--set", "metrics.prometheusRule.noStepMinutes=20")
    groups = get_rule_groups(docs)
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {"RLRunDegraded", "RLRunNoStep", "RLRunMismatchKLHigh"}
    assert rules["RLRunMismatchKLHigh"]["expr"].endswith("> 0.25")
    assert "[20m]" in rules["RLRunNoStep"]["expr"]
    assert constants.OPERATOR_METRIC_RUN_CONDITION in rules["RLRunDegraded"]["expr"]
    for rule in rules.values():
        assert "{{ $labels.namespace }}/{{ $labels.name }}" in rule["annotations"]["summary"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout


def test_dashboard_is_grafana_json_with_the_panels_the_issue_asks_for() -> None:
    docs = render_chart(*MONITORING_ON, "--set", "metrics.dashboard.namespace=monitoring")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "rlrun.json" in d.get("data", {})]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(config_map["data"]["rlrun.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "rlrun.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (constants.OPERATOR_METRIC_RUNS, constants.OPERATOR_METRIC_RUN_STEP,
                   constants.OPERATOR_METRIC_RUN_LAST_REWARD, constants.OPERATOR_METRIC_RUN_EVAL_REWARD,
                   constants.METRIC_TRAINER_MISMATCH_KL,
                   constants.VLLM_METRIC_RUNNING, constants.OPERATOR_METRIC_DESIRED_REPLICAS,
                   constants.OPERATOR_METRIC_QUEUE_DEPTH, constants.OPERATOR_METRIC_SCALING_DECISIONS + "_total",
                   constants.METRIC_WEIGHT_UPDATE_SECONDS + "_bucket"):
        assert metric in exprs, f"no panel reads {metric}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["targets"] and all(t["expr"] and t["refId"] for t in panel["targets"])
