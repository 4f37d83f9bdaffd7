"""`rlrun local`'s plan: the rendered manifests -> local processes, and Kubernetes $(VAR) expansion."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import yaml

from rlrun_api import constants as c
from rlrun_api import spec
from rlrun_operator import render
from rlrun_runtime.local.kube_expansion import expand
from rlrun_runtime.local.plan import LOCAL_HOST, LocalPaths, get_local_plan

ROOT = Path(__file__).resolve().parents[2]



# --- $(VAR) expansion --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("--port=$(P)", "--port=8000"),
    ("$(P)$(P)", "80008000"),
    ("$(MISSING)", "$(MISSING)"),          # undefined: kept as written
    ("$$(P)", "$(P)"),                     # escaped reference
    ("$$$(P)", "$8000"),                   # escaped $ then a reference
    ("a$$b", "a$b"),
    ("$P", "$P"),                          # not a reference
    ("$(P", "$(P"),                        # unterminated
    ("cost$", "cost$"),                    # trailing operator
    ("$()", ""),                           # empty name is a reference to "" (undefined -> kept)
    ("x$(EMPTY)y", "xy"),
    ("", ""),
])
def test_expand_follows_kubelet_rules(text, expected):
    variables = {"P": "8000", "EMPTY": "", "": ""}
    assert expand(text, variables) == expected


def test_expand_undefined_empty_name_is_kept():
    assert expand("$()", {}) == "$()"


# --- manifests -> processes (real renderer) ----------------------------------------------------------

def _rendered(rlrun: dict) -> list[dict]:
    out = spec.apply_defaults(rlrun)
    out["metadata"]["namespace"] = "local"
    return render.render(out)


def _plan(manifests, tmp_path, base_env=None):
    ports = itertools.count(41000)
    return get_local_plan(manifests, lambda: next(ports), LocalPaths(tmp_path), base_env or {"PATH": "/usr/bin"})


def _all_ports(plan) -> list[int]:
    return [port for p in plan.processes for port in p.ports.values()]


def _service_names(manifests) -> list[str]:
    return [m["metadata"]["name"] for m in manifests if m["kind"] == "Service"]


def test_plan_tiny_example_runs_rendered_commands_locally(tiny_example, tmp_path):
    manifests = _rendered(tiny_example)
    plan = _plan(manifests, tmp_path, {"PATH": "/usr/bin", "HOME": "/home/x"})
    names = [p.name for p in plan.processes]
    assert names == ["tiny-reverse-trainer-0", "tiny-reverse-inference-0", "tiny-reverse-router-0",
                     "tiny-reverse-orchestrator"]
    by = {p.component: p for p in plan.processes}
    trainer, inference, router, orch = by["trainer"], by["inference"], by["router"], by["orchestrator"]
    assert [p.workload_kind for p in plan.processes] == ["StatefulSet", "Deployment", "Deployment", "Job"]

    config = tmp_path / "config" / c.CONFIG_FILE_NAME
    rendered_config = next(m for m in manifests if m["kind"] == "ConfigMap")["data"][c.CONFIG_FILE_NAME]
    assert plan.files == {config: rendered_config}
    assert yaml.safe_load(plan.files[config])["metadata"]["name"] == "tiny-reverse"

    ports = _all_ports(plan)
    assert len(ports) == len(set(ports)) == 6  # trainer 2, inference 1, router 2, orchestrator 1
    rendezvous = trainer.ports[c.TRAINER_MASTER_PORT]
    assert trainer.argv == (
        "torchrun", "--nnodes=1", "--nproc-per-node=1", "--node-rank=0", f"--master-addr={LOCAL_HOST}",
        f"--master-port={rendezvous}", "-m", "rlrun_runtime", "trainer", "--config", str(config))
    assert trainer.env[c.ENV_NODE_RANK] == "0"
    assert trainer.env[c.ENV_MASTER_ADDR] == LOCAL_HOST
    assert trainer.env[c.ENV_MASTER_PORT] == str(rendezvous)
    assert trainer.env[c.ENV_TRAINER_METRICS_PORT] == str(trainer.ports[c.TRAINER_METRICS_PORT])
    for p in plan.processes:
        assert p.env[c.ENV_CONFIG] == str(config)
        assert p.env[c.ENV_STORAGE_DIR] == str(tmp_path)
        assert p.env[c.ENV_NAMESPACE] == "local"
        assert p.env[c.ENV_POD_IP] == LOCAL_HOST
        assert p.env[c.ENV_BIND_HOST] == LOCAL_HOST
        assert p.env[c.ENV_RUN_NAME] == "tiny-reverse"
        assert p.env["HOME"] == "/home/x" and p.env["PATH"] == "/usr/bin"
        assert p.log_path == tmp_path / "logs" / f"{p.name}.log"
        assert not any("$(" in token for token in p.argv)
        assert "/etc/rlrun" not in " ".join(p.argv)
    assert inference.argv == ("rlrun-runtime", "inference", "--config", str(config))
    inference_port = inference.ports[c.INFERENCE_PORT]
    assert inference.env[c.ENV_INFERENCE_PORT] == str(inference_port)
    assert inference.env[c.ENV_INFERENCE_ROLE] == "both"
    assert router.env[c.ENV_ROUTER_DISCOVERY] == "static"
    assert router.env[c.ENV_WORKER_URLS] == f"http://{LOCAL_HOST}:{inference_port}"
    assert router.env[c.ENV_ROUTER_PORT] == str(router.ports[c.ROUTER_PORT])
    assert router.env[c.ENV_ROUTER_METRICS_PORT] == str(router.ports[c.ROUTER_METRICS_PORT])
    assert orch.env[c.ENV_ROUTER_URL] == f"http://{LOCAL_HOST}:{router.ports[c.ROUTER_PORT]}"
    assert orch.env[c.ENV_INFERENCE_ENDPOINTS] == f"{LOCAL_HOST}:{inference_port}"
    assert orch.env[c.ENV_METRICS_PORT] == str(orch.ports[c.ORCHESTRATOR_METRICS_PORT])
    services = _service_names(manifests)
    for p in plan.processes:  # no cluster host name is left anywhere
        for value in list(p.env.values()) + list(p.argv):
            assert not any(re.search(rf"\b{re.escape(s)}\b", value) for s in services), value
    assert plan.warnings == ()


def test_plan_disaggregated_gives_every_replica_its_own_ports(tiny_example, tmp_path):
    tiny_example["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:2", "replicas": 3}
    tiny_example["spec"]["pod"] = {"env": [{"name": "FOO", "value": "x-$(RLRUN_RUN_NAME)"}],
                                 "envFrom": [{"secretRef": {"name": "tokens"}}]}
    manifests = _rendered(tiny_example)
    plan = _plan(manifests, tmp_path)
    prefill, decode = plan.by_component("prefill"), plan.by_component("decode")
    assert [p.name for p in prefill] == ["tiny-reverse-prefill-0"]
    assert [p.name for p in decode] == ["tiny-reverse-decode-0", "tiny-reverse-decode-1"]
    ports = _all_ports(plan)
    assert len(ports) == len(set(ports))
    servers = prefill + decode
    inference_ports = [int(p.env[c.ENV_INFERENCE_PORT]) for p in servers]
    nixl_ports = [int(p.env[c.ENV_NIXL_SIDE_CHANNEL_PORT]) for p in servers]
    assert len(set(inference_ports + nixl_ports)) == 6
    for p in servers:
        assert p.env[c.ENV_INFERENCE_PORT] == str(p.ports[c.INFERENCE_PORT])
        assert p.env[c.ENV_NIXL_SIDE_CHANNEL_PORT] == str(p.ports[c.NIXL_SIDE_CHANNEL_PORT])
        assert p.env[c.ENV_NIXL_SIDE_CHANNEL_HOST] == LOCAL_HOST
        assert p.env[c.ENV_INFERENCE_ROLE] == p.component
    (router,) = plan.by_component("router")
    assert router.env[c.ENV_ROUTER_DISCOVERY] == "static"
    assert router.env[c.ENV_PREFILL_URLS] == f"http://{LOCAL_HOST}:{inference_ports[0]}"
    assert router.env[c.ENV_DECODE_URLS] == ",".join(f"http://{LOCAL_HOST}:{p}" for p in inference_ports[1:])
    assert c.ENV_WORKER_URLS not in router.env
    (orch,) = plan.by_component("orchestrator")
    # <name>-prefill:8000,<name>-decode:8000 (headless) -> every pod's endpoint
    assert orch.env[c.ENV_INFERENCE_ENDPOINTS] == ",".join(f"{LOCAL_HOST}:{p}" for p in inference_ports)
    assert all(p.env["FOO"] == "x-tiny-reverse" for p in plan.processes)
    services = _service_names(manifests)
    for p in plan.processes:
        for value in list(p.env.values()) + list(p.argv):
            assert not any(re.search(rf"\b{re.escape(s)}\b", value) for s in services), value
    assert len(plan.warnings) == 1 and "Secret tokens" in plan.warnings[0]
    assert all(p.name in plan.warnings[0] for p in plan.processes)


def test_plan_multi_node_trainer_ranks_share_the_master_port(tmp_path):
    rlrun = yaml.safe_load((ROOT / "examples" / "rlrun-complete.yaml").read_text())
    plan = _plan(_rendered(rlrun), tmp_path)
    trainers = plan.by_component("trainer")
    assert [p.env[c.ENV_NODE_RANK] for p in trainers] == ["0", "1"]
    master = trainers[0].ports[c.TRAINER_MASTER_PORT]
    for rank, p in enumerate(trainers):
        assert p.env[c.ENV_MASTER_PORT] == str(master)
        assert f"--master-port={master}" in p.argv and f"--node-rank={rank}" in p.argv
        assert f"--master-addr={LOCAL_HOST}" in p.argv
    metrics = [p.env[c.ENV_TRAINER_METRICS_PORT] for p in trainers]
    assert len(set(metrics)) == 2
    ports = _all_ports(plan)
    assert len(ports) == len(set(ports))


def test_plan_resolves_kubelet_env_sources(tmp_path):
    """Hand-written manifests for the sources the renderer does not use today."""
    labels = {"app": "x", c.LABEL_COMPONENT: "worker"}
    manifests = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "ns"},
         "data": {"GREETING": "hello", "conf.txt": "a=1"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "api", "namespace": "ns"},
         "spec": {"selector": {"app": "x"}, "ports": [{"port": 80, "targetPort": 9000}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "w", "namespace": "ns"},
         "spec": {"replicas": 2, "template": {"metadata": {"labels": labels}, "spec": {
             "containers": [{
                 "name": "w", "command": ["run", "--url=$(URL)", "--lit=$$(URL)", "--cfg=/cfg/conf.txt"],
                 "args": ["--scratch", "/scratch/a", "--peer", "api.ns.svc.cluster.local:80"],
                 "ports": [{"containerPort": 9000, "name": "web"}],
                 "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                 "env": [
                     {"name": "HOST", "value": "api.ns.svc"},
                     {"name": "URL", "value": "http://$(HOST):80/v1"},
                     {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                     {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                     {"name": "G", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "GREETING"}}},
                     {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
                     {"name": "LATER", "value": "$(NOT_YET)"},
                     {"name": "NOT_YET", "value": "v"},
                 ],
                 "volumeMounts": [{"name": "cfg", "mountPath": "/cfg"}, {"name": "tmp", "mountPath": "/scratch"}],
             }],
             "volumes": [{"name": "cfg", "configMap": {"name": "cm"}}, {"name": "tmp", "emptyDir": {}}],
         }}}},
    ]
    plan = _plan(manifests, tmp_path)
    w0, w1 = plan.processes
    assert (w0.name, w1.name) == ("w-0", "w-1")
    first_pod_port = w0.ports[9000]  # a ClusterIP Service goes to its first pod
    assert w0.env["HOST"] == LOCAL_HOST
    assert w0.env["URL"] == f"http://{LOCAL_HOST}:80/v1"  # $(HOST) expanded before the host was known as a URL
    assert w0.env["CM_GREETING"] == "hello" and w0.env["G"] == "hello"
    assert w0.env["POD"] == "w-0" and w1.env["POD"] == "w-1"
    assert w0.env["APP"] == "x"
    assert "TOKEN" not in w0.env
    assert w0.env["LATER"] == "$(NOT_YET)"  # only earlier variables expand, as in Kubernetes
    assert w0.argv == ("run", f"--url=http://{LOCAL_HOST}:80/v1", "--lit=$(URL)",
                       f"--cfg={tmp_path / 'config' / 'conf.txt'}",
                       "--scratch", str(tmp_path / "tmp" / "w-0" / "tmp" / "a"),
                       "--peer", f"{LOCAL_HOST}:{first_pod_port}")
    assert plan.files[tmp_path / "config" / "conf.txt"] == "a=1"
    assert any("secretKeyRef" in w and "w-0, w-1" in w for w in plan.warnings)


def test_free_ports_sit_below_the_kernels_ephemeral_range_are_free_and_never_repeat(tmp_path):
    """rlrun local's ports come from below the kernel's ephemeral range (which port-0 binds and outgoing
    connections draw from, so a role starting minutes later still finds its port), each free when given, each
    once; a port another program holds is skipped; the range file is read, with Linux's default without it."""
    import random
    import socket

    from rlrun_runtime.local import DEFAULT_EPHEMERAL_RANGE, FIXED_PORTS_LOW, FreePorts, get_ephemeral_range

    first, last = get_ephemeral_range()
    if first < FIXED_PORTS_LOW + 1000:  # a machine whose ephemeral range starts low: a range of the test's own
        first, last = 40000, 50000
    ports = FreePorts(ephemeral=(first, last))
    given = [ports() for _ in range(200)]
    assert len(set(given)) == 200 and all(FIXED_PORTS_LOW <= p < first for p in given)
    with socket.socket() as held:  # a listener on one candidate (another loopback address): the next is given
        held.bind(("127.0.0.2", given[0]))
        held.listen()

        class Candidates(random.Random):
            def randrange(self, *args):
                return self.queue.pop(0)

        rng = Candidates()
        rng.queue = [given[0], given[1]]
        assert FreePorts(rng=rng, ephemeral=(first, last))() == given[1] and rng.queue == []
    (tmp_path / "range").write_text("40000\t50000\n")
    assert get_ephemeral_range(tmp_path / "range") == (40000, 50000)
    assert get_ephemeral_range(tmp_path / "missing") == DEFAULT_EPHEMERAL_RANGE
    kernel = FreePorts(ephemeral=(FIXED_PORTS_LOW + 10, 60999))  # no room below: the kernel's own free ports
    kernel_first, kernel_last = get_ephemeral_range()
    assert kernel.span is None and kernel_first <= kernel() <= kernel_last
