"""Autoscaling in ``rlrun local``, the pure part: the operator's policy (``rlrun_operator.autoscale.decide``)
applied by starting and stopping local servers. The I/O is :mod:`rlrun_runtime.local.scaler`.

- :func:`get_local_policy`: the run's ``AutoscalingView`` with ``maxReplicas`` and each pool's max capped to
  ``constants.LOCAL_MAX_INFERENCE_SERVERS`` (one machine).
- :func:`widen_pools` + :func:`split_plan`: the plan gets a process (own ports, env) for every server a pool
  may grow to; only the initial ones start, and the router, the orchestrator and the servers file name those.
- :func:`get_observations`: the servers' and the orchestrator's ``/metrics`` texts -> ``Observations``.
- :func:`plan_local_scale`: a Decision -> which servers to start and which to stop.
- :func:`get_router_spec`: the router process for a new set of servers (vllm-router 0.1.17 refuses
  ``/add_worker`` in P/D mode, "PD router requires specific add_prefill_server or add_decode_server
  methods", so a joining server gets a new router, see the scaler; ``/remove_worker`` works and is used to
  take a server out before it stops).

A server's phases: ``starting`` (process started; not healthy yet, or the current weights not loaded),
``joining`` (serves the current weights and is in the servers file, so the orchestrator keeps it current;
not yet routed to), ``serving`` (in the router), ``draining`` (out of the router and the servers file,
SIGTERM sent: vLLM finishes what it has in flight, ``constants.INFERENCE_DRAIN_SECONDS`` at most).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlrun_api import constants as c
from rlrun_api.views import AutoscalingView, PoolBounds
from rlrun_operator import autoscale

from .membership import ServerSet, get_server_set
from .plan import LOCAL_HOST, LocalPlan, ProcessSpec

POOLS = autoscale.POOLS
STARTING, JOINING, SERVING, DRAINING = "starting", "joining", "serving", "draining"
ACTIVE_PHASES = (STARTING, JOINING, SERVING)  # counted as the pool's desired replicas


class LocalScalingError(ValueError):
    """The autoscaling spec cannot run on one machine; the message names the field and the fix."""


def get_local_policy(view: AutoscalingView, local_max: int = c.LOCAL_MAX_INFERENCE_SERVERS) -> AutoscalingView:
    """``view`` with the budget capped to ``local_max`` servers (pure): maxReplicas = min(maxReplicas,
    local_max); each pool's max = min(its max, budget - the other pool's floor), its min unchanged.

    Raises:
        LocalScalingError: the pools' minimums (at least 1 each) do not fit in ``local_max``.
    """
    budget = min(view.max_replicas, local_max)
    floors = {p: max(1, view.bounds(p).min) for p in POOLS}
    if sum(floors.values()) > budget:
        raise LocalScalingError(
            f"spec.autoscaling: prefill.min + decode.min = {sum(floors.values())} servers, but rlrun local runs at "
            f"most {budget} (min of maxReplicas and the local maximum {local_max}); lower the minimums")
    bounds = {}
    for pool in POOLS:
        other = autoscale.DECODE if pool == autoscale.PREFILL else autoscale.PREFILL
        bounds[pool] = PoolBounds(view.bounds(pool).min, min(view.bounds(pool).max, budget - floors[other]))
    return dataclasses.replace(view, max_replicas=budget, prefill=bounds[autoscale.PREFILL],
                               decode=bounds[autoscale.DECODE])


def widen_pools(manifests: Iterable[Mapping[str, Any]], policy: AutoscalingView
                ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The manifests with each pool's Deployment at ``policy.bounds(pool).max`` replicas (pure), so that the
    local plan holds a process for every server the pool may grow to; and the rendered (initial) replicas.

    Raises:
        LocalScalingError: a pool has no Deployment, or starts with more servers than its local max.
    """
    out, initial = [], {}
    for manifest in manifests:
        manifest = dict(manifest)
        labels = (((manifest.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
        pool = labels.get(c.LABEL_COMPONENT)
        if manifest.get("kind") == "Deployment" and pool in POOLS:
            initial[pool] = int(manifest["spec"].get("replicas", 1))
            most = policy.bounds(pool).max
            if initial[pool] > most:
                raise LocalScalingError(
                    f"spec.inference.disaggregation starts {initial[pool]} {pool} servers, above the {most} that "
                    f"rlrun local may run with autoscaling (local maximum {policy.max_replicas}); lower "
                    "disaggregation.replicas")
            manifest["spec"] = {**manifest["spec"], "replicas": most}
        out.append(manifest)
    missing = [p for p in POOLS if p not in initial]
    if missing:
        raise LocalScalingError(f"spec.autoscaling.enabled needs prefill and decode pools; no {', '.join(missing)} "
                                "Deployment was rendered (set spec.inference.disaggregation.enabled: true)")
    return out, initial


def ordinal_of(spec: ProcessSpec) -> int:
    """The pod ordinal at the end of a Deployment process's name (``<deployment>-<i>``)."""
    match = re.search(r"-(\d+)$", spec.name)
    if match is None:
        raise ValueError(f"{spec.name} has no pod ordinal")
    return int(match.group(1))


def server_url(spec: ProcessSpec) -> str:
    """``http://127.0.0.1:<RLRUN_INFERENCE_PORT>`` of an inference process."""
    return f"http://{LOCAL_HOST}:{spec.env[c.ENV_INFERENCE_PORT]}"


def router_url(spec: ProcessSpec) -> str:
    return f"http://{LOCAL_HOST}:{spec.env[c.ENV_ROUTER_PORT]}"


@dataclass(frozen=True)
class ScalablePlan:
    """A plan whose pools can grow and shrink.

    Attributes:
        plan: what starts now: the initial servers of each pool, the router and every other role.
        pools: pool -> a process for each server the pool may run, by ordinal (the initial ones first).
        initial: pool -> how many start now.
        router: the router's process (None: no router).
        servers_file: the file the orchestrator re-reads (``ENV_LOCAL_SERVERS_FILE``).
    """

    plan: LocalPlan
    pools: Mapping[str, tuple[ProcessSpec, ...]]
    initial: Mapping[str, int]
    router: ProcessSpec | None
    servers_file: Path

    def initial_servers(self) -> ServerSet:
        urls = {p: [server_url(s) for s in self.pools[p][: self.initial[p]]] for p in POOLS}
        return get_server_set(urls[autoscale.PREFILL], urls[autoscale.DECODE],
                              router_url(self.router) if self.router else None)


def split_plan(plan: LocalPlan, initial: Mapping[str, int], servers_file: Path) -> ScalablePlan:
    """Split a plan made from :func:`widen_pools`'s manifests (pure): pool processes beyond ``initial`` are held
    back; the router's ``RLRUN_PREFILL_URLS``/``RLRUN_DECODE_URLS`` and the orchestrator's
    ``RLRUN_INFERENCE_ENDPOINTS``/``RLRUN_PREFILL_ENDPOINTS`` name the initial servers only, and the
    orchestrator gets ``RLRUN_LOCAL_SERVERS_FILE``, whose first content is in ``plan.files``."""
    pools = {p: tuple(sorted(plan.by_component(p), key=ordinal_of)) for p in POOLS}
    held = {s.name for p in POOLS for s in pools[p][initial[p]:]}
    routers = plan.by_component(c.COMPONENT_ROUTER)
    router = routers[0] if routers else None
    provisional = ScalablePlan(plan, pools, dict(initial), router, servers_file)
    servers = provisional.initial_servers()
    processes = []
    for spec in plan.processes:
        if spec.name in held:
            continue
        env = dict(spec.env)
        if spec.component == c.COMPONENT_ROUTER:
            env[c.ENV_PREFILL_URLS] = ",".join(f"http://{e}" for e in servers.prefill)
            env[c.ENV_DECODE_URLS] = ",".join(f"http://{e}" for e in servers.inference if e not in servers.prefill)
        elif spec.component == c.COMPONENT_ORCHESTRATOR:
            env[c.ENV_INFERENCE_ENDPOINTS] = ",".join(servers.inference)
            env[c.ENV_PREFILL_ENDPOINTS] = ",".join(servers.prefill)
            env[c.ENV_LOCAL_SERVERS_FILE] = str(servers_file)
        spec = dataclasses.replace(spec, env=env)
        if spec.component == c.COMPONENT_ROUTER:
            router = spec
        processes.append(spec)
    files = {**plan.files, servers_file: servers.as_json()}
    return ScalablePlan(dataclasses.replace(plan, processes=tuple(processes), files=files), pools, dict(initial),
                        router, servers_file)


def get_router_spec(router: ProcessSpec, generation: int, port: int, metrics_port: int,
                    prefill_urls: Sequence[str], decode_urls: Sequence[str]) -> ProcessSpec:
    """The router process for another set of servers (pure): named ``<router>-g<generation>``, on its own
    ports, with ``RLRUN_PREFILL_URLS``/``RLRUN_DECODE_URLS`` set to the given base URLs."""
    env = {**router.env, c.ENV_ROUTER_PORT: str(port), c.ENV_ROUTER_METRICS_PORT: str(metrics_port),
           c.ENV_PREFILL_URLS: ",".join(prefill_urls), c.ENV_DECODE_URLS: ",".join(decode_urls)}
    name = f"{router.name}-g{generation}"
    return dataclasses.replace(router, name=name, env=env, log_path=router.log_path.with_name(f"{name}.log"))


# --- observe ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalServer:
    """One server of a pool as the scaler tracks it (``phase``: see the module docstring)."""

    name: str
    pool: str
    ordinal: int
    url: str
    phase: str


def get_observations(servers: Iterable[LocalServer], texts: Mapping[str, str | None],
                     orchestrator_text: str | None) -> autoscale.Observations:
    """What ``decide`` reads (pure): per pool, desired = servers starting, joining or serving; ready = those
    serving; one sample per serving server whose ``/metrics`` text (``texts`` by name) was read and parses.
    Servers not yet serving are left out of the samples (they are warming up). ``orchestrator_text``: its
    ``/metrics`` (None: unreachable, no loop sample)."""
    servers = list(servers)
    pools = {}
    for pool in POOLS:
        mine = [s for s in servers if s.pool == pool]
        samples = []
        for server in mine:
            text = texts.get(server.name)
            if server.phase != SERVING or text is None:
                continue
            try:
                samples.append(autoscale.get_pod_sample(server.name, pool, text))
            except ValueError:
                continue
        pools[pool] = autoscale.PoolObservation(desired=sum(s.phase in ACTIVE_PHASES for s in mine),
                                                ready=sum(s.phase == SERVING for s in mine), pods=tuple(samples))
    loop = None
    if orchestrator_text is not None:
        try:
            loop = autoscale.get_loop_sample(orchestrator_text)
        except ValueError:
            loop = None
    return autoscale.Observations(prefill=pools[autoscale.PREFILL], decode=pools[autoscale.DECODE], loop=loop)


# --- act -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScaleActions:
    """``start``: (pool, ordinal) of the servers to start; ``stop``: names of the servers to stop."""

    start: tuple[tuple[str, int], ...] = ()
    stop: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.start and not self.stop


def plan_local_scale(wanted: Mapping[str, int], servers: Iterable[LocalServer], slots: Mapping[str, int],
                     local_max: int) -> ScaleActions:
    """Which servers to start and stop so that each pool has ``wanted[pool]`` active servers (pure).

    Args:
        wanted: pool -> servers the decision wants (``Decision.replicas``).
        servers: every server tracked now, in any phase.
        slots: pool -> how many processes the plan holds for it (ordinals 0..n-1).
        local_max: the most active servers of both pools together.

    Rules: a new server takes the lowest free ordinal (one still draining is not free: its ports are in
    use); starts stop at ``local_max`` active servers or when no slot is free. Stopping takes servers not yet
    routed to first (starting, then joining; the highest ordinal first), then serving ones, highest ordinal
    first, and never the last serving server of a pool.
    """
    servers = list(servers)
    active_total = sum(s.phase in ACTIVE_PHASES for s in servers)
    start: list[tuple[str, int]] = []
    stop: list[str] = []
    for pool in POOLS:
        mine = [s for s in servers if s.pool == pool]
        active = [s for s in mine if s.phase in ACTIVE_PHASES]
        want = int(wanted[pool])
        if want > len(active):
            used = {s.ordinal for s in mine}
            free = [o for o in range(slots.get(pool, 0)) if o not in used]
            for ordinal in free[: want - len(active)]:
                if active_total >= local_max:
                    break
                start.append((pool, ordinal))
                active_total += 1
        elif want < len(active):
            order = {STARTING: 0, JOINING: 1, SERVING: 2}
            candidates = sorted(active, key=lambda s: (order[s.phase], -s.ordinal))
            serving_left = sum(s.phase == SERVING for s in active)
            for server in candidates[: len(active) - max(want, 0)]:
                if server.phase == SERVING:
                    if serving_left <= 1:
                        break
                    serving_left -= 1
                stop.append(server.name)
                active_total -= 1
    return ScaleActions(tuple(start), tuple(stop))


def describe_pools(servers: Iterable[LocalServer]) -> str:
    """``prefill 1 serving; decode 1 serving, 1 joining`` (pure)."""
    servers = list(servers)
    parts = []
    for pool in POOLS:
        counts = [(phase, sum(s.pool == pool and s.phase == phase for s in servers))
                  for phase in (SERVING, JOINING, STARTING, DRAINING)]
        parts.append(f"{pool} " + ", ".join(f"{n} {phase}" for phase, n in counts if n or phase == SERVING))
    return "; ".join(parts)
