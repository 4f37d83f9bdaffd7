"""A real Prometheus (Debian's /usr/bin/prometheus, on loopback) scraping the real operator and a real
`rlrun local` run, then every PromQL expression of the chart's Grafana dashboard and alert rules evaluated
through Prometheus's HTTP API: each must return data, with the labels its panel legend or alert annotation
names (a dashboard that queries a metric nobody exports fails here).

What runs:
- `rlrun local` of examples/rlrun-tiny.yaml (vLLM on CPU, router, orchestrator, trainer), stopped as soon
  as every expression has data and the operator has re-exported a completed step (about a minute after vLLM
  is up; the run never has to finish).
- the `rlrun-operator` console script against kmock (tests/support/kube.py), serving an RLRun of the same
  name and namespace, disaggregated 1:1 with autoscaling on. Its pods are played by the test: their podIPs
  are loopback addresses whose fixed pod ports (orchestrator metrics, vLLM http) forward to the local run's
  processes, so the operator scrapes the real orchestrator, and both its prefill and decode pods are the
  run's one real vLLM server (a disaggregated local run takes minutes more: test_pd_local.py).
- Prometheus with three jobs: the operator (honor_labels, as the chart's ServiceMonitor), and the chart's
  two PodMonitors translated into scrape configs (tests/unit/test_chart.get_scrape_config) whose static
  targets carry the Kubernetes discovery labels the run's pods would have, so the PodMonitors' own
  relabelings give the series their namespace, name and role.
Alert expressions are normally empty (a healthy run fires nothing): each is evaluated as written (it must
parse and run) and without its comparisons (the vector it compares must have data).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest
import yaml

from kube import serve_kubernetes
from local_runs import RLRUN, TINY, processes_of_run
from rlrun_api import constants
from rlrun_operator.kubeapi import KubeApi, get_api_client
from unit.test_chart import (MONITORING_ON, get_meta_label, get_monitoring, get_rule_groups, get_scrape_config,
                             render_chart)

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
NAMESPACE = "local"          # what `rlrun local` sets as the run's namespace
SCRAPE_INTERVAL = "1s"
# what the dashboard's $__rate_interval stands for here: wide enough that one timed weight update keeps the
# latency quantiles a number while the test waits (a 30 s window went NaN between two slow steps on CI)
RATE_INTERVAL = "5m"
DEADLINE_S = 360.0           # vLLM on 2 loaded cores may take minutes to start
GRAFANA_VARIABLES = {"$namespace": ".*", "$run": ".*", "$__rate_interval": RATE_INTERVAL}
COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*-?[0-9.]+(e[-+]?[0-9]+)?")

pytestmark = [pytest.mark.vllm, pytest.mark.router, pytest.mark.timeout(600)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def wait_until(check: Callable[[], Awaitable[Any]], what: str, deadline: float) -> Any:
    """Await ``check()`` about once a second until it returns a truthy value (returned); fail at ``deadline``
    (loop time) with the last falsy value."""
    loop = asyncio.get_running_loop()
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            pytest.fail(f"{what}: not within the deadline; last: {value!r}")
        await asyncio.sleep(1.0)


def get_run_ports(storage: Path) -> dict[str, int] | None:
    """{"orchestrator", "inference", "trainer": local port} of the run's processes (their environment:
    each pod's port env var), or None until every one is up."""
    ports: dict[str, set[int]] = {"orchestrator": set(), "inference": set(), "trainer": set()}
    for pid in processes_of_run(storage):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if constants.ENV_INFERENCE_ROLE in env and constants.ENV_INFERENCE_PORT in env:
            ports["inference"].add(int(env[constants.ENV_INFERENCE_PORT]))
        elif constants.ENV_TRAINER_METRICS_PORT in env and constants.ENV_NNODES in env:
            ports["trainer"].add(int(env[constants.ENV_TRAINER_METRICS_PORT]))
        elif constants.ENV_METRICS_PORT in env and constants.ENV_ROUTER_URL in env:
            ports["orchestrator"].add(int(env[constants.ENV_METRICS_PORT]))
    if not all(ports.values()):
        return None
    assert all(len(found) == 1 for found in ports.values()), ports
    return {role: found.pop() for role, found in ports.items()}


async def serve_forward(port: int, target_port: int) -> tuple[str, asyncio.Server]:
    """A TCP forwarder from a random 127.0.0.x:``port`` (a pod's fixed port at its podIP) to
    127.0.0.1:``target_port`` (the local run's process). Returns (ip, server)."""
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    for _ in range(50):
        ip = f"127.0.0.{random.randint(20, 250)}"
        try:
            return ip, await asyncio.start_server(handle, ip, port)
        except OSError:
            continue
    raise RuntimeError(f"no free 127.0.0.x address for port {port}")


def make_rlrun(name: str) -> dict[str, Any]:
    """The local run's RLRun as the operator sees it: disaggregated 1:1 over 2 replicas, autoscaling each
    second (tests/flow/test_autoscaler.py's settings)."""
    run = yaml.safe_load(TINY.read_text())
    run["metadata"] = {"name": name, "namespace": NAMESPACE}
    run["spec"]["inference"]["disaggregation"] = {"enabled": True, "ratio": "1:1", "replicas": 2}
    run["spec"]["autoscaling"] = {"enabled": True, "maxReplicas": 4, "prefill": {"min": 1, "max": 3},
                                  "decode": {"min": 1, "max": 3}, "scrapeIntervalSeconds": 1,
                                  "upCooldownSeconds": 0, "downCooldownSeconds": 600}
    return run


async def play_cluster(api: KubeApi, emu: Any, name: str, pod_ips: dict[str, str]) -> None:
    """Be the workload controllers and the kubelet: every workload reports its replicas ready, and one
    Running, Ready pod per component in ``pod_ips`` has that podIP."""
    for kind in ("Deployment", "StatefulSet", "Job"):
        for obj in emu.find(kind, NAMESPACE, f"{constants.LABEL_INSTANCE}={name}"):
            meta = obj["metadata"]
            n = obj["spec"].get("replicas", 1)
            status = ({"active": 1, "ready": 1} if kind == "Job" else
                      {"observedGeneration": meta["generation"], "replicas": n, "readyReplicas": n,
                       "updatedReplicas": n, "availableReplicas": n})
            await api.merge_patch(kind, NAMESPACE, meta["name"], {"status": status}, subresource="status")
    for component, ip in pod_ips.items():
        pod = f"{name}-{component}-0"
        await api.create({"apiVersion": "v1", "kind": "Pod",
                          "metadata": {"name": pod, "namespace": NAMESPACE,
                                       "labels": {constants.LABEL_INSTANCE: name, constants.LABEL_COMPONENT: component,
                                                  constants.LABEL_MANAGED_BY: constants.MANAGED_BY}},
                          "spec": {"containers": [{"name": "main", "image": "runtime"}]}})
        await api.merge_patch("Pod", NAMESPACE, pod, {"status": {
            "phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}},
            subresource="status")


def get_prometheus_config(docs: list[dict[str, Any]], name: str, operator_port: int,
                          ports: dict[str, int]) -> dict[str, Any]:
    """Prometheus's config: the operator, and the chart's PodMonitors with the local run's processes as
    static targets labelled like the run's pods (discovery labels: namespace, pod, pod labels, port name)."""
    def target(component: str, port: int, port_name: str, index: str | None = None) -> dict[str, Any]:
        labels = {"__meta_kubernetes_namespace": NAMESPACE, "__meta_kubernetes_pod_name": f"{name}-{component}-0",
                  "__meta_kubernetes_pod_container_port_name": port_name,
                  get_meta_label(constants.LABEL_INSTANCE): name, get_meta_label(constants.LABEL_COMPONENT): component,
                  get_meta_label(constants.LABEL_MANAGED_BY): constants.MANAGED_BY}
        if index is not None:
            labels[get_meta_label(constants.LABEL_POD_INDEX)] = index
        return {"targets": [f"127.0.0.1:{port}"], "labels": labels}

    monitors = {m["metadata"]["name"]: m for m in get_monitoring(docs, "PodMonitor")}
    targets = {"rlrun-vllm": [target(constants.COMPONENT_INFERENCE, ports["inference"], "http")],
               "rlrun-runs": [target(constants.COMPONENT_ORCHESTRATOR, ports["orchestrator"], "metrics"),
                              target(constants.COMPONENT_TRAINER, ports["trainer"], "metrics", index="0")]}
    jobs = [{"job_name": "rlrun-operator", "honor_labels": True, "scrape_interval": SCRAPE_INTERVAL,
             "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"]}]}]
    for monitor_name, monitor in sorted(monitors.items()):
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        job = get_scrape_config(monitor, {**endpoint, "interval": SCRAPE_INTERVAL}, targets[monitor_name])
        jobs.append(job)
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": jobs}


def get_expressions(docs: list[dict[str, Any]]) -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels each result must carry) for every query of the dashboard (Grafana variables
    substituted; labels: the ``{{label}}`` of the legend) and every alert rule (as written, and its inner
    vector without the comparisons; labels: the ``$labels.x`` of its annotations)."""
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "rlrun.json" in d.get("data", {})]
    dashboard = json.loads(config_map["data"]["rlrun.json"])

    def substitute(expr: str) -> str:
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        return expr

    out = []
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            out.append((f"panel {panel['title']!r}", substitute(t["expr"]),
                        set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(<selector>, <label>): the selector must have data
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
            out.append((f"variable {variable['name']}", substitute(selector), {label}))
    for group in get_rule_groups(docs):
        for rule in group["rules"]:
            labels = set(re.findall(r"\$labels\.(\w+)", " ".join(rule["annotations"].values())))
            out.append((f"alert {rule['alert']} (as written)", rule["expr"], set()))
            inner = COMPARISON.sub("", rule["expr"])
            assert inner != rule["expr"], rule["expr"]
            out.append((f"alert {rule['alert']} (inner vector)", inner, labels))
    return out


def check_result(where: str, expr: str, labels: set[str], result: list[dict[str, Any]], name: str,
                 must_have_data: bool) -> str | None:
    """Why a query's result is not what it must be, or None."""
    if not result:
        return f"{where}: no data for {expr}" if must_have_data else None
    for series in result:
        metric = series["metric"]
        missing = labels - set(metric)
        if missing:
            return f"{where}: series {metric} lacks {sorted(missing)} ({expr})"
        if "namespace" in labels and metric["namespace"] != NAMESPACE:
            return f"{where}: namespace {metric['namespace']!r}, not the run's"
        if "name" in labels and metric["name"] != name:
            return f"{where}: name {metric['name']!r}, not the run's"
        if "role" in labels and metric["role"] not in constants.POOL_COMPONENTS:
            return f"{where}: role {metric['role']!r} is no inference pool"
    return None


def test_prometheus_evaluates_every_dashboard_and_alert_expression(tmp_path: Path) -> None:
    assert Path(PROMETHEUS).is_file(), "prometheus missing: `make install` installs Debian's prometheus package"
    docs = render_chart(*MONITORING_ON)
    expressions = get_expressions(docs)
    name = yaml.safe_load(TINY.read_text())["metadata"]["name"]
    out_dir = tmp_path / "run"
    run_file = tmp_path / "rlrun.yaml"
    tiny = yaml.safe_load(TINY.read_text())
    tiny["spec"]["algorithm"]["maxSteps"] = 40  # more than the test waits for: it stops the run itself
    # held-out evaluation on, for the dashboard's evaluation panel: policy version 0 is evaluated at the start
    tiny["spec"]["evaluation"] = {"everySteps": 10, "prompts": 8}
    run_file.write_text(yaml.safe_dump(tiny, sort_keys=False))
    run_log = (tmp_path / "rlrun-local.log").open("w")
    local = subprocess.Popen(RLRUN + ["local", str(run_file), "--output-dir", str(out_dir)], stdout=run_log,
                             stderr=subprocess.STDOUT)
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[asyncio.Server] = []

    async def scenario() -> dict[str, list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        async with serve_kubernetes() as (emu, url), aiohttp.ClientSession() as http:
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "t",
                "clusters": [{"name": "t", "cluster": {"server": url}}], "users": [{"name": "t", "user": {}}],
                "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
            operator_port, health_port = free_port(), free_port()
            operator = subprocess.Popen(
                [str(Path(sys.executable).parent / "rlrun-operator"), "--all-namespaces", "--status-interval", "0.5",
                 "--metrics-port", str(operator_port), "--health-port", str(health_port),
                 "--metrics-host", "127.0.0.1", "--log-level", "warning"],
                env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=(tmp_path / "operator.log").open("w"),
                stderr=subprocess.STDOUT)
            procs.append(operator)

            async def get(url: str, **params: str) -> tuple[int, Any]:
                try:
                    async with http.get(url, params=params, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        body = await resp.text()
                        return resp.status, (json.loads(body) if "json" in resp.content_type else body)
                except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError):
                    return 0, None

            async def operator_up() -> bool:
                assert operator.poll() is None, (tmp_path / "operator.log").read_text()
                return (await get(f"http://127.0.0.1:{health_port}/healthz"))[0] == 200

            await wait_until(operator_up, "operator liveness", deadline)
            api = KubeApi(get_api_client(url))
            await api.create(make_rlrun(name))

            async def children_created() -> bool:
                return bool(emu.find("Job", NAMESPACE))

            await wait_until(children_created, "children created", deadline)

            async def run_ports() -> dict[str, int] | None:
                assert local.poll() is None, (tmp_path / "rlrun-local.log").read_text()[-4000:]
                return get_run_ports(out_dir)

            ports = await wait_until(run_ports, "the local run's processes", deadline)
            pod_ips = {}
            for component, pod_port, target in (
                    (constants.COMPONENT_ORCHESTRATOR, constants.ORCHESTRATOR_METRICS_PORT, ports["orchestrator"]),
                    (constants.COMPONENT_PREFILL, constants.INFERENCE_PORT, ports["inference"]),
                    (constants.COMPONENT_DECODE, constants.INFERENCE_PORT, ports["inference"])):
                ip, server = await serve_forward(pod_port, target)
                servers.append(server)
                pod_ips[component] = ip
            await play_cluster(api, emu, name, pod_ips)

            prom_port = free_port()
            config = tmp_path / "prometheus.yml"
            config.write_text(yaml.safe_dump(get_prometheus_config(docs, name, operator_port, ports)))
            check = subprocess.run(["promtool", "check", "config", "--syntax-only", str(config)],
                                   capture_output=True, text=True, timeout=60)
            assert check.returncode == 0, check.stdout + check.stderr
            prometheus = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}", "--storage.tsdb.retention.time=1h",
                 "--log.level=warn"], stdout=(tmp_path / "prometheus.log").open("w"), stderr=subprocess.STDOUT)
            procs.append(prometheus)
            base = f"http://127.0.0.1:{prom_port}"

            async def prometheus_ready() -> bool:
                assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()
                return (await get(f"{base}/-/ready"))[0] == 200

            await wait_until(prometheus_ready, "prometheus ready", deadline)

            async def query(expr: str) -> list[dict[str, Any]] | None:
                status, body = await get(f"{base}/api/v1/query", query=expr)
                assert status in (200, 0), f"{expr}: HTTP {status}: {body}"
                return body["data"]["result"] if status == 200 else None

            async def everything_has_data() -> dict[str, list[dict[str, Any]]] | None:
                """None while anything is missing (the reasons kept in ``last``), else {where: result}."""
                assert local.poll() is None, (tmp_path / "rlrun-local.log").read_text()[-4000:]
                problems, seen = [], {}
                for where, expr, labels in expressions:
                    result = await query(expr)
                    if result is None:
                        problems.append(f"{where}: no answer")
                        continue
                    problem = check_result(where, expr, labels, result, name,
                                           must_have_data="as written" not in where)
                    if problem:
                        problems.append(problem)
                    seen[f"{where}: {expr}"] = result
                # real progress flowed through the operator: a completed step, its weight update timed
                run = f'namespace="{NAMESPACE}", name="{name}"'
                step = await query(f"{constants.OPERATOR_METRIC_RUN_STEP}{{{run}}} >= 1")
                if not step:
                    problems.append("the operator has not re-exported a completed step yet")
                # a weight update was timed inside the window: the latency quantiles are numbers, not NaN
                latency = [float(series["value"][1]) for where, result in seen.items()
                           if "Weight-update latency" in where for series in result]
                if not latency or any(math.isnan(v) for v in latency):
                    problems.append(f"the weight-update latency quantiles are not numbers yet: {latency}")
                last[:] = problems
                return None if problems else seen

            last: list[str] = []
            try:
                return await wait_until(everything_has_data, "every expression with data", deadline)
            except BaseException:
                print("\n".join(last))
                raise
            finally:
                for proc in procs:
                    proc.terminate()
                for server in servers:
                    server.close()
                await api.close()

    try:
        seen = asyncio.run(scenario())
        for where, result in seen.items():
            print(where, [(series["metric"], series["value"][1]) for series in result])
        # the weight-update latency quantiles are numbers (an update was timed), not NaN
        latency = [float(series["value"][1]) for where, result in seen.items() if "Weight-update latency" in where
                   for series in result]
        assert latency and not any(math.isnan(v) for v in latency), latency
        # the evaluation panel shows one of the real run's evaluations (eval.jsonl; the first is of version 0
        # unless a weight update overlapped it, then of the version loaded after it)
        evals = [json.loads(line) for line in (out_dir / constants.EVAL_FILE_NAME).read_text().splitlines()]
        assert evals and all(e["prompts"] == 8 for e in evals)
        panel = [float(series["value"][1]) for where, result in seen.items() if "Held-out evaluation" in where
                 for series in result]
        assert panel and any(e["consistent"] and abs(e["reward_mean"] - panel[0]) < 1e-9 for e in evals), (panel, evals)
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if local.poll() is None:
            local.send_signal(signal.SIGTERM)
            try:
                local.wait(timeout=60)
            except subprocess.TimeoutExpired:
                local.kill()
        run_log.close()
    assert processes_of_run(out_dir) == {}, "the local run left processes behind"
