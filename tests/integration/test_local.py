"""`rlrun local`: the manifest -> process translation against the real renderer, Kubernetes $(VAR)
expansion, the supervisor with real processes, progress parsing, the plot, and bad input (exit 2)."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from rlrun_api import constants as c
from rlrun_api import spec
from rlrun_operator import render
from rlrun_runtime import local
from rlrun_runtime.local.kube_expansion import expand
from rlrun_runtime.local.plan import LOCAL_HOST, LocalPaths, ProcessSpec, get_local_plan
from rlrun_runtime.local.processes import Supervisor, get_outcome, read_process_table
from rlrun_runtime.local.progress import (MetricsTail, ProgressDisplay, get_progress, get_reward_summary,
                                          parse_metrics_lines, parse_prometheus, render_line, render_summary)
from rlrun_runtime.plot import get_plot_series, render_plot
from rlrun_runtime.storage import RunStorage

ROOT = Path(__file__).resolve().parents[2]
RLRUN = [str(Path(sys.executable).parent / "rlrun")]


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


def test_plan_tiny_example_runs_rendered_commands_locally(tiny_rlrun, tmp_path):
    manifests = _rendered(tiny_rlrun)
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


def test_plan_disaggregated_gives_every_replica_its_own_ports(tiny_rlrun, tmp_path):
    tiny_rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:2", "replicas": 3}
    tiny_rlrun["spec"]["pod"] = {"env": [{"name": "FOO", "value": "x-$(RLRUN_RUN_NAME)"}],
                                 "envFrom": [{"secretRef": {"name": "tokens"}}]}
    manifests = _rendered(tiny_rlrun)
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


# --- the supervisor with real processes ------------------------------------------------------------

PY = sys.executable
# A server that starts a grandchild in its own session (like torchrun's workers) and one in its group.
SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    subprocess.Popen(sleeper, start_new_session=True)
    subprocess.Popen(sleeper)
    print("children started", flush=True)
    time.sleep(600)
""")
# Ignores SIGTERM: only SIGKILL ends it.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


def _spec(tmp_path, name, kind, code, component=""):
    return ProcessSpec(name, component, kind, (PY, "-c", code), dict(os.environ), tmp_path / f"{name}.log")


def _live(pids) -> list[int]:
    table = read_process_table()
    return [p for p in pids if p in table and table[p].state != "Z"]


def _wait_for_children(supervisor, count, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = supervisor.alive()
        if len(pids) >= count:
            return pids
        time.sleep(0.1)
    raise AssertionError(f"only {supervisor.alive()} started")


@pytest.mark.timeout(60)
def test_supervisor_failure_stops_everything_and_names_the_role(tmp_path):
    specs = [
        _spec(tmp_path, "server-0", "Deployment", SPAWNER, "inference"),
        _spec(tmp_path, "stubborn-0", "Deployment", STUBBORN, "router"),
        _spec(tmp_path, "trainer-0", "StatefulSet",
              "import sys, time; time.sleep(3); print('loss nan at step 4', flush=True); sys.exit(3)", "trainer"),
    ]
    supervisor = Supervisor(specs, grace_seconds=1.0, poll_seconds=0.1)
    supervisor.start()
    pids = _wait_for_children(supervisor, 5)  # 3 leaders + 2 grandchildren
    started = time.monotonic()
    outcome = supervisor.wait()
    assert not outcome.success
    assert outcome.failed == "trainer-0" and outcome.returncode == 3
    assert "trainer-0 (trainer) exited with code 3" == outcome.reason
    assert outcome.log_tail[-1] == "loss nan at step 4"
    assert time.monotonic() - started < 20
    deadline = time.monotonic() + 5
    while _live(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live(pids) == [], "orphans left"
    for pid in pids:  # gone, or at most a zombie waiting for init to reap it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        assert read_process_table().get(pid) is None or read_process_table()[pid].state == "Z"


@pytest.mark.timeout(60)
def test_supervisor_job_success_stops_the_servers(tmp_path):
    specs = [
        _spec(tmp_path, "server-0", "Deployment", SPAWNER, "inference"),
        _spec(tmp_path, "trainer-0", "StatefulSet", "print('done', flush=True)", "trainer"),  # exit 0: fine
        _spec(tmp_path, "orchestrator", "Job", "import time; time.sleep(2)", "orchestrator"),
    ]
    supervisor = Supervisor(specs, grace_seconds=2.0, poll_seconds=0.1)
    supervisor.start()
    pids = _wait_for_children(supervisor, 3)
    outcome = supervisor.wait()
    assert outcome.success and outcome.failed is None
    assert outcome.reason == "orchestrator finished"
    assert supervisor.exits()["trainer-0"] == 0
    assert supervisor.exits()["server-0"] == -15  # SIGTERM: stopped gracefully
    assert _live(pids) == []


@pytest.mark.timeout(60)
def test_supervisor_lets_the_trainer_finish_after_the_job(tmp_path):
    specs = [
        _spec(tmp_path, "trainer-0", "StatefulSet", "import time; time.sleep(3); print('checkpoint saved')", "trainer"),
        _spec(tmp_path, "orchestrator", "Job", "pass", "orchestrator"),
    ]
    supervisor = Supervisor(specs, grace_seconds=1.0, poll_seconds=0.1, finish_seconds=30)
    supervisor.start()
    outcome = supervisor.wait()
    assert outcome.success and outcome.reason == "orchestrator finished"
    assert supervisor.exits() == {"trainer-0": 0, "orchestrator": 0}  # exited by itself, not SIGTERMed
    assert tail_lines_of(specs[0])[-1] == "checkpoint saved"

    stuck = [_spec(tmp_path, "trainer-1", "StatefulSet", STUBBORN, "trainer"),
             _spec(tmp_path, "orchestrator-1", "Job", "pass", "orchestrator")]
    supervisor = Supervisor(stuck, grace_seconds=0.5, poll_seconds=0.1, finish_seconds=1.0)
    supervisor.start()
    outcome = supervisor.wait()
    assert outcome.success and "trainer-1 still running after 1 s, stopped" in outcome.reason
    assert supervisor.exits()["trainer-1"] == -9


def tail_lines_of(spec):
    return spec.log_path.read_text().splitlines()


@pytest.mark.timeout(30)
def test_supervisor_stop_event_interrupts(tmp_path):
    import threading

    supervisor = Supervisor([_spec(tmp_path, "s-0", "Deployment", STUBBORN)], grace_seconds=0.5, poll_seconds=0.1)
    supervisor.start()
    pids = _wait_for_children(supervisor, 1)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    outcome = supervisor.wait(stop)
    assert not outcome.success and outcome.failed is None and "interrupted" in outcome.reason
    assert supervisor.exits()["s-0"] == -9  # ignored SIGTERM, got SIGKILL after the grace period
    assert _live(pids) == []


@pytest.mark.parametrize("exits, expected", [
    ({}, None),
    ({"t": 0}, None),                              # the trainer finished its steps: keep going
    ({"t": 0, "o": 0}, (True, None)),              # the Job succeeded
    ({"o": 0}, (True, None)),
    ({"s": 0}, (False, "s")),                      # a server must not exit
    ({"s": -9}, (False, "s")),
    ({"t": 1, "o": 0}, (False, "t")),              # any failure wins
    ({"o": 2}, (False, "o")),
])
def test_get_outcome_rules(tmp_path, exits, expected):
    specs = [_spec(tmp_path, "s", "Deployment", ""), _spec(tmp_path, "t", "StatefulSet", ""),
             _spec(tmp_path, "o", "Job", "")]
    outcome = get_outcome(specs, exits)
    assert (None if outcome is None else (outcome.success, outcome.failed)) == expected


# --- progress and plot -------------------------------------------------------------------------------

def _rows(n):
    return [{"step": s, "reward_mean": 0.1 + 0.02 * s, "mismatch_kl": 0.001 * s, "policy_version": s,
             "tokens_per_second": 800.0 + s} for s in range(1, n + 1)]


def test_metrics_tail_waits_for_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []
    rows = _rows(3)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2])[:10])
    assert [r["step"] for r in tail.poll()] == [1, 2]
    with open(path, "a") as handle:
        handle.write(json.dumps(rows[2])[10:] + "\n")
    assert [r["step"] for r in tail.poll()] == [3]
    assert [r["step"] for r in tail.rows] == [1, 2, 3]


def test_progress_from_metrics_and_orchestrator_scrape():
    registry = CollectorRegistry()
    for name, value in [(c.METRIC_STEP, 4), (c.METRIC_POLICY_VERSION, 3), (c.METRIC_LAST_REWARD, 0.2),
                        (c.METRIC_WEIGHT_UPDATE_IN_FLIGHT, 1), (c.METRIC_MAX_STEPS, 10)]:
        Gauge(name, "doc", registry=registry).set(value)
    scraped = parse_prometheus(generate_latest(registry).decode())
    assert scraped[c.METRIC_POLICY_VERSION] == 3.0
    rows = _rows(5)
    progress = get_progress(rows, scraped, max_steps=10, step_times={1: 100.0, 5: 120.0}, started_at=90.0, now=121.0)
    assert progress.step == 5 and progress.reward == pytest.approx(0.2)
    assert progress.loaded_version == 3 and progress.policy_lag == 2
    assert progress.eta_seconds == pytest.approx(25.0)  # 5 steps left x 5 s per step
    assert progress.weight_update_in_flight
    line = render_line(progress)
    assert line.startswith("step 5/10 reward 0.200 mismatch_kl 0.0050 tokens/s 805 lag 2")
    assert "eta 0m25s" in line and "(loading weights)" in line
    ahead = get_progress(rows, {**scraped, c.METRIC_POLICY_VERSION: 6.0}, max_steps=10, step_times={},
                         started_at=90.0, now=121.0)
    assert ahead.policy_lag == 0  # the scrape saw version 6 before metrics.jsonl showed step 6: never below 0
    empty = get_progress([], {}, max_steps=10, step_times={}, started_at=0.0, now=3.0)
    assert (empty.step, empty.reward, empty.policy_lag, empty.eta_seconds) == (0, None, None, None)


def test_plot_from_synthetic_metrics(tmp_path):
    rows = _rows(8) + [{"step": 8, "reward_mean": 0.9, "mismatch_kl": float("nan")}, {"note": "no step"}]
    steps, rewards = get_plot_series(rows, "reward_mean")
    assert steps == list(range(1, 9)) and rewards[-1] == 0.9  # a repeated step keeps its last value
    assert get_plot_series(rows, "mismatch_kl")[1][-1] == pytest.approx(0.008)  # NaN skipped
    path = render_plot(rows, tmp_path / "plot.png", title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError):
        render_plot([{"step": 1}], tmp_path / "empty.png")


def test_parse_metrics_lines_skips_garbage():
    assert parse_metrics_lines('{"step": 1}\n\nnot json\n[1]\n{"step": 2}\n') == [{"step": 1}, {"step": 2}]


# --- local.py helpers and bad input ------------------------------------------------------------------

def test_base_env_threads_and_path(tmp_path):
    env = local.get_base_env({"PATH": "/usr/bin", "OMP_NUM_THREADS": "4"}, tmp_path / "bin")
    assert env["PATH"] == f"{tmp_path / 'bin'}{os.pathsep}/usr/bin"
    assert env["OMP_NUM_THREADS"] == "4"  # the caller's setting wins
    assert env["MKL_NUM_THREADS"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"


def test_publish_final_copies_the_newest_weights(tmp_path):
    storage = RunStorage(tmp_path)
    for step in (1, 2):
        storage.weights(step).mkdir(parents=True)
        (storage.weights(step) / "model.safetensors").write_text(f"weights {step}")
    assert local.publish_final(storage, tmp_path / "final") == 2
    assert (tmp_path / "final" / "model.safetensors").read_text() == "weights 2"
    assert local.publish_final(RunStorage(tmp_path / "empty"), tmp_path / "final2") is None


def test_model_path_mapping(tmp_path):
    run_spec = {"model": {"name": "/data/models/m"}, "storage": {"mountPath": "/data"}}
    assert local.get_model_path(run_spec, tmp_path) == tmp_path / "models" / "m"
    assert local.get_model_path({**run_spec, "model": {"name": "Qwen/Qwen3-0.6B"}}, tmp_path) is None
    assert local.get_model_path({**run_spec, "model": {"name": c.TINY_MODEL_NAME}}, tmp_path) is None
    assert local.get_model_path({**run_spec, "model": {"name": "./m"}}, tmp_path) == Path("./m")


def _write(tmp_path, rlrun, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(rlrun))
    return path


def _run_main(args):
    out, err = io.StringIO(), io.StringIO()
    code = local.main([str(a) for a in args], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_invalid_spec_exits_2_with_field_lines(tiny_rlrun, tmp_path):
    tiny_rlrun["spec"]["algorithm"]["batchSize"] = 60  # not a multiple of rolloutsPerPrompt 8
    path = _write(tmp_path, tiny_rlrun)
    code, out, err = _run_main([path, "--output-dir", tmp_path / "o"])
    assert code == 2
    assert f"{path}: spec.algorithm.batchSize: " in err
    assert not (tmp_path / "o").exists()


def test_unknown_environment_exits_2(tiny_rlrun, tmp_path):
    tiny_rlrun["spec"]["environment"] = {"type": "reasoning-gym", "name": "no_such_dataset"}
    path = _write(tmp_path, tiny_rlrun)
    code, _, err = _run_main([path, "--output-dir", tmp_path / "o"])
    assert code == 2 and f"{path}: spec.environment.name: 'no_such_dataset'" in err


def test_missing_model_path_exits_2(tiny_rlrun, tmp_path):
    tiny_rlrun["spec"]["model"]["name"] = str(tmp_path / "nowhere")
    path = _write(tmp_path, tiny_rlrun)
    code, _, err = _run_main([path, "--output-dir", tmp_path / "o"])
    assert code == 2 and "spec.model.name:" in err and "no config.json" in err


def test_existing_run_needs_resume(tiny_rlrun, tmp_path):
    out_dir = tmp_path / "o"
    (out_dir / "checkpoints").mkdir(parents=True)
    path = _write(tmp_path, tiny_rlrun)
    code, _, err = _run_main([path, "--output-dir", out_dir])
    assert code == 2 and "--resume" in err and "--output-dir" in err


def test_cli_bad_input_has_no_traceback(tiny_rlrun, tmp_path):
    tiny_rlrun["spec"]["environment"]["name"] = "reverse-wordz"
    path = _write(tmp_path, tiny_rlrun)
    proc = subprocess.run(RLRUN + ["local", str(path), "--output-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "spec.environment.name" in proc.stderr and "Traceback" not in proc.stderr


def test_plain_progress_prints_one_line_per_new_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = _rows(3)
    metrics.write_text(json.dumps(rows[0]) + "\n")  # a resumed run's earlier step
    stream = io.StringIO()  # not a TTY: plain lines
    with ProgressDisplay(metrics, None, 3, ["a-0"], stream) as display:
        display.update()
        display.update()
        with open(metrics, "a") as handle:
            handle.write(json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
        progress = display.update()
    lines = stream.getvalue().splitlines()
    assert [line.split(" reward")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert progress.step == 3 and display.step_times.keys() == {2, 3}  # step 1 is not timed
    assert progress.eta_seconds is None  # steps 2 and 3 arrived in one poll: no timing yet


def test_metrics_tail_rereads_a_replaced_file(tmp_path):
    """A resumed trainer rewrites metrics.jsonl without the steps it trains again: the tail follows it."""
    path = tmp_path / "metrics.jsonl"
    rows = _rows(5)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tail = MetricsTail(path)
    assert len(tail.poll()) == 5
    replacement = tmp_path / "metrics.tmp"
    replacement.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    os.replace(replacement, path)  # what checkpoint.truncate_metrics does (atomic_write_text)
    assert [r["step"] for r in tail.poll()] == [1, 2, 3]
    assert [r["step"] for r in tail.rows] == [1, 2, 3]


def test_display_of_a_resume_starts_at_the_checkpoint_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(6)))  # steps 5, 6 will be trained again
    display = ProgressDisplay(metrics, None, 10, [], io.StringIO(), resume_step=4)
    assert display.update().step == 4


def test_a_value_that_rounds_to_zero_has_no_sign():
    progress = get_progress([{"step": 1, "reward_mean": 0.5, "mismatch_kl": -1e-9}], {}, max_steps=2,
                            step_times={}, started_at=0.0, now=1.0)
    assert "mismatch_kl 0.0000 " in render_line(progress)


def test_no_reward_is_shown_before_the_first_step():
    scraped = {c.METRIC_STEP: 0.0, c.METRIC_POLICY_VERSION: 0.0, c.METRIC_LAST_REWARD: 0.0}
    progress = get_progress([], scraped, max_steps=10, step_times={}, started_at=0.0, now=1.0)
    assert progress.reward is None and "reward -" in render_line(progress)


def test_display_keeps_the_last_scrape_after_the_orchestrator_exits(tmp_path, monkeypatch):
    from rlrun_runtime.local import progress as local_progress

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in _rows(3)))
    answers = iter([{c.METRIC_STEP: 3.0, c.METRIC_POLICY_VERSION: 3.0}, {}])
    monkeypatch.setattr(local_progress, "scrape", lambda url: next(answers))
    display = ProgressDisplay(metrics, "http://127.0.0.1:1/metrics", 3, ["orchestrator"], io.StringIO())
    assert display.update().policy_lag == 0
    final = display.update({"orchestrator": 0})  # gone after a clean finish
    assert final.policy_lag == 0 and final.loaded_version == 3
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100)
    console.print(display._renderable())
    shown = console.file.getvalue()
    assert re.search(r"policy lag +0 \(servers at v3\)", shown) and "not reachable" not in shown


def test_reward_summary_uses_fifth_averages():
    rows = [{"step": s, "reward_mean": s / 10, "exact_match_rate": s / 20} for s in range(1, 11)]
    rows.append({"step": 10, "reward_mean": 1.0, "exact_match_rate": 0.5})  # a repeated step: the last wins
    summary = get_reward_summary(rows + [{"step": 11, "reward_mean": None}])
    assert summary.steps == 10
    assert summary.first_fifth == pytest.approx(0.15) and summary.last_fifth == pytest.approx(0.95)
    assert summary.exact_last_fifth == pytest.approx((0.45 + 0.5) / 2)
    assert render_summary(summary) == (
        "steps: 10; mean reward first fifth 0.150 -> last fifth 0.950 (+0.800); exact match 8% -> 48%")
    assert get_reward_summary([{"step": 1}]) is None


def _processes_of_run(storage_dir: Path) -> list[int]:
    """Live processes whose environment has RLRUN_STORAGE_DIR=storage_dir (vLLM's engine core included)."""
    needle = f"{c.ENV_STORAGE_DIR}={storage_dir}".encode() + b"\0"
    found = []
    for pid, info in read_process_table().items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
        except OSError:
            continue
        if needle in environ and info.state != "Z":
            found.append(pid)
    return found


@pytest.mark.vllm
@pytest.mark.e2e
@pytest.mark.timeout(480)
def test_rlrun_local_tiny_run_end_to_end(tiny_rlrun, tmp_path):
    """The real thing, shortened to 2 steps: vLLM on CPU, router, orchestrator, torchrun trainer."""
    tiny_rlrun["spec"]["algorithm"]["maxSteps"] = 2
    path = _write(tmp_path, tiny_rlrun)
    out_dir = tmp_path / "out"
    started = time.monotonic()
    proc = subprocess.run(RLRUN + ["local", str(path), "--output-dir", str(out_dir)],
                          capture_output=True, text=True, timeout=450)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "step 2/2" in proc.stdout and "succeeded" in proc.stdout
    rows = parse_metrics_lines((out_dir / "metrics.jsonl").read_text())
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert (out_dir / "final" / "config.json").is_file() and (out_dir / "final" / "model.safetensors").is_file()
    assert (out_dir / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (out_dir / "logs").iterdir()) == sorted(
        f"tiny-reverse-{n}.log" for n in ("trainer-0", "inference-0", "router-0", "orchestrator"))
    assert (out_dir / "config" / "rlrun.yaml").is_file()
    assert _processes_of_run(out_dir) == []
    print(f"rlrun local, 2 steps: {elapsed:.0f} s")


@pytest.mark.timeout(60)
def test_roles_die_with_a_killed_supervisor(tmp_path):
    """Even a SIGKILLed `rlrun local` leaves no role behind (PR_SET_PDEATHSIG on every role)."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from rlrun_runtime.local.plan import ProcessSpec
        from rlrun_runtime.local.processes import Supervisor
        spec = ProcessSpec("s-0", "", "Deployment", (sys.executable, "-c", "import time; time.sleep(600)"),
                           dict(os.environ), Path({str(tmp_path / 's-0.log')!r}))
        supervisor = Supervisor([spec])
        supervisor.start()
        print(supervisor.pids["s-0"], flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _live([child]) == [child]
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _live([child]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live([child]) == []


def test_gpu_specs_are_refused_before_anything_starts_on_a_machine_without_them():
    from rlrun_runtime.local import LocalInputError, check_gpus

    spec = {"trainer": {"gpusPerNode": 8}, "inference": {"gpusPerReplica": 1}}
    with pytest.raises(LocalInputError, match=r"spec.trainer.gpusPerNode: 8, spec.inference.gpusPerReplica: 1 "
                                              r"GPU\(s\) per pod, but this machine shows 0; set"):
        check_gpus("run.yaml", spec, visible_gpus=0)
    check_gpus("run.yaml", spec, visible_gpus=8)
    check_gpus("run.yaml", {"trainer": {"gpusPerNode": 0}, "inference": {"gpusPerReplica": 0}}, visible_gpus=0)


def test_a_failed_role_is_reported_with_its_own_error_line(tmp_path):
    from rlrun_runtime.local import get_role_error

    log = tmp_path / "trainer.log"
    log.write_text("rlrun-runtime inference: /x/python -m vllm.entrypoints.openai.api_server --model m\n"
                   "rlrun-runtime trainer: spec.trainer.gpusPerNode: > 0 but no CUDA device is visible; set it to 0\n"
                   "Traceback (most recent call last):\n  torch.distributed.elastic...ChildFailedError\n")
    assert get_role_error(log) == ("rlrun-runtime trainer: spec.trainer.gpusPerNode: > 0 but no CUDA device is "
                                   "visible; set it to 0")
    log.write_text("rlrun-runtime inference: /x/python -m vllm.entrypoints.openai.api_server --model m\nboom\n")
    assert get_role_error(log) is None
    assert get_role_error(tmp_path / "missing.log") is None


def test_gpu_example_exits_2_naming_the_fields(tmp_path):
    proc = subprocess.run(RLRUN + ["local", str(ROOT / "examples" / "rlrun-minimal.yaml"), "--output-dir",
                                   str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "spec.trainer.gpusPerNode: 1" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
