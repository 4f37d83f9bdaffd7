"""Autoscaling in ``rlrun local``, the I/O: scrape, ``decide``, start and stop servers (:mod:`.scaling` plans).

:class:`LocalScaler` runs in a thread of ``rlrun local`` beside the supervisor. Every ``step`` (about 1 s) it
moves servers through their phases; every ``scrapeIntervalSeconds`` it scrapes each serving server's and the
orchestrator's ``/metrics``, calls the operator's ``decide`` with the local policy and applies the decision.
Process starts and stops go through ``call`` (:class:`SupervisorCalls` runs them on the supervisor's thread).

A server that joins (scale-up), in order:

1. its process starts (a pod of the pool's Deployment: the plan's spare slot with its own ports), from the
   initial model like the servers already running (``inference.get_start_weights``: NIXL's handshake
   compares the ``--model`` path, so a server started from ``weights/step-N`` would refuse KV transfers
   with them);
2. once ``GET /health`` answers, it loads the version the serving servers report (``GET /weight_info``;
   the highest when they differ) through the run's transport and the one update sequence
   (``weights.update.update_engines``; a new vLLM server reports ``default`` until it is named);
3. it is added to the servers file: from now on the orchestrator's weight loop keeps it current and its
   watchdog probes it;
4. once it reports the version the serving servers report, one KV hand-off is sent straight from each
   serving prefill server to it (a decode server that joins) or from it to each serving decode server (a
   prefill server), in the background (:mod:`rlrun_runtime.kv_handoff`: a pair's first NIXL connection can
   take minutes on CPU); it must be read over NIXL, else it is sent again;
5. then a new router is started with the servers
   that serve plus this one (vllm-router 0.1.17 cannot add a server to a running P/D router), the servers
   file names the new router once it is healthy and lists every server, and the old router is stopped
   (SIGTERM: it finishes the requests it has in flight). Only then does it get traffic.

A server that leaves (scale-down): ``POST /remove_worker`` on the router (no new request reaches it; for a
prefill server no new KV hand-off starts from it), out of the servers file, then, once no weight update is in
flight, SIGTERM: vLLM drains (``--shutdown-timeout``, the KV blocks decode still reads included) and exits;
SIGKILL after ``constants.INFERENCE_TERMINATION_GRACE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

from rlrun_api import constants as c
from rlrun_api.views import AutoscalingView
from rlrun_operator import autoscale

from .membership import get_server_set, write_server_set
from .processes import Supervisor
from .scaling import (DRAINING, JOINING, SERVING, STARTING, LocalServer, ScalablePlan, describe_pools,
                      get_observations, get_router_spec, ordinal_of, plan_local_scale, router_url, server_url)
from ..kv_handoff import HANDOFF_TIMEOUT_S, Handoff, HandoffError, send_handoff
from ..storage import append_jsonl

log = logging.getLogger("rlrun.local.scaler")
T = TypeVar("T")

HANDOFF_RETRY_S = 10.0        # pause before a joining server's failed KV hand-off check is sent again
HTTP_TIMEOUT_S = 5.0          # one GET of /metrics, /health or /weight_info (a loaded CPU server answers late)
ROUTER_START_TIMEOUT_S = 120.0  # a new router waits until every server it names answers /health
ROUTER_DRAIN_SECONDS = float(c.INFERENCE_TERMINATION_GRACE_SECONDS)  # the old router finishes in-flight requests
UPDATE_WAIT_S = 30.0          # how long a leaving server waits for a weight update in flight to end
STEP_S = 1.0


class SupervisorCalls:
    """Runs functions of the Supervisor on the thread that runs ``Supervisor.wait`` (its ``on_tick``)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[Supervisor], Any], concurrent.futures.Future[Any]]] = queue.Queue()

    def call(self, fn: Callable[[Supervisor], T], timeout_s: float = 30.0) -> T:
        """Queue ``fn`` and wait for its result (its exception is raised here)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future.result(timeout=timeout_s)

    def run_pending(self, supervisor: Supervisor) -> None:
        while True:
            try:
                fn, future = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(fn(supervisor))
            except Exception as err:  # handed to the caller
                future.set_exception(err)


def _get(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> str | None:
    """The body of a GET answered 200, else None (refused, timed out, other status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read().decode("utf-8", errors="replace") if response.status == 200 else None
    except (OSError, ValueError):  # URLError and timeouts are OSErrors
        return None


def _post(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int | None, str]:
    request = urllib.request.Request(url, method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", errors="replace")
    except (OSError, ValueError) as err:
        return None, f"{type(err).__name__}: {err}"


def weight_version(url: str) -> int | None:
    """The policy version ``GET /weight_info`` names (None: unreachable, or not a version yet)."""
    from ..vllm_admin import parse_version

    text = _get(f"{url}/weight_info")
    try:
        return parse_version(str(json.loads(text)["weight_version"])) if text else None
    except (ValueError, KeyError, TypeError):
        return None


def _in_background(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """``fn()`` in a daemon thread (a hand-off still waiting never holds up ``rlrun local``'s exit), as a future."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as err:  # delivered to whoever reads the future
            future.set_exception(err)

    threading.Thread(target=run, name="kv-handoff", daemon=True).start()
    return future


class LocalScaler:
    """Applies the autoscaler's decisions to a local run (the module docstring gives the sequences).

    Args:
        scalable: the run's plan with its pools' spare slots (``scaling.split_plan``).
        policy: the local policy (``scaling.get_local_policy``).
        transport: the run's weight transport (loads the current version into a joining server).
        call: runs a function of the Supervisor on its thread (``SupervisorCalls.call``, or a direct call).
        allocate_port: free loopback ports for new routers.
        orchestrator_metrics_url: the orchestrator's /metrics (None: no loop sample).
        history_file: one JSON line per decision that acted or changed its reason (``DIR/local/scaling.jsonl``).
        clock: unix seconds (what ``decide`` reads).
    """

    def __init__(self, scalable: ScalablePlan, policy: AutoscalingView, transport: Any,
                 call: Callable[[Callable[[Supervisor], Any]], Any], allocate_port: Callable[[], int],
                 orchestrator_metrics_url: str | None, history_file: Path,
                 clock: Callable[[], float] = time.time, join_timeout_s: float = c.LOCAL_JOIN_TIMEOUT_S):
        self.scalable = scalable
        self.policy = policy
        self.transport = transport
        self.call = call
        self.allocate_port = allocate_port
        self.orchestrator_metrics_url = orchestrator_metrics_url
        self.history_file = history_file
        self.clock = clock
        self.join_timeout_s = join_timeout_s
        self.servers: dict[str, LocalServer] = {}
        for pool, specs in scalable.pools.items():
            for spec in specs[: scalable.initial[pool]]:
                self.servers[spec.name] = LocalServer(spec.name, pool, ordinal_of(spec), server_url(spec), SERVING)
        self.router = scalable.router
        self.router_generation = 0
        self.state = autoscale.State()
        self.last_decision: autoscale.Decision | None = None
        self.last_decision_time: float | None = None
        self.notes: list[str] = []  # what the scaler did, newest last
        self._next_decision = 0.0
        self._started_at: dict[str, float] = {}
        self._signalled: dict[str, float] = {}  # draining server -> when it got SIGTERM (monotonic)
        self._drain_since: dict[str, float] = {}  # draining server -> when it left the router (monotonic)
        self._incarnations: dict[str, int] = {}
        # joining server -> (the (prefill, decode) pairs its running KV hand-off check covers, that check)
        self._handoffs: dict[str, tuple[tuple[tuple[str, str], ...], concurrent.futures.Future[list[Handoff]]]] = {}
        self._handoff_retry_at: dict[str, float] = {}  # joining server -> when a failed check may start again
        self._lock = threading.Lock()

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set (the body of the scaler thread); an error is logged, not raised."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # one bad step must not end autoscaling silently
                log.exception("autoscaler step failed")
                self._note("autoscaler step failed (see the log); retrying")
            stop.wait(STEP_S)

    def step(self) -> autoscale.Decision | None:
        """Advance joining and leaving servers; decide and act when a decision is due. Returns the decision
        made in this step, if any."""
        self.advance()
        now = self.clock()
        if now < self._next_decision:
            return None
        self._next_decision = now + self.policy.scrape_interval_s
        return self.decide_and_apply(now)

    def decide_and_apply(self, now: float) -> autoscale.Decision:
        observations = self.observe()
        decision = autoscale.decide(observations, self.state, self.policy, now)
        self.state = decision.state
        previous = self.last_decision
        with self._lock:
            self.last_decision, self.last_decision_time = decision, now
        if decision.action != "hold" or previous is None or previous.code != decision.code:
            append_jsonl(self.history_file, {**decision.history_entry(now, self.policy.dry_run),
                                             "servers": describe_pools(self.servers.values())})
        if decision.changed and not self.policy.dry_run:
            self.apply({p: decision.replicas(p) for p in autoscale.POOLS})
        return decision

    def observe(self) -> autoscale.Observations:
        servers = list(self.servers.values())
        texts = {s.name: _get(f"{s.url}/metrics") for s in servers if s.phase == SERVING}
        loop = _get(self.orchestrator_metrics_url) if self.orchestrator_metrics_url else None
        return get_observations(servers, texts, loop)

    def apply(self, wanted: dict[str, int]) -> None:
        """Start and stop servers so that each pool has ``wanted`` active ones (``scaling.plan_local_scale``)."""
        slots = {p: len(specs) for p, specs in self.scalable.pools.items()}
        actions = plan_local_scale(wanted, self.servers.values(), slots, self.policy.max_replicas)
        for pool, ordinal in actions.start:
            self._start_server(pool, ordinal)
        for name in actions.stop:
            self._stop_server(name)

    # --- joining ----------------------------------------------------------------------------------
    def _start_server(self, pool: str, ordinal: int) -> None:
        spec = self.scalable.pools[pool][ordinal]
        count = self._incarnations.get(spec.name, 0)
        self._incarnations[spec.name] = count + 1
        if count:  # the slot's earlier server has exited; the new process gets a name (and log) of its own
            name = f"{spec.name}.{count}"
            spec = dataclasses.replace(spec, name=name, log_path=spec.log_path.with_name(f"{name}.log"))
        try:
            self.call(lambda supervisor: supervisor.add(spec))
        except (OSError, ValueError) as err:
            self._note(f"{spec.name} ({pool}) could not start: {err}")
            return
        self._set(LocalServer(spec.name, pool, ordinal, server_url(spec), STARTING))
        self._started_at[spec.name] = time.monotonic()
        self._note(f"{spec.name} ({pool}) starting")

    def current_version(self) -> int | None:
        """The highest version the serving servers report (None: none answered with a version)."""
        versions = [weight_version(s.url) for s in self.servers.values() if s.phase == SERVING]
        known = [v for v in versions if v is not None]
        return max(known) if known else None

    def advance(self) -> None:
        """One pass over the servers that are joining or leaving."""
        for server in list(self.servers.values()):
            if server.phase in (STARTING, JOINING) and \
                    time.monotonic() - self._started_at.get(server.name, time.monotonic()) > self.join_timeout_s:
                self._note(f"{server.name} did not join within {self.join_timeout_s:.0f} s; stopping it")
                self._stop_server(server.name)
            elif server.phase == STARTING:
                self._advance_starting(server)
            elif server.phase == JOINING:
                self._advance_joining(server)
            elif server.phase == DRAINING:
                self._advance_draining(server)

    def _advance_starting(self, server: LocalServer) -> None:
        if _get(f"{server.url}/health") is None:
            return
        version = self.current_version()
        if version is None:
            return  # nothing to match yet (the serving servers do not answer): try again next step
        if weight_version(server.url) != version:
            try:
                asyncio.run(self._load(server.url, version))
            except Exception as err:  # EngineError, ValueError (version retired meanwhile), HTTP errors
                self._note(f"{server.name}: loading version {version} failed ({err}); retrying")
                return
        self._set(dataclasses.replace(server, phase=JOINING))
        self._write_servers_file()
        self._note(f"{server.name} loaded version {version}; the orchestrator keeps it current")

    async def _load(self, url: str, version: int) -> None:
        from ..vllm_admin import VLLMAdmin
        from ..weights.update import update_engines

        if version == 0:  # the initial model, which a new server starts from: only name it
            async with VLLMAdmin(url) as admin:
                await admin.update_weight_version(0)
            return
        await update_engines([url], version, self.transport)

    def _advance_joining(self, server: LocalServer) -> None:
        version = self.current_version()
        if version is None or weight_version(server.url) != version:
            return  # an update is on its way to it (it is in the servers file now)
        if not self._kv_path_ready(server):
            return
        serving = [s for s in self.servers.values() if s.phase == SERVING] + [server]
        if not self._route(serving):
            return
        self._set(dataclasses.replace(server, phase=SERVING))
        self._started_at.pop(server.name, None)
        self._note(f"{server.name} serves version {version} and is routed to")

    def _kv_path_ready(self, server: LocalServer) -> bool:
        """True once one KV hand-off between ``server`` and every serving server of the other pool was read
        over NIXL. The hand-offs run in a background thread (the first one can take minutes): a call starts
        them (not while a weight update is in flight: it would pause the servers under them), later calls
        read the outcome; a failed check is started again ``HANDOFF_RETRY_S`` later, each request bounded by
        what is left of the server's join time."""
        other = autoscale.DECODE if server.pool == autoscale.PREFILL else autoscale.PREFILL
        peers = sorted((s for s in self.servers.values() if s.pool == other and s.phase == SERVING),
                       key=lambda s: s.ordinal)
        pairs = [(server.url, p.url) if server.pool == autoscale.PREFILL else (p.url, server.url) for p in peers]
        if not pairs:
            self._handoffs.pop(server.name, None)
            return True
        pending = self._handoffs.get(server.name)
        if pending is None:
            if time.monotonic() < self._handoff_retry_at.get(server.name, 0.0) or self._update_in_flight():
                return False
            left_s = self.join_timeout_s - (time.monotonic() - self._started_at.get(server.name, time.monotonic()))
            timeout_s = max(HTTP_TIMEOUT_S, min(HANDOFF_TIMEOUT_S, left_s / 2))  # two requests per hand-off
            self._handoffs[server.name] = (tuple(pairs), _in_background(
                lambda: [send_handoff(prefill, decode, timeout_s) for prefill, decode in pairs]))
            self._note(f"{server.name}: sending a KV hand-off {'to' if other == autoscale.DECODE else 'from'} "
                       f"{len(pairs)} {other} server(s)")
            return False
        checked, check = pending
        if not check.done():
            return False
        del self._handoffs[server.name]
        try:
            handoffs = check.result()
        except HandoffError as err:
            self._handoff_retry_at[server.name] = time.monotonic() + HANDOFF_RETRY_S
            self._note(f"{server.name}: KV hand-off failed ({err}); sending it again in {HANDOFF_RETRY_S:.0f} s")
            return False
        unread = [h for h in handoffs if not h.ok]
        if unread:
            self._handoff_retry_at[server.name] = time.monotonic() + HANDOFF_RETRY_S
            self._note(f"{server.name}: KV hand-off from {unread[0].prefill} not read over NIXL "
                       f"({unread[0].failed:.0f} failed transfers); sending it again in {HANDOFF_RETRY_S:.0f} s")
            return False
        if not set(pairs) <= set(checked):
            return False  # a server of the other pool began serving meanwhile: check again, with it
        self._handoff_retry_at.pop(server.name, None)
        self._note(f"{server.name}: KV hand-off read over NIXL in {max(h.seconds for h in handoffs):.1f} s")
        return True

    def _route(self, serving: list[LocalServer]) -> bool:
        """Replace the router by one that routes to ``serving``; True once the servers file names it."""
        if self.router is None:
            self._write_servers_file()
            return True
        urls = {p: [s.url for s in sorted(serving, key=lambda s: s.ordinal) if s.pool == p] for p in autoscale.POOLS}
        self.router_generation += 1
        base = self.scalable.router
        assert base is not None
        spec = get_router_spec(base, self.router_generation, self.allocate_port(), self.allocate_port(),
                               urls[autoscale.PREFILL], urls[autoscale.DECODE])
        try:
            self.call(lambda supervisor: supervisor.add(spec))
        except (OSError, ValueError) as err:
            self._note(f"router {spec.name} could not start: {err}")
            return False
        url = router_url(spec)
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        wanted = set(urls[autoscale.PREFILL] + urls[autoscale.DECODE])
        while time.monotonic() < deadline:
            listed = _get(f"{url}/list_workers")
            if listed is not None and _get(f"{url}/health") is not None:
                try:
                    if wanted <= set(json.loads(listed).get("urls", [])):
                        break
                except ValueError:
                    pass
            time.sleep(0.5)
        else:
            self._note(f"router {spec.name} not ready within {ROUTER_START_TIMEOUT_S:.0f} s; keeping {self.router.name}")
            self._retire(spec.name, 10.0)
            return False
        old, self.router = self.router, spec
        self._write_servers_file(serving)
        self._retire(old.name, ROUTER_DRAIN_SECONDS)
        self._note(f"router {spec.name} routes to {len(serving)} servers; {old.name} finishes its requests")
        return True

    # --- leaving ----------------------------------------------------------------------------------
    def _stop_server(self, name: str) -> None:
        server = self.servers[name]
        self._handoffs.pop(name, None)  # a check still running ends on its own (its outcome is not read)
        self._handoff_retry_at.pop(name, None)
        if server.phase == SERVING and self.router is not None:
            status, body = _post(f"{router_url(self.router)}/remove_worker?"
                                 f"{urllib.parse.urlencode({'url': server.url})}")
            if status != 200:
                self._note(f"router refused to remove {name} ({status}: {body[:120]}); it keeps serving")
                return
        self._set(dataclasses.replace(server, phase=DRAINING))
        self._write_servers_file()
        self._note(f"{name} taken out of the router and the orchestrator's servers; draining")
        self._advance_draining(self.servers[name])

    def _advance_draining(self, server: LocalServer) -> None:
        if server.name not in self._signalled:
            since = self._drain_since.setdefault(server.name, time.monotonic())
            if self._update_in_flight() and time.monotonic() - since < UPDATE_WAIT_S:
                return  # let the orchestrator's update end before the server stops under it
            self._retire(server.name, float(c.INFERENCE_TERMINATION_GRACE_SECONDS))
            self._signalled[server.name] = time.monotonic()
            return
        exited = self.call(lambda supervisor: supervisor.exits())
        if server.name in exited:
            with self._lock:
                self.servers.pop(server.name, None)
            self._signalled.pop(server.name, None)
            self._drain_since.pop(server.name, None)
            self._started_at.pop(server.name, None)
            self._note(f"{server.name} stopped (exit {exited[server.name]})")

    def _update_in_flight(self) -> bool:
        text = _get(self.orchestrator_metrics_url) if self.orchestrator_metrics_url else None
        if text is None:
            return False
        try:
            return autoscale.get_loop_sample(text).update_in_flight
        except ValueError:
            return False

    # --- helpers ----------------------------------------------------------------------------------
    def _retire(self, name: str, grace_s: float) -> None:
        try:
            self.call(lambda supervisor: supervisor.retire(name, grace_s))
        except KeyError:
            pass

    def _set(self, server: LocalServer) -> None:
        with self._lock:
            self.servers[server.name] = server

    def _write_servers_file(self, serving: list[LocalServer] | None = None) -> None:
        listed = sorted((s for s in self.servers.values() if s.phase in (JOINING, SERVING)),
                        key=lambda s: (s.pool, s.ordinal))
        if serving is not None:
            listed = sorted({s.name: s for s in [*listed, *serving]}.values(), key=lambda s: (s.pool, s.ordinal))
        urls = {p: [s.url for s in listed if s.pool == p] for p in autoscale.POOLS}
        write_server_set(self.scalable.servers_file, get_server_set(
            urls[autoscale.PREFILL], urls[autoscale.DECODE], router_url(self.router) if self.router else None))

    def _note(self, text: str) -> None:
        log.info("%s", text)
        with self._lock:
            self.notes = [*self.notes[-19:], f"{time.strftime('%H:%M:%S')} {text}"]

    def summary(self) -> tuple[str, str, str]:
        """(pools, last decision, last action) for the live display."""
        with self._lock:
            pools = describe_pools(self.servers.values())
            decision = self.last_decision
            note = self.notes[-1] if self.notes else "-"
        if decision is None:
            text = "none yet"
        else:
            text = f"{decision.action} ({decision.code}): {decision.reason}"
            if self.policy.dry_run:
                text += " [dryRun: not applied]"
        return pools, text, note
