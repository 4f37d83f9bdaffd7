"""The renderer: RLRun -> Kubernetes objects (rlrun_operator.render).

Every rendered object is checked against the official Kubernetes schemas with kubernetes-validate in
strict mode (unknown fields are errors), pinned to K8S_VERSION. The RLRun variants used here are first
checked to be valid RLRuns (CRD schema + CEL rules, rlrun_api.validation), so the tests only feed
the renderer what the API server would accept.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlrun_api import constants as c
from rlrun_operator import render as render_module
from rlrun_api.constants import RESERVED_ENV_NAMES
from rlrun_operator.render import RenderError, get_child_names, get_config_hash, render
from rlrun_api.sizing import size_pd
from rlrun_api.spec import apply_defaults
from rlrun_api.validation import validate

# The newest Kubernetes version kubernetes-validate 1.37.0 ships schemas for.
K8S_VERSION = "1.37.0"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UID = "6f1c2a4e-0000-4000-8000-000000000001"
STANDARD_LABELS = (c.LABEL_NAME, c.LABEL_INSTANCE, c.LABEL_COMPONENT, c.LABEL_PART_OF, c.LABEL_MANAGED_BY)
WORKLOAD_KINDS = ("StatefulSet", "Deployment", "Job")


# --- helpers ------------------------------------------------------------------------------------

def load_example(name: str, namespace: str = "rl-test", uid: str | None = UID) -> dict[str, Any]:
    rlrun = yaml.safe_load((EXAMPLES / f"rlrun-{name}.yaml").read_text())
    rlrun["metadata"]["namespace"] = namespace
    if uid:
        rlrun["metadata"]["uid"] = uid
    return rlrun


def defaulted(rlrun: dict[str, Any]) -> dict[str, Any]:
    """apply_defaults after checking the object is a valid RLRun (schema, CEL, semantic checks)."""
    errors = validate(rlrun)
    assert errors == [], [str(e) for e in errors]
    return apply_defaults(rlrun)


def variant(name: str, **patch: Any) -> dict[str, Any]:
    """An example with spec fields replaced; patch keys are dotted spec paths."""
    rlrun = load_example(name)
    for dotted, value in patch.items():
        node = rlrun["spec"]
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return rlrun


def variants() -> dict[str, dict[str, Any]]:
    """Every RLRun the renderer must handle: the examples plus disaggregation on/off, suspend, claimName."""
    complete_claim = load_example("complete")
    del complete_claim["spec"]["storage"]["storageClassName"], complete_claim["spec"]["storage"]["size"]
    complete_claim["spec"]["storage"]["claimName"] = "shared-weights"
    no_uid = load_example("minimal", uid=None)
    return {
        "tiny": load_example("tiny"),
        "minimal": load_example("minimal"),
        "complete": load_example("complete"),
        "complete-no-disaggregation": variant(
            "complete", **{"inference.disaggregation.enabled": False, "autoscaling.enabled": False}
        ),
        "tiny-disaggregated": variant("tiny", **{"inference.disaggregation": {"enabled": True, "replicas": 3}}),
        "tiny-suspended": variant("tiny", suspend=True),
        "complete-suspended": variant("complete", suspend=True),
        "complete-claim": complete_claim,
        "minimal-no-uid": no_uid,
        # The push weight transport (CPU: gloo), which adds the trainer NetworkPolicy.
        "tiny-gloo": variant("tiny", weightSync={"transport": "gloo"}),
        "tiny-gloo-disaggregated": variant("tiny", weightSync={"transport": "gloo"},
                                           **{"inference.disaggregation": {"enabled": True, "replicas": 3}}),
    }


VARIANTS = variants()


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return by_kind(objects, kind)[name]


def pod_templates(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in WORKLOAD_KINDS]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value (literal) or valueFrom; duplicate names keep the last (the kubelet's rule)."""
    out = {}
    for entry in container["env"]:
        out[entry["name"]] = entry.get("value", entry.get("valueFrom"))
    return out


def rendered(key: str) -> list[dict[str, Any]]:
    return render(defaulted(VARIANTS[key]))


# --- schema validity --------------------------------------------------------------------------------

@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_every_object_validates_against_the_kubernetes_schemas(key):
    objects = rendered(key)
    assert objects
    for obj in objects:
        # Raises ValidationError on any schema violation, SchemaNotFoundError for an unknown kind.
        assert kubernetes_validate.validate(obj, K8S_VERSION, strict=True) == "1.37"


def test_strict_validation_rejects_an_unknown_field():
    """The validator used above is not vacuous: a misspelt field in a container is an error."""
    sts = one(rendered("tiny"), "StatefulSet", "tiny-reverse-trainer")
    sts["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(sts, K8S_VERSION, strict=True)


# --- names, order, labels, owners -----------------------------------------------------------------

def test_names_and_apply_order_when_disaggregated():
    objects = rendered("complete")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "qwen3-4b-math-config"),
        ("PersistentVolumeClaim", "qwen3-4b-math-storage"),
        ("ServiceAccount", "qwen3-4b-math-router"),
        ("Role", "qwen3-4b-math-router"),
        ("RoleBinding", "qwen3-4b-math-router"),
        ("Service", "qwen3-4b-math-trainer"),
        ("Service", "qwen3-4b-math-prefill"),
        ("Service", "qwen3-4b-math-decode"),
        ("Service", "qwen3-4b-math-router"),
        ("Service", "qwen3-4b-math-orchestrator"),
        ("NetworkPolicy", "qwen3-4b-math-inference"),
        ("StatefulSet", "qwen3-4b-math-trainer"),
        ("Deployment", "qwen3-4b-math-prefill"),
        ("Deployment", "qwen3-4b-math-decode"),
        ("Deployment", "qwen3-4b-math-router"),
        ("Job", "qwen3-4b-math-orchestrator"),
    ]
    assert all(o["metadata"]["namespace"] == "rl-test" for o in objects)


def test_names_without_disaggregation_and_with_an_existing_claim():
    objects = rendered("complete-claim")
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objects}
    for _, template in pod_templates(objects):
        claims = [v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                  if "persistentVolumeClaim" in v]
        assert claims == ["shared-weights"]
    objects = rendered("minimal")
    assert sorted(by_kind(objects, "Deployment")) == ["qwen3-countdown-inference", "qwen3-countdown-router"]
    assert sorted(by_kind(objects, "Service")) == [
        "qwen3-countdown-inference", "qwen3-countdown-orchestrator", "qwen3-countdown-router",
        "qwen3-countdown-trainer",
    ]
    pvc = one(objects, "PersistentVolumeClaim", "qwen3-countdown-storage")
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}}


def test_storage_size_is_the_renderers_default_and_never_reaches_a_claim_name_run():
    """spec.storage.size has no CRD default (it would reach claimName runs, which refuse it): the renderer
    fills in constants.DEFAULT_STORAGE_SIZE for the claim it creates, and the run config the roles read
    carries it as the API server's default did (so the ConfigMap and the config hashes stay as they were)."""
    from rlrun_api import constants

    minimal = defaulted(load_example("minimal"))
    assert "size" not in minimal["spec"]["storage"]
    objects = render(minimal)
    pvc = one(objects, "PersistentVolumeClaim", "qwen3-countdown-storage")
    assert pvc["spec"]["resources"]["requests"]["storage"] == constants.DEFAULT_STORAGE_SIZE == "100Gi"
    config = yaml.safe_load(one(objects, "ConfigMap", "qwen3-countdown-config")["data"]["rlrun.yaml"])
    assert config["spec"]["storage"]["size"] == "100Gi"
    assert "size" not in minimal["spec"]["storage"]  # the input is not changed
    claim = rendered("complete-claim")
    config = yaml.safe_load(one(claim, "ConfigMap", "qwen3-4b-math-config")["data"]["rlrun.yaml"])
    assert config["spec"]["storage"] == {"claimName": "shared-weights", "mountPath": "/data"}


def test_child_names_cover_every_rendered_name_and_the_shared_suffix_constants():
    for key in ("complete", "minimal"):
        rlrun = defaulted(VARIANTS[key])
        names = get_child_names(rlrun)
        assert {o["metadata"]["name"] for o in render(rlrun)} <= set(names.values())
    names = get_child_names(defaulted(VARIANTS["tiny"]))
    assert {n.removeprefix("tiny-reverse") for n in names.values()} == set(c.CHILD_SUFFIXES)
    assert names["trainer"] == "tiny-reverse-trainer" and names["network-policy"] == "tiny-reverse-inference"


@pytest.mark.parametrize("key", ["complete", "minimal", "tiny-disaggregated"])
def test_standard_labels_on_every_object_and_pod_template(key):
    rlrun = defaulted(VARIANTS[key])
    run_name = rlrun["metadata"]["name"]
    objects = render(rlrun)
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert set(labels) == set(STANDARD_LABELS), obj["metadata"]["name"]
        assert labels[c.LABEL_NAME] == "rlrun"
        assert labels[c.LABEL_INSTANCE] == run_name
        assert labels[c.LABEL_PART_OF] == "rlrun"
        assert labels[c.LABEL_MANAGED_BY] == "rlrun-operator"
    for workload, template in pod_templates(objects):
        assert template["metadata"]["labels"] == workload["metadata"]["labels"]
        if workload["kind"] != "Job":  # a Job's selector is generated by the API server
            assert workload["spec"]["selector"] == {"matchLabels": {
                c.LABEL_NAME: "rlrun", c.LABEL_INSTANCE: run_name,
                c.LABEL_COMPONENT: template["metadata"]["labels"][c.LABEL_COMPONENT]}}
    components = {o["metadata"]["name"]: o["metadata"]["labels"][c.LABEL_COMPONENT] for o in objects
                  if o["kind"] in WORKLOAD_KINDS}
    assert components[f"{run_name}-trainer"] == "trainer"
    assert components[f"{run_name}-router"] == "router"
    assert components[f"{run_name}-orchestrator"] == "orchestrator"


def test_the_runs_own_labels_are_never_copied():
    """Argo CD tracks resources with app.kubernetes.io/instance (or its own label): children must not carry
    the application's value, or Argo CD would treat them as its own resources."""
    rlrun = load_example("tiny")
    rlrun["metadata"]["labels"] = {c.LABEL_INSTANCE: "argocd-app", "argocd.argoproj.io/instance": "argocd-app",
                                   "team": "rl"}
    rlrun["metadata"]["annotations"] = {"argocd.argoproj.io/tracking-id": "argocd-app:rlrun.dev/RLRun:ns/x"}
    objects = render(defaulted(rlrun))
    text = yaml.safe_dump_all(objects)
    assert "argocd" not in text
    assert "team" not in text
    for obj in objects:
        assert obj["metadata"]["labels"][c.LABEL_INSTANCE] == "tiny-reverse"
        assert "annotations" not in obj["metadata"]


def test_owner_references_when_the_uid_is_known_and_absent_otherwise():
    expected = [{"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun", "name": "qwen3-countdown", "uid": UID,
                 "controller": True, "blockOwnerDeletion": True}]
    for obj in rendered("minimal"):
        assert obj["metadata"]["ownerReferences"] == expected, obj["metadata"]["name"]
    for obj in rendered("minimal-no-uid"):
        assert "ownerReferences" not in obj["metadata"]


# --- trainer ------------------------------------------------------------------------------------------

def test_trainer_statefulset_runs_torchrun_with_the_pod_ordinal_as_node_rank():
    objects = rendered("complete")
    sts = one(objects, "StatefulSet", "qwen3-4b-math-trainer")
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == "qwen3-4b-math-trainer"
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "torchrun", "--nnodes=$(NNODES)", "--nproc-per-node=$(NPROC_PER_NODE)", "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)", "-m", "rlrun_runtime", "trainer",
        "--config", "/etc/rlrun/rlrun.yaml",
    ]
    env = env_of(container)
    assert env["NNODES"] == "2"
    assert env["NPROC_PER_NODE"] == "8"
    assert env["NODE_RANK"] == {"fieldRef": {"apiVersion": "v1",
                                             "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert env["MASTER_ADDR"] == "qwen3-4b-math-trainer-0.qwen3-4b-math-trainer"
    assert env["MASTER_PORT"] == str(c.TRAINER_MASTER_PORT)
    assert container["resources"] == {
        "requests": {"cpu": "32", "memory": "512Gi", "nvidia.com/gpu": 8},
        "limits": {"nvidia.com/gpu": 8},
    }
    service = one(objects, "Service", "qwen3-4b-math-trainer")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["port"] for p in service["spec"]["ports"]} >= {c.TRAINER_MASTER_PORT}


def test_cpu_trainer_has_one_process_and_no_gpu():
    sts = one(rendered("tiny"), "StatefulSet", "tiny-reverse-trainer")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert env_of(container)["NPROC_PER_NODE"] == "1"
    assert env_of(container)["NNODES"] == "1"
    assert "nvidia.com/gpu" not in yaml.safe_dump(container)


# --- inference ----------------------------------------------------------------------------------------

def test_prefill_and_decode_are_sized_by_the_ratio_and_play_their_roles():
    objects = rendered("complete")  # ratio 1:2, 6 replicas
    deployments = by_kind(objects, "Deployment")
    assert deployments["qwen3-4b-math-prefill"]["spec"]["replicas"] == 2
    assert deployments["qwen3-4b-math-decode"]["spec"]["replicas"] == 4
    for role in ("prefill", "decode"):
        container = deployments[f"qwen3-4b-math-{role}"]["spec"]["template"]["spec"]["containers"][0]
        env = env_of(container)
        assert env["RLRUN_INFERENCE_ROLE"] == role
        assert env["RLRUN_INFERENCE_PORT"] == str(c.INFERENCE_PORT)
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(c.NIXL_SIDE_CHANNEL_PORT)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert "VLLM_CPU_KVCACHE_SPACE" not in env  # GPU pods
        assert container["command"] == ["rlrun-runtime", "inference", "--config", "/etc/rlrun/rlrun.yaml"]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
        # A roll replaces one pod at a time without a surge pod: it never waits for a spare GPU.
        assert deployments[f"qwen3-4b-math-{role}"]["spec"]["strategy"] == {
            "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        # the pod outlives vLLM's drain (--shutdown-timeout) on SIGTERM, e.g. when a pool scales down
        assert deployments[f"qwen3-4b-math-{role}"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] \
            == c.INFERENCE_TERMINATION_GRACE_SECONDS > c.INFERENCE_DRAIN_SECONDS
        service = one(objects, "Service", f"qwen3-4b-math-{role}")
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"][c.LABEL_COMPONENT] == role


def test_plain_inference_on_cpu():
    deployment = one(rendered("tiny"), "Deployment", "tiny-reverse-inference")
    assert deployment["spec"]["replicas"] == 1
    assert "strategy" not in deployment["spec"]  # CPU pools: Kubernetes' default rolling update
    env = env_of(deployment["spec"]["template"]["spec"]["containers"][0])
    assert env["RLRUN_INFERENCE_ROLE"] == "both"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(c.CPU_KVCACHE_SPACE_GIB)
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env and "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env


def test_orchestrator_job_reaches_router_and_every_inference_pool():
    objects = rendered("complete")
    job = one(objects, "Job", "qwen3-4b-math-orchestrator")
    assert job["spec"]["suspend"] is False
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert 0 < job["spec"]["backoffLimit"] <= 10
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["rlrun-runtime", "orchestrator", "--config", "/etc/rlrun/rlrun.yaml"]
    env = env_of(container)
    assert env["RLRUN_ROUTER_URL"] == f"http://qwen3-4b-math-router:{c.ROUTER_PORT}"
    assert env["RLRUN_INFERENCE_ENDPOINTS"] == (
        f"qwen3-4b-math-prefill:{c.INFERENCE_PORT},qwen3-4b-math-decode:{c.INFERENCE_PORT}")
    assert env["RLRUN_METRICS_PORT"] == str(c.ORCHESTRATOR_METRICS_PORT)
    service = one(objects, "Service", "qwen3-4b-math-orchestrator")
    assert [p["port"] for p in service["spec"]["ports"]] == [c.ORCHESTRATOR_METRICS_PORT]
    tiny_job = one(rendered("tiny"), "Job", "tiny-reverse-orchestrator")
    assert env_of(tiny_job["spec"]["template"]["spec"]["containers"][0])["RLRUN_INFERENCE_ENDPOINTS"] == (
        f"tiny-reverse-inference:{c.INFERENCE_PORT}")


# --- router and its RBAC --------------------------------------------------------------------------

def test_router_may_only_get_list_watch_pods_in_its_namespace():
    objects = rendered("complete")
    role = one(objects, "Role", "qwen3-4b-math-router")
    assert role["metadata"]["namespace"] == "rl-test"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = one(objects, "RoleBinding", "qwen3-4b-math-router")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "qwen3-4b-math-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen3-4b-math-router",
                                    "namespace": "rl-test"}]
    assert "ClusterRole" not in {o["kind"] for o in objects}
    router = one(objects, "Deployment", "qwen3-4b-math-router")
    pod = router["spec"]["template"]["spec"]
    assert router["spec"]["replicas"] == 1
    assert pod["serviceAccountName"] == "qwen3-4b-math-router"
    assert pod["automountServiceAccountToken"] is True
    env = env_of(pod["containers"][0])
    assert env["RLRUN_ROUTER_DISCOVERY"] == "kubernetes"
    assert env["RLRUN_ROUTER_PORT"] == str(c.ROUTER_PORT)
    assert env["RLRUN_ROUTER_METRICS_PORT"] == str(c.ROUTER_METRICS_PORT)
    assert env["RLRUN_NAMESPACE"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
    service = one(objects, "Service", "qwen3-4b-math-router")
    assert sorted(p["port"] for p in service["spec"]["ports"]) == sorted([c.ROUTER_PORT, c.ROUTER_METRICS_PORT])
    # vllm-router's /health turns 503 when any worker is unhealthy (measured with 0.1.17): liveness must not
    # use it, or a restarting inference pod would get the router killed too.
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert container["startupProbe"]["httpGet"]["path"] == "/liveness"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    # No other pod gets an API token: only the router talks to the Kubernetes API.
    for workload, template in pod_templates(objects):
        if workload["metadata"]["name"] != "qwen3-4b-math-router":
            assert template["spec"]["automountServiceAccountToken"] is False
            assert "serviceAccountName" not in template["spec"]


def test_spec_pod_service_account_applies_to_every_pod_but_the_router():
    rlrun = variant("tiny", pod={"serviceAccountName": "workload-identity"})
    for workload, template in pod_templates(render(defaulted(rlrun))):
        expected = "tiny-reverse-router" if workload["metadata"]["name"] == "tiny-reverse-router" \
            else "workload-identity"
        assert template["spec"]["serviceAccountName"] == expected


# --- network policy -----------------------------------------------------------------------------------

def test_network_policy_admits_only_the_run_and_the_operator():
    policy = one(rendered("complete"), "NetworkPolicy", "qwen3-4b-math-inference")
    assert policy["spec"] == {
        "podSelector": {
            "matchLabels": {c.LABEL_NAME: "rlrun", c.LABEL_INSTANCE: "qwen3-4b-math"},
            "matchExpressions": [{"key": c.LABEL_COMPONENT, "operator": "In",
                                  "values": ["inference", "prefill", "decode"]}],
        },
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [
            {"podSelector": {"matchLabels": {c.LABEL_NAME: "rlrun", c.LABEL_INSTANCE: "qwen3-4b-math"}}},
            # The operator's pods in the operator's namespace only (not any pod labelled like it anywhere).
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rlrun-system"}},
             "podSelector": {"matchLabels": {c.LABEL_NAME: c.OPERATOR_APP_NAME}}},
        ]}],
    }


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics for matchLabels and In expressions."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("key", ["complete", "tiny"])
def test_network_policy_selects_exactly_the_inference_pods_and_admits_every_role_of_the_run(key):
    objects = rendered(key)
    policy = by_kind(objects, "NetworkPolicy")
    (policy,) = policy.values()
    run_peer = policy["spec"]["ingress"][0]["from"][0]["podSelector"]
    for _, template in pod_templates(objects):
        labels = template["metadata"]["labels"]
        is_inference = labels[c.LABEL_COMPONENT] in ("inference", "prefill", "decode")
        assert selects(policy["spec"]["podSelector"], labels) == is_inference
        assert selects(run_peer, labels)  # router, orchestrator, trainer, inference pods are all peers
    other_run = {c.LABEL_NAME: "rlrun", c.LABEL_INSTANCE: "someone-else", c.LABEL_COMPONENT: "router"}
    assert not selects(run_peer, other_run)
    # The operator peer: its pods in its own namespace only (default: the README's rlrun-system).
    operator_peer = policy["spec"]["ingress"][0]["from"][1]
    assert operator_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "rlrun-system"}}
    assert operator_peer["podSelector"] == {"matchLabels": {c.LABEL_NAME: c.OPERATOR_APP_NAME}}
    moved = by_kind(render(defaulted(VARIANTS[key]), operator_namespace="ops"), "NetworkPolicy")
    (moved,) = moved.values()
    assert moved["spec"]["ingress"][0]["from"][1]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "ops"}


@pytest.mark.parametrize("key", ["tiny-gloo", "tiny-gloo-disaggregated"])
def test_push_transport_trainer_policy_admits_all_tcp_between_trainer_and_inference_pods_only(key):
    """The push transports' gloo/NCCL groups use ephemeral ports both ways between trainer rank 0 and the
    inference workers: the trainer pods admit all TCP from the run's trainer and inference pods, the
    orchestrator on the named store port only, anyone on the metrics port, and nothing else."""
    objects = rendered(key)
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "NetworkPolicy"] == [
        "tiny-reverse-trainer", "tiny-reverse-inference"]
    policy = one(objects, "NetworkPolicy", "tiny-reverse-trainer")
    assert policy["metadata"]["labels"][c.LABEL_COMPONENT] == "trainer"
    run = {c.LABEL_NAME: "rlrun", c.LABEL_INSTANCE: "tiny-reverse"}
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {**run, c.LABEL_COMPONENT: "trainer"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": run, "matchExpressions": [
                {"key": c.LABEL_COMPONENT, "operator": "In",
                 "values": ["trainer", "inference", "prefill", "decode"]}]}}],
             "ports": [{"protocol": "TCP"}]},
            {"from": [{"podSelector": {"matchLabels": {**run, c.LABEL_COMPONENT: "orchestrator"}}}],
             "ports": [{"protocol": "TCP", "port": "weight-push"}]},
            {"ports": [{"protocol": "TCP", "port": "metrics"}]},
        ],
    }
    templates = {t["metadata"]["labels"][c.LABEL_COMPONENT]: t for _, t in pod_templates(objects)}
    all_tcp = policy["spec"]["ingress"][0]["from"][0]["podSelector"]
    for component, template in templates.items():
        labels = template["metadata"]["labels"]
        assert selects(policy["spec"]["podSelector"], labels) == (component == "trainer")
        assert selects(all_tcp, labels) == (component in ("trainer", *c.POOL_COMPONENTS)), component
    assert not selects(all_tcp, {**run, c.LABEL_INSTANCE: "someone-else", c.LABEL_COMPONENT: "inference"})
    # The named ports are the trainer container's: the store on the fixed WEIGHT_PUSH_PORT, metrics on 9091.
    ports = {p["name"]: p["containerPort"] for p in templates["trainer"]["spec"]["containers"][0]["ports"]}
    assert ports["weight-push"] == c.WEIGHT_PUSH_PORT == 29600
    assert ports["metrics"] == c.TRAINER_METRICS_PORT
    # The inference pods' own policy admits every pod of the run (the trainer included) on any port.
    inference_policy = one(objects, "NetworkPolicy", "tiny-reverse-inference")
    assert selects(inference_policy["spec"]["ingress"][0]["from"][0]["podSelector"], templates["trainer"]["metadata"]["labels"])
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_filesystem_transport_renders_no_trainer_policy():
    for key in ("tiny", "complete", "minimal"):
        assert [o["metadata"]["name"] for o in rendered(key) if o["kind"] == "NetworkPolicy"] == [
            get_child_names(defaulted(VARIANTS[key]))["network-policy"]]
    names = get_child_names(defaulted(VARIANTS["tiny"]))
    assert names["trainer-network-policy"] == "tiny-reverse-trainer"


def test_switching_the_transport_back_prunes_the_trainer_policy():
    """The operator deletes a child the render no longer produces (apply.plan_prune): gloo -> filesystem."""
    from rlrun_operator.apply import plan_prune

    owned = [{**o, "metadata": {**o["metadata"]}} for o in rendered("tiny-gloo")]
    now = rendered("tiny")
    assert plan_prune(UID, now, owned) == [("NetworkPolicy", "tiny-reverse-trainer")]
    assert plan_prune(UID, rendered("tiny-gloo"), owned) == []


# --- model cache and tokens for real models -------------------------------------------------------------

def test_hugging_face_ids_get_the_hub_cache_on_the_claim_in_every_container():
    """Trainer, inference, router and orchestrator containers share one HF hub cache on the run's claim, so a
    model id is downloaded once; the token arrives through spec.pod.envFrom (complete: a Secret)."""
    for key, mount in (("complete", "/data"), ("minimal", "/data"), ("complete-claim", "/data")):
        rlrun = defaulted(VARIANTS[key])
        for workload, template in pod_templates(render(rlrun)):
            (container,) = template["spec"]["containers"]
            assert env_of(container)[c.ENV_HF_HUB_CACHE] == f"{mount}/hf-cache", workload["metadata"]["name"]
            assert container.get("envFrom") == rlrun["spec"]["pod"].get("envFrom")
            # on the mounted claim
            assert any(m["mountPath"] == mount for m in container["volumeMounts"])
    complete = rendered("complete")
    secret_refs = {c_["envFrom"][0]["secretRef"]["name"] for _, t in pod_templates(complete)
                   for c_ in t["spec"]["containers"]}
    assert secret_refs == {"hf-and-wandb-tokens"}
    moved = render(defaulted(variant("minimal", storage={"mountPath": "/mnt/run/"})))
    assert {env_of(t["spec"]["containers"][0])[c.ENV_HF_HUB_CACHE] for _, t in pod_templates(moved)} == {
        "/mnt/run/hf-cache"}


@pytest.mark.parametrize("patch", [
    {"storage": {"modelCache": False}},
    {"model": {"name": "/data/models/qwen3"}},
    {"model": {"name": "./models/qwen3"}},
    {"model": {"name": "rlrun-tiny"}},
])
def test_no_hub_cache_for_paths_the_tiny_model_or_when_turned_off(patch):
    objects = render(defaulted(variant("minimal", **patch)))
    for _, template in pod_templates(objects):
        assert c.ENV_HF_HUB_CACHE not in env_of(template["spec"]["containers"][0])
    for _, template in pod_templates(rendered("tiny")):
        assert c.ENV_HF_HUB_CACHE not in env_of(template["spec"]["containers"][0])


def test_spec_pod_env_may_move_the_hub_cache():
    rlrun = defaulted(variant("minimal", pod={"env": [{"name": "HF_HUB_CACHE", "value": "/cache"}]}))
    for _, template in pod_templates(render(rlrun)):
        container = template["spec"]["containers"][0]
        assert env_of(container)[c.ENV_HF_HUB_CACHE] == "/cache"  # the later entry: what the kubelet keeps
        names = [e["name"] for e in container["env"]]
        assert names.index("HF_HUB_CACHE") < len(names) - 1 and names[-1] == "HF_HUB_CACHE"
    # The default (modelCache true) is the renderer's: neither the spec nor the run config carries it, so the
    # ConfigMap of an existing run is unchanged.
    config = yaml.safe_load(one(render(rlrun), "ConfigMap", "qwen3-countdown-config")["data"]["rlrun.yaml"])
    assert "modelCache" not in rlrun["spec"]["storage"] and "modelCache" not in config["spec"]["storage"]


def test_manifests_dump_the_run_config_as_a_literal_block_and_load_back_unchanged():
    from rlrun_operator.render.config import dump_manifests

    for key in ("tiny", "complete", "tiny-gloo"):
        objects = rendered(key)
        text = dump_manifests(objects)
        assert list(yaml.safe_load_all(text)) == objects
        assert "  rlrun.yaml: |\n    apiVersion: rlrun.dev/v1alpha1\n    kind: RLRun\n" in text
        assert "\\n" not in text  # no escaped newlines anywhere
    # A string a literal block cannot hold (trailing space before a line break) keeps PyYAML's quoting.
    odd = [{"data": {"x": "a \nb\n", "y": "one line"}}]
    assert list(yaml.safe_load_all(dump_manifests(odd))) == odd


# --- pods: env contract, storage, config, probes, security ---------------------------------------

@pytest.mark.parametrize("key", ["complete", "tiny-disaggregated"])
def test_every_pod_has_the_contract_env_mounts_probes_and_security(key):
    rlrun = defaulted(VARIANTS[key])
    objects = render(rlrun)
    mount_path = rlrun["spec"]["storage"]["mountPath"]
    for workload, template in pod_templates(objects):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == c.RUNTIME_UID
        assert pod["securityContext"]["fsGroup"] == c.RUNTIME_GID
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["securityContext"]["runAsUser"] != 0
        volumes = {v["name"]: v for v in pod["volumes"]}
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert container["image"] == rlrun["spec"]["image"]
        assert container["imagePullPolicy"] == rlrun["spec"]["imagePullPolicy"]
        names = [e["name"] for e in container["env"]]
        assert names[:5] == ["RLRUN_CONFIG", "RLRUN_STORAGE_DIR", "RLRUN_RUN_NAME", "RLRUN_NAMESPACE", "POD_IP"]
        env = env_of(container)
        assert env["RLRUN_CONFIG"] == "/etc/rlrun/rlrun.yaml" == c.CONFIG_PATH
        assert env["RLRUN_STORAGE_DIR"] == mount_path
        assert env["RLRUN_RUN_NAME"] == rlrun["metadata"]["name"]
        assert env["POD_IP"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        config_volume = volumes[mounts[c.CONFIG_MOUNT_DIR]["name"]]
        assert config_volume["configMap"]["name"] == f"{rlrun['metadata']['name']}-config"
        assert mounts[c.CONFIG_MOUNT_DIR]["readOnly"] is True
        assert "persistentVolumeClaim" in volumes[mounts[mount_path]["name"]]
        # Probes on every long-running container, on a port the container declares.
        port_names = {p["name"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] in port_names, (workload["metadata"]["name"], probe)
        # $(VAR) references in command and env resolve to variables defined earlier (Kubernetes expansion).
        defined: list[str] = []
        for entry in container["env"]:
            for ref in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
                assert ref in defined, (entry["name"], ref)
            defined.append(entry["name"])
        for token in container["command"]:
            for ref in re.findall(r"\$\((\w+)\)", token):
                assert ref in defined, ref
        # Spec pod overrides reach every pod (complete sets them; tiny-disaggregated does not).
        overrides = rlrun["spec"]["pod"]
        for field in ("nodeSelector", "tolerations", "priorityClassName"):
            assert pod.get(field) == overrides.get(field)
        assert container.get("envFrom") == overrides.get("envFrom")
        assert [e for e in container["env"] if e["name"] == "WANDB_PROJECT"] == [
            e for e in overrides.get("env", [])]
        assert pod.get("imagePullSecrets") == rlrun["spec"].get("imagePullSecrets")


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_reserved_env_names_list_every_variable_rlrun_sets(key):
    rlrun = defaulted(VARIANTS[key])
    user = {e["name"] for e in rlrun["spec"]["pod"].get("env", [])}
    for _, template in pod_templates(render(rlrun)):
        names = {e["name"] for e in template["spec"]["containers"][0]["env"]} - user
        assert names - c.OVERRIDABLE_ENV_NAMES <= RESERVED_ENV_NAMES
    assert not c.OVERRIDABLE_ENV_NAMES & RESERVED_ENV_NAMES


def test_services_select_pods_that_declare_their_target_ports():
    for key in ("complete", "tiny"):
        objects = rendered(key)
        templates = [t for _, t in pod_templates(objects)]
        for service in by_kind(objects, "Service").values():
            matching = [t for t in templates if selects({"matchLabels": service["spec"]["selector"]},
                                                        t["metadata"]["labels"])]
            assert len(matching) == 1, service["metadata"]["name"]
            ports = {p["name"]: p["containerPort"] for p in matching[0]["spec"]["containers"][0]["ports"]}
            for port in service["spec"]["ports"]:
                assert ports[port["targetPort"]] == port["port"]


def test_config_map_holds_the_defaulted_run_without_labels_or_status():
    rlrun = defaulted(VARIANTS["complete"])
    rlrun["metadata"]["labels"] = {"argocd.argoproj.io/instance": "x"}
    rlrun["status"] = {"phase": "Running"}
    config_map = one(render(rlrun), "ConfigMap", "qwen3-4b-math-config")
    document = yaml.safe_load(config_map["data"]["rlrun.yaml"])
    assert document == {"apiVersion": "rlrun.dev/v1alpha1", "kind": "RLRun",
                        "metadata": {"name": "qwen3-4b-math", "namespace": "rl-test"}, "spec": rlrun["spec"]}
    assert apply_defaults(document) == document  # already defaulted: the runtime sees every value


@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_config_map_text_is_what_pyyaml_itself_writes(key):
    """render.config uses libyaml's emitter for speed; the text must not depend on which one is installed
    (the ConfigMap's spec hash would change with it)."""
    from rlrun_operator.render.config import get_config_document

    from rlrun_operator.render.storage import get_storage_defaulted

    rlrun = defaulted(VARIANTS[key])
    (config_map,) = [o for o in render(rlrun) if o["kind"] == "ConfigMap"]
    expected = yaml.dump(get_config_document(get_storage_defaulted(rlrun)), Dumper=yaml.SafeDumper,
                         sort_keys=True, default_flow_style=False)
    assert config_map["data"]["rlrun.yaml"] == expected


# --- suspend, determinism, config hash -----------------------------------------------------------

def test_suspend_scales_every_workload_to_zero_and_keeps_storage():
    objects = rendered("complete-suspended")
    for obj in objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            assert obj["spec"]["replicas"] == 0, obj["metadata"]["name"]
        if obj["kind"] == "Job":
            assert obj["spec"]["suspend"] is True
    kinds = {o["kind"] for o in objects}
    assert {"ConfigMap", "PersistentVolumeClaim"} <= kinds
    running = rendered("complete")
    # Suspending changes replicas and the Job's suspend flag only: no pod template changes.
    for a, b in zip(pod_templates(running), pod_templates(objects)):
        assert a[1] == b[1]


def test_render_is_deterministic_and_independent_of_key_order():
    rlrun = defaulted(VARIANTS["complete"])
    first = render(rlrun)
    assert render(copy.deepcopy(rlrun)) == first
    reordered = yaml.safe_load(yaml.safe_dump(rlrun, sort_keys=True))
    reordered["spec"] = dict(reversed(list(reordered["spec"].items())))
    assert render(reordered) == first
    assert yaml.safe_dump_all(render(reordered), sort_keys=True) == yaml.safe_dump_all(first, sort_keys=True)
    # No object shares a sub-dict with another (YAML would print anchors; callers may mutate one).
    assert "&id" not in yaml.safe_dump_all(first)
    assert rlrun == defaulted(VARIANTS["complete"])  # the input is not mutated


def hashes(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {w["metadata"]["name"]: t["metadata"]["annotations"][c.ANNOTATION_CONFIG_HASH]
            for w, t in pod_templates(objects)}


def test_config_hash_follows_exactly_the_fields_each_role_reads():
    base = hashes(rendered("complete"))
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in base.values())

    def changed(**patch: Any) -> set[str]:
        after = hashes(render(apply_defaults(variant("complete", **patch))))
        return {name.removeprefix("qwen3-4b-math-") for name in base if after[name] != base[name]}

    # The orchestrator (a Job, replaced when its hash changes) does not read vLLM's or the router's settings.
    assert changed(**{"inference.vllmArgs": ["--gpu-memory-utilization", "0.8"]}) == {"prefill", "decode"}
    assert changed(**{"inference.tensorParallel": 2, "inference.gpusPerReplica": 2}) == {"prefill", "decode"}
    assert changed(**{"algorithm.learningRate": 0.00001}) == {"trainer", "orchestrator"}
    assert changed(**{"router.policy": "round_robin"}) == {"router"}
    assert changed(**{"router.args": ["--log-level", "debug"]}) == {"router"}
    spec = defaulted(VARIANTS["complete"])["spec"]
    plain = copy.deepcopy(spec)
    plain["inference"]["disaggregation"]["enabled"] = False  # the orchestrator's request shape depends on it
    assert get_config_hash(plain, "orchestrator") != get_config_hash(spec, "orchestrator")
    assert changed(**{"algorithm.sampling.temperature": 0.7}) == {"trainer", "orchestrator"}
    assert changed(**{"environment.seed": 7}) == {"orchestrator"}
    assert changed(**{"weightSync.transport": "nccl"}) == {"trainer", "prefill", "decode", "orchestrator"}
    assert changed(**{"model.maxModelLen": 16384}) == {"trainer", "prefill", "decode", "orchestrator"}
    # Replica seeds, autoscaling, resources and suspend never roll pods through the hash.
    assert changed(**{"inference.disaggregation.replicas": 3, "autoscaling.decode": {"min": 1, "max": 8}}) == set()
    assert changed(**{"autoscaling.downCooldownSeconds": 60}) == set()
    assert changed(**{"inference.resources": {"requests": {"cpu": "4"}}}) == set()
    assert changed(suspend=True) == set()
    spec = defaulted(VARIANTS["complete"])["spec"]
    assert get_config_hash(spec, "prefill") == get_config_hash(spec, "decode") == base["qwen3-4b-math-prefill"]


# --- errors -------------------------------------------------------------------------------------------

def test_spec_pod_env_may_not_replace_the_contract_but_may_tune_the_cpu_kv_cache():
    rlrun = variant("tiny", pod={"env": [{"name": "WANDB_MODE", "value": "offline"},
                                         {"name": "RLRUN_ROUTER_URL", "value": "http://elsewhere"}]})
    # validate() refuses it first (what the CLI and the operator run); render() refuses it on its own too.
    assert [e.path for e in validate(rlrun)] == ["spec.pod.env[1].name"]
    with pytest.raises(RenderError, match=r"spec\.pod\.env\[1\]\.name: RLRUN_ROUTER_URL .*remove it"):
        render(apply_defaults(rlrun))
    # NNODES is only the trainer's, but spec.pod.env reaches every container: refused as well.
    with pytest.raises(RenderError, match=r"spec\.pod\.env\[0\]\.name: NNODES "):
        render(apply_defaults(variant("tiny", pod={"env": [{"name": "NNODES", "value": "3"}]})))
    rlrun = variant("tiny", pod={"env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"}]})
    deployment = one(render(defaulted(rlrun)), "Deployment", "tiny-reverse-inference")
    assert env_of(deployment["spec"]["template"]["spec"]["containers"][0])["VLLM_CPU_KVCACHE_SPACE"] == "4"


@pytest.mark.parametrize("name", ["a" * 45, "has.dots", "Upper", "9starts-with-digit"])
def test_names_that_cannot_name_the_children_are_rejected(name):
    rlrun = apply_defaults(load_example("tiny"))
    rlrun["metadata"]["name"] = name
    with pytest.raises(RenderError, match=r"^metadata\.name: .*at most 44 characters"):
        render(rlrun)
    rlrun["metadata"]["name"] = "a" * 44
    assert all(kubernetes_validate.validate(o, K8S_VERSION, strict=True) for o in render(rlrun))


def test_public_api():
    assert render_module.__all__ == ["RenderError", "get_child_names", "get_config_hash", "get_inference_pools",
                                     "render"]
    assert issubclass(RenderError, ValueError)


# --- property test ------------------------------------------------------------------------------------

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    disaggregated=st.booleans(),
    p=st.integers(1, 9),
    d=st.integers(1, 9),
    budget=st.integers(2, 40),
    replicas=st.integers(1, 12),
    gpus=st.integers(0, 8),
    nodes=st.integers(1, 4),
    suspend=st.booleans(),
    claim=st.booleans(),
)
def test_property_any_valid_knob_setting_renders_valid_consistent_objects(
    disaggregated, p, d, budget, replicas, gpus, nodes, suspend, claim
):
    rlrun = load_example("minimal")
    spec = rlrun["spec"]
    spec["suspend"] = suspend
    spec["trainer"] = {"nodes": nodes if gpus else 1, "gpusPerNode": gpus}
    spec["inference"] = {"gpusPerReplica": gpus, "tensorParallel": max(gpus, 1), "replicas": replicas,
                         "disaggregation": {"enabled": disaggregated, "ratio": f"{p}:{d}", "replicas": budget}}
    if claim:
        spec["storage"] = {"claimName": "existing"}
    rlrun = defaulted(rlrun)
    objects = render(rlrun)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    deployments = by_kind(objects, "Deployment")
    sts = one(objects, "StatefulSet", "qwen3-countdown-trainer")
    if disaggregated:
        size = size_pd(f"{p}:{d}", budget)
        seeds = {"prefill": size.prefill, "decode": size.decode}
    else:
        seeds = {"inference": replicas}
    for component, seed in seeds.items():
        deployment = deployments[f"qwen3-countdown-{component}"]
        assert deployment["spec"]["replicas"] == (0 if suspend else seed)
        gpu_limit = deployment["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get(
            "limits", {}).get("nvidia.com/gpu")
        assert gpu_limit == (gpus or None)
    assert set(deployments) == {f"qwen3-countdown-{x}" for x in (*seeds, "router")}
    assert sts["spec"]["replicas"] == (0 if suspend else spec["trainer"]["nodes"])
    assert deployments["qwen3-countdown-router"]["spec"]["replicas"] == (0 if suspend else 1)
    assert one(objects, "Job", "qwen3-countdown-orchestrator")["spec"]["suspend"] is suspend
    assert ("PersistentVolumeClaim" in {o["kind"] for o in objects}) is not claim
