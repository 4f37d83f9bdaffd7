"""Rendered manifests -> the local processes of ``rlrun local`` (pure).

``get_local_plan`` reads the manifests the operator would apply (``rlrun_operator.render.render``) and
returns one :class:`ProcessSpec` per pod: the container's ``command`` + ``args`` and its env, resolved the
way a kubelet would (``$(VAR)`` expansion, downward API, ConfigMap references), then moved onto this
machine:

- pods: ``replicas`` pods per Deployment (``<deployment>-<i>``), ``replicas`` pods per StatefulSet
  (``<statefulset>-<ordinal>``), one pod per Job (``<job>``);
- downward API: ``status.podIP`` / ``status.hostIP`` -> 127.0.0.1, ``metadata.namespace`` -> the
  manifests' namespace ("local"), ``metadata.name`` -> the pod name, ``metadata.labels['k']`` -> the pod
  template's label, with ``apps.kubernetes.io/pod-index`` -> the pod's ordinal (set by the StatefulSet
  and Job controllers);
- volumes: a ConfigMap volume -> ``DIR/config/`` (one file per key, written by the caller from
  ``LocalPlan.files``), a PersistentVolumeClaim -> ``DIR`` itself, an emptyDir -> ``DIR/tmp/<pod>/<volume>``
  except ``/dev/shm``, which exists here; every mount path that appears in an env value or an argument is
  replaced by its local directory;
- ports: every container port of every pod, and every port a role listens on through its env
  (``PORT_ENV_VARS``), gets its own free loopback port from the caller's allocator, so two inference
  replicas never collide (each gets its own ``RLRUN_INFERENCE_PORT`` and NIXL side-channel port);
- host names: a reference ``<host>:<port>`` (optionally with a scheme and path) in an env value or an
  argument becomes ``127.0.0.1:<local port>``. ``<host>`` may be a Service (a headless one, or a name
  with no Service object but a workload of that name, expands to every pod's endpoint, comma-separated;
  a ClusterIP Service without kube-proxy here goes to its first pod), a StatefulSet pod's DNS name
  ``<pod>.<service>``, each optionally qualified with ``.<namespace>[.svc[.cluster.local]]``. A value that
  is exactly a host name becomes 127.0.0.1; ``MASTER_PORT`` is the master pod's local port;
- the router switches from Kubernetes discovery to ``static`` with ``RLRUN_WORKER_URLS`` or
  ``RLRUN_PREFILL_URLS`` + ``RLRUN_DECODE_URLS`` (comma-separated ``http://127.0.0.1:<port>``); the trainer
  gets ``RLRUN_TRAINER_METRICS_PORT``;
- every server listens on 127.0.0.1 only (``RLRUN_BIND_HOST``);
- envFrom/valueFrom Secrets cannot be read without a cluster: they are skipped with a warning.

The process env is ``base_env`` (the caller's environment) overlaid with the container's variables, so
PATH and HOME come from the machine while every variable the pod defines wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from rlrun_api import constants as c

from .kube_expansion import expand

LOCAL_HOST = "127.0.0.1"
DEFAULT_NAMESPACE = "local"
SHM_PATH = "/dev/shm"

# Env vars holding a port the container itself listens on: each pod gets its own local port for it.
PORT_ENV_VARS = (
    c.ENV_INFERENCE_PORT,
    c.ENV_ROUTER_PORT,
    c.ENV_ROUTER_METRICS_PORT,
    c.ENV_METRICS_PORT,
    c.ENV_NIXL_SIDE_CHANNEL_PORT,
    c.ENV_TRAINER_METRICS_PORT,
)
# Env vars holding a port of a peer named by another env var (port var -> host var).
PEER_PORT_ENV_VARS = {c.ENV_MASTER_PORT: c.ENV_MASTER_ADDR}

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")

# host[:port] references: optional scheme, a DNS name, a port, an optional path up to a comma or space.
_ENDPOINT_RE = re.compile(
    r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)?"
    r"(?P<host>\b[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?)"
    r":(?P<port>\d{1,5})\b"
    r"(?P<rest>/[^,\s]*)?"
)

PortAllocator = Callable[[], int]


class PlanError(ValueError):
    """The manifests cannot run locally (e.g. a pod without a command); the message says what and why."""


@dataclass(frozen=True)
class ProcessSpec:
    """One pod of the rendered run, as a local process.

    Attributes:
        name: the pod name (``<deployment>-<i>``, ``<statefulset>-<ordinal>`` or ``<job>``).
        component: the pod's ``app.kubernetes.io/component`` label (trainer, inference, prefill, decode,
            router, orchestrator; "" when absent).
        workload_kind: Deployment, StatefulSet or Job (decides what an exit means, see local.processes).
        argv: the container's command + args after expansion and local rewriting.
        env: the complete process environment.
        log_path: where stdout and stderr go.
        ports: container port -> local loopback port.
    """

    name: str
    component: str
    workload_kind: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    log_path: Path
    ports: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalPlan:
    """What ``rlrun local`` starts: processes in manifest order, files to write first, warnings to print."""

    processes: tuple[ProcessSpec, ...]
    files: Mapping[Path, str]
    warnings: tuple[str, ...]

    def by_component(self, component: str) -> list[ProcessSpec]:
        """The processes whose component label is ``component``, in order."""
        return [p for p in self.processes if p.component == component]


@dataclass
class _Pod:
    name: str
    ordinal: int
    workload: dict[str, Any]
    labels: dict[str, str]
    container: dict[str, Any]
    volumes: list[dict[str, Any]]
    hostname: str | None = None  # <pod>.<service> for StatefulSet pods
    ports: dict[int, int] = field(default_factory=dict)
    named_ports: dict[str, int] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.workload["kind"]

    @property
    def workload_name(self) -> str:
        return self.workload["metadata"]["name"]

    @property
    def component(self) -> str:
        return self.labels.get(c.LABEL_COMPONENT, "")


@dataclass(frozen=True)
class _Target:
    """Where a host name points: pods, and how a referenced port maps onto their container ports."""

    pods: tuple[_Pod, ...]
    service: dict[str, Any] | None = None  # None: container ports are addressed directly

    def container_port(self, pod: _Pod, port: int) -> int | None:
        if self.service is None:
            return port
        for entry in self.service.get("spec", {}).get("ports", []):
            if int(entry.get("port", -1)) == port:
                target = entry.get("targetPort", port)
                if isinstance(target, str) and not target.isdigit():
                    return pod.named_ports.get(target)
                return int(target)
        return None


def _pods_of(workload: dict[str, Any]) -> list[_Pod]:
    kind = workload["kind"]
    name = workload["metadata"]["name"]
    spec = workload.get("spec", {})
    template = spec.get("template", {})
    pod_spec = template.get("spec", {})
    labels = dict(template.get("metadata", {}).get("labels", {}) or {})
    containers = pod_spec.get("containers") or []
    if len(containers) != 1:
        raise PlanError(f"{kind} {name}: pods with {len(containers)} containers cannot run locally (one expected)")
    declared = spec.get("parallelism" if kind == "Job" else "replicas")
    count = 1 if declared is None else int(declared)  # the API server's default for both is 1
    pods = []
    for i in range(count):
        pod_name = name if kind == "Job" and count == 1 else f"{name}-{i}"
        pod = _Pod(pod_name, i, workload, dict(labels), containers[0], list(pod_spec.get("volumes") or []))
        if kind == "StatefulSet":
            pod.hostname = f"{pod_name}.{spec.get('serviceName') or name}"
        pods.append(pod)
    return pods


def _port_number(value: Any) -> int | None:
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def _listening_ports(pod: _Pod) -> list[int]:
    """Container ports plus the numeric values of the port env vars, sorted.

    ``MASTER_PORT`` counts on every trainer pod; only the master's (pod 0's) local port is then used.
    """
    ports = {int(p["containerPort"]) for p in pod.container.get("ports") or [] if "containerPort" in p}
    for entry in pod.container.get("env") or []:
        if (entry.get("name") in PORT_ENV_VARS or entry.get("name") in PEER_PORT_ENV_VARS) and "value" in entry:
            number = _port_number(entry["value"])
            if number is not None:
                ports.add(number)
    if pod.component == c.COMPONENT_TRAINER:
        ports.add(c.TRAINER_METRICS_PORT)
    return sorted(ports)


def _strip_domain(host: str, namespace: str) -> str:
    for suffix in (".svc.cluster.local", ".svc"):
        if host.endswith(suffix):
            host = host[: -len(suffix)]
            break
    if host.endswith(f".{namespace}"):
        host = host[: -len(namespace) - 1]
    return host


class _Network:
    """Host names of the rendered run -> local pods and ports."""

    def __init__(self, pods: list[_Pod], services: list[dict[str, Any]], namespace: str):
        self.namespace = namespace
        self.targets: dict[str, _Target] = {}
        for pod in pods:
            if pod.hostname:
                self.targets[pod.hostname] = _Target((pod,))
        by_workload: dict[str, list[_Pod]] = {}
        for pod in pods:
            by_workload.setdefault(pod.workload_name, []).append(pod)
        for name, members in by_workload.items():
            self.targets.setdefault(name, _Target(tuple(members)))
        for svc in services:
            name = svc["metadata"]["name"]
            spec = svc.get("spec", {})
            selector = spec.get("selector") or {}
            members = [p for p in pods if selector and all(p.labels.get(k) == v for k, v in selector.items())]
            if not members:
                continue
            if spec.get("clusterIP") != "None":
                members = members[:1]  # no kube-proxy here: a ClusterIP Service goes to its first pod
            self.targets[name] = _Target(tuple(members), svc)

    def resolve(self, host: str) -> _Target | None:
        return self.targets.get(_strip_domain(host, self.namespace))

    def endpoints(self, host: str, port: int) -> list[int] | None:
        """Local ports behind ``host:port``, or None when the host is not part of the run."""
        target = self.resolve(host)
        if target is None:
            return None
        out = []
        for pod in target.pods:
            container_port = target.container_port(pod, port)
            if container_port is None or container_port not in pod.ports:
                return None
            out.append(pod.ports[container_port])
        return out

    def rewrite_endpoints(self, text: str) -> str:
        """Replace every ``[scheme://]host:port[/path]`` of the run with its local endpoint(s)."""

        def sub(match: re.Match[str]) -> str:
            local = self.endpoints(match.group("host"), int(match.group("port")))
            if local is None:
                return match.group(0)
            scheme, rest = match.group("scheme") or "", match.group("rest") or ""
            return ",".join(f"{scheme}{LOCAL_HOST}:{port}{rest}" for port in local)

        return _ENDPOINT_RE.sub(sub, text)

    def rewrite_host(self, text: str) -> str:
        """A value that is exactly a host name of the run becomes 127.0.0.1."""
        return LOCAL_HOST if self.resolve(text.strip()) is not None else text


@dataclass(frozen=True)
class LocalPaths:
    """Where the pieces of a local run live. ``output_dir`` plays the PVC; the rest is inside it."""

    output_dir: Path

    @property
    def config_dir(self) -> Path:
        """The ConfigMap's files (``rlrun.yaml``)."""
        return self.output_dir / "config"

    @property
    def logs_dir(self) -> Path:
        """One ``<pod>.log`` per process."""
        return self.output_dir / "logs"

    def scratch_dir(self, pod: str, volume: str) -> Path:
        """An emptyDir volume of one pod."""
        return self.output_dir / "tmp" / pod / volume


def _mounts(pod: _Pod, paths: LocalPaths, config_maps: Mapping[str, dict[str, Any]],
            warnings: list[tuple[str, str]]) -> list[tuple[str, Path]]:
    """(mountPath, local path) of the container's volume mounts, longest mount path first."""
    volumes = {v["name"]: v for v in pod.volumes}
    out = []
    for mount in pod.container.get("volumeMounts") or []:
        volume = volumes.get(mount.get("name"), {})
        mount_path = mount["mountPath"].rstrip("/") or "/"
        if "configMap" in volume:
            if volume["configMap"].get("name") not in config_maps:
                warnings.append((pod.name, f"ConfigMap {volume['configMap'].get('name')} is not among the "
                                "manifests; its mount stays empty"))
            local = paths.config_dir
        elif "persistentVolumeClaim" in volume:
            local = paths.output_dir
        elif "emptyDir" in volume:
            if mount_path == SHM_PATH:
                continue
            local = paths.scratch_dir(pod.name, volume["name"])
        else:
            warnings.append((pod.name, f"volume {mount.get('name')} ({', '.join(sorted(volume)) or 'undefined'}) "
                            f"has no local equivalent; {mount_path} is not mapped"))
            continue
        if mount.get("subPath"):
            local = local / mount["subPath"]
        out.append((mount_path, local))
    return sorted(out, key=lambda item: -len(item[0]))


def _rewrite_paths(text: str, mounts: list[tuple[str, Path]]) -> str:
    for mount_path, local in mounts:
        pattern = re.compile(r"(?<![\w./-])" + re.escape(mount_path) + r"(?=/|$|[\s,:;=\"'])")
        text = pattern.sub(lambda _m, local=local: str(local), text)
    return text


def _field_value(pod: _Pod, field_path: str, namespace: str) -> str | None:
    if field_path in ("status.podIP", "status.hostIP"):
        return LOCAL_HOST
    if field_path == "metadata.namespace":
        return namespace
    if field_path == "metadata.name":
        return pod.name
    if field_path == "spec.nodeName":
        return "localhost"
    if field_path == "spec.serviceAccountName":
        return pod.workload.get("spec", {}).get("template", {}).get("spec", {}).get("serviceAccountName", "default")
    match = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field_path)
    if match:
        key = match.group(1)
        if key == c.LABEL_POD_INDEX:
            return str(pod.ordinal)
        return pod.labels.get(key, "")
    return None


def _container_env(pod: _Pod, network: _Network, mounts: list[tuple[str, Path]],
                   config_maps: Mapping[str, dict[str, Any]], pods: list[_Pod],
                   namespace: str, warnings: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in pod.container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            name = source["configMapRef"].get("name")
            if name in config_maps:
                for key, value in (config_maps[name].get("data") or {}).items():
                    env[prefix + key] = str(value)
                continue
            warnings.append((pod.name, f"envFrom ConfigMap {name} is not among the manifests; skipped"))
        elif "secretRef" in source:
            warnings.append((pod.name, f"envFrom Secret {source['secretRef'].get('name')} cannot be read "
                            "without a cluster; skipped (export its variables in your shell instead)"))
    raw = {e.get("name"): e.get("value") for e in pod.container.get("env") or []}
    master = network.resolve(str(raw.get(c.ENV_MASTER_ADDR) or ""))
    for entry in pod.container.get("env") or []:
        name = entry["name"]
        if "valueFrom" in entry:
            value_from = entry["valueFrom"]
            if "fieldRef" in value_from:
                value = _field_value(pod, value_from["fieldRef"].get("fieldPath", ""), namespace)
                if value is None:
                    warnings.append((pod.name, f"env {name}: fieldRef "
                                    f"{value_from['fieldRef'].get('fieldPath')} has no local value; skipped"))
                    continue
            elif "configMapKeyRef" in value_from:
                ref = value_from["configMapKeyRef"]
                data = (config_maps.get(ref.get("name")) or {}).get("data") or {}
                if ref.get("key") not in data:
                    warnings.append((pod.name, f"env {name}: ConfigMap key {ref.get('name')}/{ref.get('key')} "
                                    "is not among the manifests; skipped"))
                    continue
                value = str(data[ref["key"]])
            else:
                kind = next(iter(value_from), "valueFrom")
                warnings.append((pod.name, f"env {name} comes from {kind}, which cannot be read without a "
                                "cluster; skipped (export it in your shell instead)"))
                continue
        else:
            value = expand(str(entry.get("value", "")), env)
        number = _port_number(value)
        if name in PORT_ENV_VARS and number is not None:
            value = str(pod.ports[number])
        elif name in PEER_PORT_ENV_VARS and number is not None:
            peer = master.pods[0] if master is not None else next(
                p for p in pods if p.workload_name == pod.workload_name and p.ordinal == 0)
            value = str(peer.ports.get(number, number))
        else:
            value = network.rewrite_host(network.rewrite_endpoints(value))
        env[name] = _rewrite_paths(value, mounts)
    return env


def _inference_url(pod: _Pod, env: Mapping[str, str]) -> str:
    return f"http://{LOCAL_HOST}:{env.get(c.ENV_INFERENCE_PORT) or pod.ports.get(c.INFERENCE_PORT)}"


def get_local_plan(
    manifests: Iterable[Mapping[str, Any]],
    allocate_port: PortAllocator,
    paths: LocalPaths,
    base_env: Mapping[str, str] | None = None,
) -> LocalPlan:
    """Translate rendered manifests into local processes (see the module docstring for every rule).

    Args:
        manifests: the output of ``rlrun_operator.render.render`` (any order; other kinds are ignored).
        allocate_port: returns a free loopback TCP port on each call (never the same one twice).
        paths: the output directory layout.
        base_env: environment every process starts from (PATH, HOME, thread settings); pod variables win.

    Returns:
        LocalPlan: processes in workload order (StatefulSets, Deployments, Jobs as they appear), the
        ConfigMap files to write (local path -> text) and warnings about what could not be mapped.

    Raises:
        PlanError: no workload, a pod with more than one container or without a command.
    """
    manifests = [dict(m) for m in manifests if m]
    namespace = next((m.get("metadata", {}).get("namespace") for m in manifests
                      if m.get("metadata", {}).get("namespace")), DEFAULT_NAMESPACE)
    config_maps = {m["metadata"]["name"]: m for m in manifests if m.get("kind") == "ConfigMap"}
    services = [m for m in manifests if m.get("kind") == "Service"]
    workloads = [m for m in manifests if m.get("kind") in WORKLOAD_KINDS]
    if not workloads:
        raise PlanError("the manifests hold no Deployment, StatefulSet or Job: nothing to run")
    warnings: list[tuple[str, str]] = []  # (pod, message)
    pods = [pod for workload in workloads for pod in _pods_of(workload)]
    for pod in pods:
        for entry in pod.container.get("ports") or []:
            if entry.get("name") and "containerPort" in entry:
                pod.named_ports[entry["name"]] = int(entry["containerPort"])
        for number in _listening_ports(pod):
            pod.ports[number] = int(allocate_port())
    network = _Network(pods, services, namespace)

    files: dict[Path, str] = {}
    for cm in config_maps.values():
        for key, text in (cm.get("data") or {}).items():
            path = paths.config_dir / key
            if path in files and files[path] != text:
                raise PlanError(f"ConfigMaps define {key} twice with different contents; cannot map both to {path}")
            files[path] = str(text)

    inference_urls: dict[str, list[str]] = {}
    resolved: list[tuple[_Pod, dict[str, str], list[tuple[str, Path]]]] = []
    for pod in pods:
        mounts = _mounts(pod, paths, config_maps, warnings)
        env = _container_env(pod, network, mounts, config_maps, pods, namespace, warnings)
        if pod.component in c.POOL_COMPONENTS:
            inference_urls.setdefault(pod.component, []).append(_inference_url(pod, env))
        resolved.append((pod, env, mounts))

    processes = []
    for pod, env, mounts in resolved:
        env[c.ENV_BIND_HOST] = LOCAL_HOST
        if pod.component == c.COMPONENT_TRAINER:
            env[c.ENV_TRAINER_METRICS_PORT] = str(pod.ports[c.TRAINER_METRICS_PORT])
        if pod.component == c.COMPONENT_ROUTER:
            env[c.ENV_ROUTER_DISCOVERY] = c.ROUTER_DISCOVERY_STATIC
            if c.COMPONENT_PREFILL in inference_urls or c.COMPONENT_DECODE in inference_urls:
                env[c.ENV_PREFILL_URLS] = ",".join(inference_urls.get(c.COMPONENT_PREFILL, []))
                env[c.ENV_DECODE_URLS] = ",".join(inference_urls.get(c.COMPONENT_DECODE, []))
            else:
                env[c.ENV_WORKER_URLS] = ",".join(inference_urls.get(c.COMPONENT_INFERENCE, []))
        command = list(pod.container.get("command") or []) + list(pod.container.get("args") or [])
        if not command:
            raise PlanError(f"{pod.kind} {pod.workload_name}: the container has no command; rlrun local runs the "
                            "rendered command and cannot guess the image's entrypoint")
        argv = []
        for token in command:
            token = expand(str(token), env)
            token = network.rewrite_endpoints(token)
            argv.append(_rewrite_paths(token, mounts))
        full_env = dict(base_env or {})
        full_env.update(env)
        processes.append(ProcessSpec(
            name=pod.name,
            component=pod.component,
            workload_kind=pod.kind,
            argv=tuple(argv),
            env=full_env,
            log_path=paths.logs_dir / f"{pod.name}.log",
            ports=dict(pod.ports),
        ))
    return LocalPlan(tuple(processes), files, _group_warnings(warnings))


def _group_warnings(warnings: list[tuple[str, str]]) -> tuple[str, ...]:
    """One line per distinct message, naming the pods it concerns."""
    pods_by_message: dict[str, list[str]] = {}
    for pod, message in warnings:
        pods_by_message.setdefault(message, [])
        if pod not in pods_by_message[message]:
            pods_by_message[message].append(pod)
    return tuple(f"{', '.join(pods)}: {message}" for message, pods in pods_by_message.items())
