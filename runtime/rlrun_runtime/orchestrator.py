"""`rlrun-runtime orchestrator`: the asynchronous off-policy loop (docs/orchestrator.md).

Two asyncio tasks share one process:

- the **batch loop** writes ``rollouts/step-n.json`` for n = next step .. maxSteps. Batch n is generated
  only while the version loaded on every engine ``v >= n - 1 - maxAsyncLevel`` (the async gate); each
  group (``rolloutsPerPrompt`` completions of one prompt) is stamped with that ``v`` when its requests are
  sent; at assembly, staleness ``n - 1 - v > maxOffPolicySteps`` drops the group (counted). See
  :mod:`rlrun_runtime.staleness` for the exact definitions and :mod:`rlrun_runtime.rollouts` for the
  batch format;
- the **weight loop** watches ``weights/`` and every engine's ``GET /weight_info``; when a newer version
  is published (or an engine, e.g. a new pod, reports another version), it pushes the newest to the
  engines that lack it (pause(keep) -> reload -> set version -> reset prefix cache -> resume, each engine
  directly: :mod:`rlrun_runtime.vllm_admin`), then deletes weight directories older than the version
  every engine has loaded (never the loaded one: a new pod starts from it), and records that version in
  ``orchestrator/serving-version.json`` (the readiness of prefill and decode pods, which always start from
  the initial model: :func:`rlrun_runtime.weights.update.get_readiness`).

Beside them, the engines' watchdog and the reader of the trainer's ``metrics.jsonl`` (its wait for data,
one of the loop metrics the autoscaler reads: :class:`rlrun_runtime.orchestrator_metrics.OrchestratorMetrics`).

Generation never stops for training: while the trainer trains step n, batch n + 1 (.. n + maxAsyncLevel)
is generated with the loaded policy. The process exits 0 once version maxSteps is loaded on every engine
(the Job's completion is the run's completion); it resumes from ``orchestrator/state.json`` and the
batches already on storage after a restart. Batches with nothing to train on end it with exit code 3 after
``algorithm.maxEmptyBatches`` in a row (at once when every prompt was too long), naming the environment and
the reason (:class:`NoLearningSignalError`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import aiohttp
import httpx

from rlrun_api import constants
from rlrun_api.views import OrchestratorView
from rlrun_runtime.local.membership import ServerSet, ServersFile
from rlrun_runtime.evaluation import EvalSettings, EvaluationSpecError, Evaluator, HeldOutTasks
from rlrun_runtime.kv_handoff import HANDOFF_TIMEOUT_S, get_handoff_pairs, get_joined_pairs, send_handoff
from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics, count_new_waits, parse_trainer_waits
from rlrun_runtime.role import (RoleConfigError, env_bind_host, env_list, env_port, env_required, load_spec,
                                print_role_error, role_main)
from rlrun_runtime.rollouts import (BAD_LOGPROBS, BAD_TOKEN_IDS, Group, assemble_batch, get_choice_problem,
                                   get_completion_request, get_empty_batch_reason, parse_completion_choice,
                                   plan_group_count)
from rlrun_runtime.staleness import may_generate
from rlrun_runtime.storage import FileTail, RunStorage, append_jsonl, atomic_write_json, list_steps, step_name
from rlrun_runtime.tracking import Tracker, TrackingSetupError, build_tracker
from rlrun_runtime.vllm_admin import HEALTH_PROBE_TIMEOUT_S, EngineError, VLLMAdmin, parse_version, resolve_engines
from rlrun_runtime.weights import get_transport
from rlrun_runtime.weights.update import read_serving_record, update_engines, write_serving_version

log = logging.getLogger("rlrun.orchestrator")

POLL_S = 0.2                 # how often the engines' versions are checked (weight_info over HTTP)
PUBLISH_POLL_S = 0.02        # how often the transport is asked for a newly published version
HEALTH_TIMEOUT_S = 1800.0    # how long to wait for the router and engines at start (vLLM may download a model)
REQUEST_TIMEOUT_S = 600.0    # one completion request (queued behind a weight-update pause counts too)
REQUEST_RETRIES = 3
MAX_ROUNDS_PER_BATCH = 8     # generation rounds before a batch is written with what it has
MAX_WEIGHT_FAILURES = 20     # consecutive failed weight-update rounds before the orchestrator gives up
# Watchdog (docs/orchestrator.md "Stalled engines"): every engine's GET /health is probed every
# WATCHDOG_POLL_S (HEALTH_PROBE_TIMEOUT_S each, one probe per engine at a time). An engine that has not
# answered for STALL_AFTER_S is reported (a warning naming it and how long, the gauge METRIC_STALLED_ENGINES)
# at most STALL_AFTER_S + WATCHDOG_POLL_S after its last answer, again every STALL_REPEAT_S while it stays
# silent, and cleared (logged) when it answers again.
STALL_AFTER_S = constants.ENGINE_STALL_AFTER_S  # 10 s (the operator's Degraded message names it too)
WATCHDOG_POLL_S = 1.0
STALL_REPEAT_S = 60.0
SAMPLES_PER_STEP = 4         # rollouts per step written to rollout-samples.jsonl
TRAINER_POLL_S = 0.5         # how often the trainer's metrics.jsonl is read for its wait (METRIC_DATA_WAIT_SECONDS)


EXIT_NO_SIGNAL = 3          # the run cannot learn: empty batches (algorithm.maxEmptyBatches) or every prompt too long


class OrchestratorError(RuntimeError):
    """The loop cannot continue (engines unreachable, weight updates keep failing)."""


class NoLearningSignalError(OrchestratorError):
    """Batches carry nothing to train on: the run would end "Succeeded" having learned nothing.

    Raised for ``algorithm.maxEmptyBatches`` consecutive batches without a sample, or at once for a batch
    whose every prompt was too long for ``model.maxModelLen``; the message names ``spec.environment`` and the
    reason (:func:`rlrun_runtime.rollouts.get_empty_batch_reason`). Exit code ``EXIT_NO_SIGNAL``.
    """


def write_termination_message(message: str, path: str = constants.TERMINATION_MESSAGE_PATH) -> bool:
    """Write ``message`` where Kubernetes reads the container's termination message, if that file exists.

    The kubelet creates ``terminationMessagePath`` (default ``/dev/termination-log``) in every container and
    copies what the process wrote there (at most 4096 bytes) into the pod's
    ``status.containerStatuses[].state.terminated.message``. Outside a pod the file does not exist and nothing
    is written. Returns True when written.
    """
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(message.encode("utf-8")[:4096].decode("utf-8", errors="ignore"))
    except OSError:
        return False
    return True


def render_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> tuple[list[int], str]:
    """Token ids and text of a task's prompt.

    A string is encoded as is (with the tokenizer's special-token rules, as vLLM would); chat messages are
    rendered with the tokenizer's chat template (``add_generation_prompt=True``) when it has one, else their
    contents joined by newlines.
    """
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt)), prompt
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False)), text
    text = "\n".join(str(m.get("content", "")) for m in prompt)
    return list(tokenizer.encode(text)), text


def get_resume_point(state: Mapping[str, Any] | None, last_batch: Mapping[str, Any] | None) -> tuple[int, int]:
    """(next batch step, prompt cursor) from ``orchestrator/state.json`` and the newest batch file (pure).

    The batch is written before the state, so a crash between the two leaves the batch newer; the larger
    of the two positions wins. Fresh start: (1, 0).
    """
    step, cursor = 1, 0
    if state:
        step, cursor = int(state.get("next_step", 1)), int(state.get("prompt_cursor", 0))
    if last_batch:
        step = max(step, int(last_batch["step"]) + 1)
        cursor = max(cursor, int(last_batch.get("prompt_cursor", 0)))
    return step, cursor


def get_resume_empty_streak(state: Mapping[str, Any] | None, last_batch: Mapping[str, Any] | None) -> int:
    """Consecutive empty batches just before the resume point (pure): ``empty_batch_streak`` of whichever of
    ``orchestrator/state.json`` and the newest batch file is newer (the batch is written first); 0 when
    neither has one (fresh start, or files written before the field existed)."""
    state_step = int(state.get("next_step", 1)) if state else 1
    if last_batch and int(last_batch["step"]) + 1 >= state_step:
        return int(last_batch.get("empty_batch_streak", 0) or 0)
    return int((state or {}).get("empty_batch_streak", 0) or 0)


class Orchestrator:
    """The asynchronous loop of one run.

    Args:
        view: the orchestrator's view of the defaulted spec (:class:`rlrun_api.views.OrchestratorView`).
        storage: the run's shared storage.
        env: the environment (``task(index)``, ``score(task, text)``).
        tokenizer: the policy's tokenizer (prompts only; completions are never re-tokenized).
        endpoints: ``RLRUN_INFERENCE_ENDPOINTS`` (``host:port`` items; hosts re-resolved on every check).
        router_url: where completions go; None sends them round-robin to the engines directly.
        metrics: the Prometheus metrics to update.
        prefill_endpoints: ``RLRUN_PREFILL_ENDPOINTS``, the prefill pool's part of ``endpoints`` under P/D
            disaggregation (re-resolved before every weight update; the update's P/D order needs it).
        servers_file: ``RLRUN_LOCAL_SERVERS_FILE`` (autoscaled ``rlrun local``): when the file exists, its
            lists and router replace the three above, re-read whenever it changes (servers join and leave
            without a restart; :mod:`rlrun_runtime.local.membership`).
        held_out: the held-out tasks of ``spec.evaluation`` (None: no evaluation); kept out of training and
            evaluated by an :class:`rlrun_runtime.evaluation.Evaluator`.
        tracker: the ``spec.tracking`` sinks (None: none), fed from ``metrics.jsonl`` and the evaluations.
    """

    def __init__(self, view: OrchestratorView, storage: RunStorage, env: Any, tokenizer: Any,
                 endpoints: Sequence[str], router_url: str | None, metrics: OrchestratorMetrics,
                 *, prefill_endpoints: Sequence[str] = (), servers_file: str | None = None,
                 held_out: HeldOutTasks | None = None, tracker: Tracker | None = None, poll_s: float = POLL_S,
                 health_timeout_s: float = HEALTH_TIMEOUT_S, stall_after_s: float = STALL_AFTER_S,
                 watchdog_poll_s: float = WATCHDOG_POLL_S):
        self.view = view
        self.storage = storage
        self.transport = get_transport(view.weight_transport, storage)
        self.env = env
        self.tokenizer = tokenizer
        self._endpoints = list(endpoints)
        self._prefill_endpoints = list(prefill_endpoints)
        self._router_url = router_url.rstrip("/") if router_url else None
        self._servers_file = ServersFile(servers_file, ServerSet(())) if servers_file else None
        self.metrics = metrics
        self.poll_s = poll_s
        self.health_timeout_s = health_timeout_s
        self.stall_after_s = stall_after_s
        self.watchdog_poll_s = watchdog_poll_s
        self.stalled: dict[str, float] = {}       # engine -> monotonic time of its last answer (while stalled)
        self.out_of_service: set[str] = set()     # engines a failed update left paused (retried every round)
        # Under P/D (unless the local scaler owns membership): engines whose KV hand-offs were checked (None until
        # the start-up check ran: then engines that appear later are joiners), joiners whose check is pending (not
        # ready meanwhile), the running checks, and the lock that keeps a hand-off and a weight update apart (an
        # update's pauses would wait for a hand-off's pending KV read, and a hand-off sent into paused engines
        # would wait for them); one lock per event loop (see _handoff_lock).
        self.kv_checked: set[str] | None = None
        self.kv_pending: set[str] = set()
        self._kv_checks: dict[str, asyncio.Task] = {}
        self._kv_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self.sampling = {"temperature": view.temperature, "topP": view.top_p}
        # Choices per completions request: the whole group at once, except behind prefill/decode
        # disaggregation, where vLLM 0.32's completions handler returns only the first choice's
        # kv_transfer_params (entrypoints/openai/completion/serving.py), i.e. one KV hand-off for n sequences.
        self.choices_per_request = 1 if view.disaggregated else view.rollouts_per_prompt
        self.loaded_version = -1            # version every engine has loaded; -1 until the first check
        self.version_changed = asyncio.Event()
        # Open (set) except while a weight update is in flight: a new request reads loaded_version only
        # when it is open, so its cache_salt and policy_version name the weights it will run on.
        self.weights_stable = asyncio.Event()
        self.weights_stable.set()
        self.leftover: list[Group] = []
        self.signal_rate: float | None = None  # share of assembled groups that had a learning signal
        self.seed_rng = random.Random(view.environment.seed)
        self.trainer_needs: int | None = None  # the batch the trainer waits for (known from its metrics.jsonl)
        self._round_robin = itertools.count()
        self._loaded_identity: Hashable | None = None
        # what weights.update.write_serving_version last wrote: (version, out of service, KV-pending engines)
        self._recorded: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None
        self.not_listening: set[str] = set()        # engines left out of the last weight round (starting)
        self._client: httpx.AsyncClient | None = None  # health probes
        # Completions go through aiohttp: with httpx 0.28 / httpcore 1.0 a pool of keep-alive connections cost
        # the orchestrator ~1.5 s of CPU per batch of 128 concurrent requests and made each batch 6x slower on 2
        # cores, where aiohttp keeps them alive at ~0.06 s (benchmarks/README.md, "pd_throughput.py"). A session
        # belongs to the event loop it was made in, so it is kept with that loop.
        self._session: tuple[asyncio.AbstractEventLoop, aiohttp.ClientSession] | None = None
        # spec.evaluation and spec.tracking (None when off): rlrun_runtime.evaluation, rlrun_runtime.tracking.
        self.held_out = held_out
        self.tracker = tracker
        self.evaluator = None if held_out is None or view.evaluation is None else Evaluator(
            self, view.evaluation, EvalSettings(view.max_steps, view.max_model_len, view.temperature, view.top_p),
            held_out, render_prompt, storage, on_record=tracker.log_eval if tracker else None)

    # --- the servers it uses -------------------------------------------------------------------------
    def _local_servers(self) -> ServerSet | None:
        """The servers file's current set (None without one, or before it exists)."""
        if self._servers_file is None:
            return None
        servers = self._servers_file.read()
        return servers if servers.inference else None

    @property
    def endpoints(self) -> list[str]:
        local = self._local_servers()
        return list(local.inference) if local else self._endpoints

    @endpoints.setter
    def endpoints(self, value: Sequence[str]) -> None:
        self._endpoints = list(value)

    @property
    def prefill_endpoints(self) -> list[str]:
        local = self._local_servers()
        return list(local.prefill) if local else self._prefill_endpoints

    @property
    def router_url(self) -> str | None:
        local = self._local_servers()
        return local.router if local else self._router_url

    # --- start-up -----------------------------------------------------------------------------------
    async def wait_healthy(self, router: bool = True) -> list[str]:
        """Wait (logging every 10th retry) until the engines and, with ``router``, the router, if any, answer
        /health.

        Every engine that ``RLRUN_INFERENCE_ENDPOINTS`` resolves to must be healthy, except engines that refuse
        connections (nothing listens: a prefill or decode pod still starting or crash-looping, which its
        Service publishes before it is ready) once each endpoint has at least one healthy engine: those are
        left to the weight loop, which loads them once they listen. Returns the healthy engines' base URLs.

        Raises:
            OrchestratorError: still not healthy after ``health_timeout_s``.
        """
        deadline = time.monotonic() + self.health_timeout_s
        for attempt in itertools.count(1):
            problems: list[str] = []
            healthy: list[str] = []
            for item in (i.strip() for i in self.endpoints if i.strip()):  # a Service (cluster) or one server
                try:
                    engines = resolve_engines([item])
                except (OSError, ValueError) as err:
                    problems.append(f"{constants.ENV_INFERENCE_ENDPOINTS}: {err}")
                    continue
                ok, starting, sick = [], [], []
                for url in engines:
                    async with VLLMAdmin(url, timeout_s=5) as admin:
                        if await admin.health():
                            ok.append(url)
                        elif await self._refuses_connections(url):
                            starting.append(url)
                        else:
                            sick.append(url)
                healthy += ok
                problems += [f"engine {url} not healthy" for url in sick]
                if not ok:
                    problems += [f"engine {url} not listening yet" for url in starting] or [f"{item}: no engine"]
            if router and self.router_url and not problems:
                try:
                    ok_router = (await self._http().get(f"{self.router_url}/health", timeout=5)).status_code == 200
                except httpx.HTTPError as err:
                    ok_router = False
                    problems.append(f"router {self.router_url}: {type(err).__name__}")
                if not ok_router and not problems:
                    problems.append(f"router {self.router_url} not healthy")
            if not problems and healthy:
                log.info("engines healthy: %s%s", ", ".join(healthy),
                         f"; router {self.router_url} healthy" if self.router_url else "")
                return healthy
            if time.monotonic() > deadline:
                raise OrchestratorError(f"not healthy after {self.health_timeout_s:.0f} s: {'; '.join(problems)}")
            if attempt == 1 or attempt % 10 == 0:
                log.info("waiting for inference to become healthy (attempt %d): %s", attempt, "; ".join(problems))
            await asyncio.sleep(min(5.0, 0.5 * attempt))
        raise AssertionError("unreachable")

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=max(64, self.view.batch_size), max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits)
        return self._client

    def _completions(self) -> aiohttp.ClientSession:
        """The keep-alive session for completions, made in the running event loop (a new one in a new loop).

        As many connections as a batch has requests (at least 64). Timeouts as httpx's ``timeout=600`` above:
        REQUEST_TIMEOUT_S to connect and between reads, no total, so a request queued behind a long weight
        update is not cut short.
        """
        loop = asyncio.get_running_loop()
        if self._session is None or self._session[0] is not loop or self._session[1].closed:
            # Idle connections are dropped after 4 s, before the server's keep-alive (uvicorn's 5 s in vLLM)
            # can close one under a new request; proxies from the environment, as httpx (the probes) uses them.
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max(64, self.view.batch_size), keepalive_timeout=4),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S,
                                              sock_read=REQUEST_TIMEOUT_S), trust_env=True)
            self._session = (loop, session)
        return self._session[1]

    async def aclose(self) -> None:
        """Close the HTTP clients (idempotent); call it in the event loop that used them."""
        client, session, self._client, self._session = self._client, self._session, None, None
        try:
            if client is not None:
                await client.aclose()
        finally:
            if session is not None and session[0] is asyncio.get_running_loop():
                await session[1].close()
            elif session is not None:
                log.debug("completions session of another event loop dropped unclosed")

    # --- weights ------------------------------------------------------------------------------------
    def newest_published(self) -> int:
        """Newest published policy version (0 before the first trainer step)."""
        return self.transport.newest_published()

    async def sync_weights_once(self) -> bool:
        """One check: bring every engine to the newest published version. True when all report it.

        While weights are being pushed, ``weights_stable`` is cleared: new generation requests wait for it
        before they read ``loaded_version`` (see :meth:`generate_group`), so none is stamped with the old
        version (``cache_salt = policy-<old>``) and then queued behind the pause to run on the new weights,
        where it could reuse old-weight KV blocks under the old salt when ``reset_prefix_cache`` was refused.
        Requests already in flight keep their stamp (pause ``keep``: they finish on the new weights; the
        importance ratio corrects for it). The gate reopens once ``loaded_version`` names the new version; a
        failed update leaves it closed until a later check succeeds (the engines' weights are then unknown).
        """
        target = max(self.newest_published(), self.loaded_version)
        self.metrics.step.set(self.newest_published())
        engines, infos = await self._engine_versions(resolve_engines(self.endpoints))
        for url in sorted(self.out_of_service - set(engines)):  # its pod is gone (or restarts at the initial model)
            log.warning("engine %s, left out of service, is no longer among the engines: forgotten", url)
        self.out_of_service &= set(engines)
        self.metrics.engines_out_of_service.set(len(self.out_of_service))
        # Gone before its KV check ended: no longer pending. Its check is not cancelled (its hand-off, in a thread,
        # would go on outside the lock); it ends within its bound and marks nothing that a later round keeps.
        self.kv_pending &= set(engines)
        # An engine left paused by a failed update is always updated again (that is what resumes it).
        behind = [url for url, version in zip(engines, infos) if version != target or url in self.out_of_service]
        identity = self.transport.identity(target)
        if target > 0 and target == self.loaded_version and identity != self._loaded_identity:
            # The trainer re-published this version (it resumed from an older checkpoint): reload everywhere.
            log.info("weights %s were re-published: reloading every engine", step_name(target))
            behind = list(engines)
        joined = self._joiners(engines, infos, behind)
        if joined:
            self.kv_pending |= set(joined)
            self._record_serving()  # before the load: loaded, they must not turn ready until checked
        if behind:
            if target == 0:
                # Version 0 is the initial model every engine starts from: only name it.
                for url in behind:
                    async with VLLMAdmin(url) as admin:
                        await admin.update_weight_version(0)
            else:
                # Only engines that join (a new pod at the initial model) or were left paused are behind while
                # the others serve ``target`` already: generation goes on through those (the joining ones get
                # no traffic until their readiness says they serve it), and the autoscaler sees no update.
                serving_changes = target != self.loaded_version or len(behind) == len(engines)
                prefill = resolve_engines(self.prefill_endpoints) if self.prefill_endpoints else []
                # Never beside a joiner's KV hand-off: the update waits for the one in flight (at most 2 x
                # kv_handoff.HANDOFF_TIMEOUT_S), before it closes the generation gate.
                await self._handoff_lock().acquire()
                if serving_changes:
                    self.weights_stable.clear()
                    self.metrics.weight_update_in_flight.set(1)
                try:
                    updates = await update_engines(behind, target, self.transport, prefill=prefill,
                                                   previous=self.loaded_version if self.loaded_version >= 0 else None)
                except EngineError as err:
                    self._set_out_of_service(behind, err.out_of_service)
                    # the serving version stays; the readiness of an engine left paused turns it away
                    self._record_serving(self._recorded[0] if self._recorded else max(self.loaded_version, 0))
                    raise
                finally:
                    self._handoff_lock().release()
                    if serving_changes:
                        self.metrics.weight_update_in_flight.set(0)
                        self.metrics.last_resume_time.set(time.time())
                self._set_out_of_service(behind, ())
                for update in updates:
                    self.metrics.weight_updates.inc()
                    self.metrics.weight_update_seconds.observe(update.latency_ms / 1000.0)
                log.info("policy version %d loaded on %s in %s ms", target, ", ".join(behind),
                         ", ".join(f"{u.latency_ms:.0f}" for u in updates))
                append_jsonl(self.weight_updates_file, {
                    "version": target, "time": time.time(),
                    "latency_ms": {u.engine: round(u.latency_ms, 3) for u in updates},
                    "prefix_cache_reset": {u.engine: u.prefix_cache_reset for u in updates},
                    "reported_version": {u.engine: u.reported_version for u in updates}})
        self._loaded_identity = identity
        if target != self.loaded_version:
            self.loaded_version = target
            self.metrics.policy_version.set(target)
            self.version_changed.set()
            self.transport.retire(target)
        self._record_serving(target)
        self._start_kv_checks(sorted(self.kv_pending))  # the new joiners, and any whose check did not start or end
        self.weights_stable.set()
        return True

    async def _engine_versions(self, engines: Sequence[str]) -> tuple[list[str], list[int | None]]:
        """(engines, versions): each engine's ``GET /weight_info`` version (None: not an integer), leaving out
        the engines that refuse the connection while at least one other answers.

        Such an engine serves nothing (vLLM listens only once its engine is up): a prefill or decode pod still
        starting, which its Service publishes before it is ready; it is updated in the first round after it
        listens, and its readiness (``weights.update.get_readiness``) keeps it out of the router until then.

        Raises:
            EngineError, httpx.HTTPError: an engine that accepts connections failed to answer, or none answered.
        """
        results = await asyncio.gather(*(self._weight_info(url) for url in engines), return_exceptions=True)
        answered = [(url, r) for url, r in zip(engines, results) if not isinstance(r, BaseException)]
        failures = [(url, r) for url, r in zip(engines, results) if isinstance(r, BaseException)]
        for url, err in failures:
            if not isinstance(err, Exception) or not answered or not await self._refuses_connections(url):
                raise err
        starting = {url for url, _ in failures}
        for url in sorted(starting - self.not_listening):
            log.info("engine %s does not accept connections yet (starting): left out until it does", url)
        for url in sorted(self.not_listening - starting):
            log.info("engine %s accepts connections", url)
        self.not_listening = starting
        return [url for url, _ in answered], [version for _, version in answered]

    async def _refuses_connections(self, url: str) -> bool:
        """True when a connection to ``url`` is refused (nothing listens there); any answer or timeout: False."""
        try:
            await self._http().get(f"{url}/health", timeout=HEALTH_PROBE_TIMEOUT_S)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            return False
        return False

    def _record_serving(self, version: int | None = None) -> None:
        """Write the serving record (what a prefill or decode pod's readiness compares with: the version, the
        engines left out of service, the joiners whose KV hand-offs are pending) when it changed. ``version``
        None: the one last recorded, by this process or (after a restart) the one before it, else 0.

        Raises:
            OSError: the record could not be written (the next round writes it again).
        """
        if version is None:
            if self._recorded is not None:
                version = self._recorded[0]
            else:  # a restarted orchestrator: keep what the pods are ready against, never fall back to 0
                previous = read_serving_record(self.storage)
                version = previous.version if previous is not None else max(self.loaded_version, 0)
        record = (version, tuple(sorted(self.out_of_service)), tuple(sorted(self.kv_pending)))
        if record != self._recorded:
            write_serving_version(self.storage, version, self.out_of_service, self.kv_pending)
            self._recorded = record

    def _handoff_lock(self) -> asyncio.Lock:
        """The lock that keeps KV hand-offs and weight updates apart, for the running event loop (an asyncio
        lock, once waited on, belongs to one loop; tests drive one orchestrator from several)."""
        loop = asyncio.get_running_loop()
        if self._kv_lock is None or self._kv_lock[0] is not loop:
            self._kv_lock = (loop, asyncio.Lock())
        return self._kv_lock[1]

    def _joiners(self, engines: Sequence[str], versions: Sequence[int | None], behind: Sequence[str]) -> list[str]:
        """The engines of ``behind`` to check as joiners (P/D, once the start-up KV check ran, unless the local
        scaler owns membership: it checks its own joiners before it routes to them): those never checked, and
        those checked before that serve the initial model again after the run served a later version (a
        container restarted at the same address). Not those already pending or left out of service.
        ``versions``: the engines' reported versions, in the order of ``engines``."""
        if self.kv_checked is None or self._servers_file is not None or not self.prefill_endpoints:
            return []
        self.kv_checked &= set(engines)
        if self.loaded_version > 0:
            self.kv_checked -= {url for url, v in zip(engines, versions) if v is None or v == 0}
        return [url for url in behind
                if url not in self.kv_checked and url not in self.kv_pending and url not in self.out_of_service]

    def _start_kv_checks(self, pending: Sequence[str]) -> None:
        """Start :meth:`check_joined` for each of ``pending`` that has no check running."""
        self._kv_checks = {url: task for url, task in self._kv_checks.items() if not task.done()}
        for url in pending:
            if url not in self._kv_checks:
                self._kv_checks[url] = asyncio.create_task(self.check_joined(url), name=f"kv-check {url}")

    async def check_joined(self, url: str) -> None:
        """The first KV hand-offs of engine ``url``, which joined a running P/D run (a scale-up or a replaced
        pod) and was just loaded with the current version: one with every checked, in-service engine of the
        other pool (:func:`rlrun_runtime.kv_handoff.get_joined_pairs`), one at a time, each under the lock that
        keeps hand-offs and weight updates apart; the pairs are worked out again before each one, so a joiner
        whose check ended meanwhile is paired too. Until it ends the serving record lists ``url`` as
        KV-pending, so its readiness keeps the router away; then it counts as checked. A failed hand-off is
        logged and ends the wait all the same (decode recomputes what it cannot read). Each hand-off takes at
        most 2 x ``kv_handoff.HANDOFF_TIMEOUT_S`` (a weight update waits for the one in flight); it runs in a
        daemon thread, so a run that ends does not wait for it.

        Raises:
            OSError: the serving record could not be written (the next round writes it again).
        """
        try:
            prefill = await asyncio.to_thread(resolve_engines, self.prefill_endpoints)
        except (OSError, ValueError) as err:
            log.warning("KV hand-off check of joined engine %s skipped: %s", url, err)
            prefill = []
        done: set[tuple[str, str]] = set()
        while True:
            async with self._handoff_lock():
                serving = sorted((self.kv_checked or set()) - self.out_of_service)
                pairs = [pair for pair in get_joined_pairs(url, prefill, serving) if pair not in done]
                if not pairs:
                    break
                await _in_daemon_thread(_send_handoff_logged, *pairs[0])
                done.add(pairs[0])
        self.kv_pending.discard(url)
        if self.kv_checked is not None:
            self.kv_checked.add(url)
        self._record_serving()

    async def wait_kv_checks(self) -> None:
        """Wait for the joined engines' running KV checks (tests; the run cancels them when it ends)."""
        while tasks := [t for t in self._kv_checks.values() if not t.done()]:
            await asyncio.wait(tasks)

    def _set_out_of_service(self, updated: Sequence[str], left_paused: Sequence[str]) -> None:
        """Record which of the engines just ``updated`` a failed update left paused (``left_paused``)."""
        for url in left_paused:
            if url not in self.out_of_service:
                log.error("engine %s is left paused, out of service, until a later update resumes it", url)
        back = (self.out_of_service & set(updated)) - set(left_paused)
        for url in sorted(back):
            log.warning("engine %s is resumed and back in service", url)
        self.out_of_service = (self.out_of_service - set(updated)) | set(left_paused)
        self.metrics.engines_out_of_service.set(len(self.out_of_service))

    async def watchdog_loop(self) -> None:
        """Report engines that stop answering (see ``STALL_AFTER_S``); runs until cancelled.

        Every ``watchdog_poll_s`` each engine ``RLRUN_INFERENCE_ENDPOINTS`` resolves to gets a ``GET /health``
        probe (unless its previous probe is still waiting, up to ``HEALTH_PROBE_TIMEOUT_S``). Any HTTP answer
        counts as an answer (a dead engine's 503 is the weight loop's business); a timeout or a refused
        connection does not. Independent of the weight loop, so a stall in the middle of a reload is
        reported too. An engine the weight loop found refusing connections (``not_listening``: a prefill or
        decode pod still starting, published by its Service before it is ready) is not watched until it listens.
        """
        last_answer: dict[str, float] = {}
        last_problem: dict[str, str] = {}
        warned: dict[str, float] = {}
        probes: dict[str, asyncio.Task] = {}
        client = httpx.AsyncClient(timeout=min(HEALTH_PROBE_TIMEOUT_S, max(self.stall_after_s, 0.1)))

        async def probe(url: str) -> None:
            try:
                await client.get(f"{url}/health")
            except httpx.HTTPError as err:
                last_problem[url] = f"{type(err).__name__}"
            else:
                last_answer[url] = time.monotonic()

        try:
            while True:
                try:
                    engines = resolve_engines(self.endpoints)
                except (OSError, ValueError):
                    engines = list(last_answer)  # keep watching what we knew
                now = time.monotonic()
                for url in list(last_answer):
                    if url not in engines:  # gone from the Service: nothing to watch any more
                        last_answer.pop(url)
                        warned.pop(url, None)
                        self.stalled.pop(url, None)
                for url in engines:
                    if url in self.not_listening:  # a pod still starting (nothing listens): not a stall
                        last_answer.pop(url, None), warned.pop(url, None), self.stalled.pop(url, None)
                        continue
                    last_answer.setdefault(url, now)
                    if url not in probes or probes[url].done():
                        probes[url] = asyncio.create_task(probe(url))
                    silent = now - last_answer[url]
                    if silent >= self.stall_after_s:
                        if url not in warned or now - warned[url] >= STALL_REPEAT_S:
                            warned[url] = now
                            log.warning("engine %s has not answered for %.1f s (GET /health: %s)%s", url, silent,
                                        last_problem.get(url, "no answer"),
                                        "" if self.weights_stable.is_set() else "; a weight update is in flight")
                        self.stalled[url] = last_answer[url]
                    elif url in self.stalled:
                        log.warning("engine %s answers again after %.1f s without an answer", url,
                                    last_answer[url] - self.stalled.pop(url))
                        warned.pop(url, None)
                self.metrics.stalled_engines.set(len(self.stalled))
                await asyncio.sleep(self.watchdog_poll_s)
        finally:
            for task in probes.values():
                task.cancel()
            await asyncio.gather(*probes.values(), return_exceptions=True)
            await client.aclose()

    @property
    def weight_updates_file(self) -> Path:
        """``orchestrator/weight-updates.jsonl``: one line per update (version, per-engine pause->resume ms)."""
        return self.storage.orchestrator_state.parent / "weight-updates.jsonl"

    async def _weight_info(self, url: str) -> int | None:
        async with VLLMAdmin(url, timeout_s=10, retries=1) as admin:
            return parse_version(await admin.weight_info())

    async def weight_loop(self) -> None:
        """Keep the engines on the newest published weights until version maxSteps is loaded."""
        failures = 0
        while True:
            try:
                await self.sync_weights_once()
                failures = 0
            except (EngineError, OSError, ValueError, httpx.HTTPError) as err:
                failures += 1
                self.metrics.weight_update_failures.inc()
                log.warning("weight sync failed (%d in a row): %s", failures, err)
                if failures >= MAX_WEIGHT_FAILURES:
                    raise OrchestratorError(f"weight updates failed {failures} times in a row: {err}") from err
            if self.loaded_version >= self.view.max_steps:
                return
            if failures:
                await asyncio.sleep(self.poll_s * min(2**failures, 50))
            else:
                await self.wait_for_publish(self.poll_s)

    async def wait_for_publish(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, returning early (True) once the trainer publishes a newer version.

        The transport is asked every ``PUBLISH_POLL_S`` (for the filesystem: a directory listing), so a new version
        reaches the engines within ~``PUBLISH_POLL_S`` instead of up to a whole ``poll_s``: with
        maxAsyncLevel 1 the next batch waits for that load, and the trainer for that batch.
        """
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.newest_published() > self.loaded_version:
                return True
            await asyncio.sleep(min(PUBLISH_POLL_S, left))
        return False

    # --- the trainer's wait for data ----------------------------------------------------------------
    async def trainer_wait_loop(self, poll_s: float = TRAINER_POLL_S) -> None:
        """Count the trainer's wait for data into ``METRIC_DATA_WAIT_SECONDS`` (how, and why so: the
        ``data_wait`` paragraph of :class:`OrchestratorMetrics`); runs until cancelled.

        Every ``poll_s`` the new complete lines of the trainer's ``metrics.jsonl`` are read (by byte offset;
        from the start again when the file was replaced or shrank, as a resumed trainer truncates it). Lines
        present when the orchestrator started are not counted, but the newest tells which batch the trainer
        needs next.
        """
        tail = FileTail(self.storage.metrics_file)
        counted_through, first = 0, True
        while True:
            records, _ = parse_trainer_waits(tail.read()[0])
            if records:
                self._note_trainer_steps(records, counted_through, count=not first)
                counted_through = max(counted_through, max(step for step, _ in records))
            first = False
            await asyncio.sleep(poll_s)

    def _note_trainer_steps(self, records: Sequence[tuple[int, float]], counted_through: int, count: bool) -> None:
        """New ``(step, wait_seconds)`` lines of the trainer: confirm their waits (when ``count``) and, if the
        batch after the newest step is missing, count the trainer as waiting for it from now on."""
        now = time.monotonic()
        clock = self.metrics.data_wait
        clock.stop(now, keep=False)  # a provisional wait: the trainer's own figure replaces it
        if count:
            clock.add(count_new_waits(records, counted_through)[0])
        needs = records[-1][0] + 1
        self.trainer_needs = needs
        if needs <= self.view.max_steps and not self.storage.rollout_batch(needs).is_file():
            clock.start(now)

    # --- generation ---------------------------------------------------------------------------------
    def next_task_indices(self, cursor: int, count: int) -> tuple[list[int], int]:
        """The next ``count`` training task indices from ``cursor`` and the new cursor: consecutive ones, or
        with evaluation on those whose prompt is not held out (skips counted in
        ``METRIC_DROPPED_PROMPTS{reason=held_out}``; :meth:`rlrun_runtime.evaluation.HeldOutTasks.training_indices`)."""
        if self.held_out is None:
            return list(range(cursor, cursor + count)), cursor + count
        try:
            indices, cursor, skipped = self.held_out.training_indices(cursor, count)
        except EvaluationSpecError as err:  # nothing left to train on: the run cannot learn
            raise NoLearningSignalError(str(err)) from err
        if skipped:
            self.metrics.dropped_prompts.labels(constants.DROPPED_PROMPT_HELD_OUT).inc(skipped)
        return indices, cursor

    def _completion_url(self, engines: Sequence[str], start: int, attempt: int = 0) -> str:
        """The router's completions URL, or without a router engine ``start + attempt`` (round robin)."""
        if self.router_url:
            return f"{self.router_url}/v1/completions"
        return f"{engines[(start + attempt) % len(engines)]}/v1/completions"

    async def _complete(self, body: dict[str, Any], engines: Sequence[str]) -> list[dict[str, Any]]:
        """POST one completions request (retried on transport errors, timeouts and 5xx, each attempt to the
        next engine when there is no router); its choices in index order, as the server sent them
        (:func:`parse_completion_choice` turns each into a completion or None).

        Raises:
            OrchestratorError: still failing after ``REQUEST_RETRIES`` retries; any other answer than 2xx or 5xx
                (4xx, or a redirect, which is not followed; not retried); a 2xx answer that is not a completions
                JSON document; fewer choices than ``n``.
        """
        last = ""
        start = next(self._round_robin)
        for attempt in range(REQUEST_RETRIES + 1):
            url = self._completion_url(engines, start, attempt)
            try:
                async with self._completions().post(url, json=body, allow_redirects=False) as response:
                    status, raw = response.status, await response.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:  # refused, reset, timed out
                last = f"POST {url}: {type(err).__name__}: {err}"
            else:
                if 200 <= status < 300:
                    try:
                        choices = sorted(json.loads(raw)["choices"], key=lambda c: int(c.get("index", 0)))
                    except (ValueError, KeyError, TypeError, AttributeError) as err:
                        raise OrchestratorError(f"POST {url}: HTTP {status} but not a completions answer "
                                                f"({type(err).__name__}: {err}): {raw[:200]!r}") from err
                    if len(choices) != int(body["n"]):
                        raise OrchestratorError(f"asked for n={body['n']} completions, got {len(choices)}")
                    return [choice if isinstance(choice, dict) else {} for choice in choices]
                text = raw.decode("utf-8", "replace")[:200]
                if status < 500:
                    raise OrchestratorError(f"POST {url}: HTTP {status}: {text}")
                last = f"POST {url}: HTTP {status}: {text}"
            await asyncio.sleep(0.5 * 2**attempt)
        raise OrchestratorError(f"completion request failed after {REQUEST_RETRIES + 1} attempts: {last}")

    async def engines(self) -> list[str]:
        """The engines' base URLs, waiting (logged) while the endpoints do not resolve (e.g. no ready pod)."""
        for attempt in itertools.count(1):
            try:
                engines = resolve_engines(self.endpoints)
            except (OSError, ValueError) as err:
                engines, problem = [], str(err)
            else:
                problem = "no address"
            if engines:
                return engines
            if attempt == 1 or attempt % 10 == 0:
                log.warning("%s do not resolve (attempt %d): %s", self.endpoints, attempt, problem)
            await asyncio.sleep(min(5.0, 0.5 * attempt))
        raise AssertionError("unreachable")

    async def generate_group(self, task_index: int, engines: Sequence[str]) -> Group | None:
        """Sample ``rolloutsPerPrompt`` completions of task ``task_index`` and score them.

        One completions request with ``n = rolloutsPerPrompt`` and seed s; with prefill/decode
        disaggregation, ``rolloutsPerPrompt`` requests with ``n: 1`` and seeds s + i (the same samples:
        vLLM gives choice i the seed s + i). The group is stamped with ``loaded_version`` read once no weight
        update is in flight (``weights_stable``). Broken choices (:func:`get_choice_problem`) are dropped and
        counted in the group (``dropped_samples``: logprobs, ``dropped_bad_token_ids``); a scorer that raises
        gives a NaN reward and is counted (``scorer_errors``); truncated completions keep their
        ``finish_reason`` and are counted in ``METRIC_TRUNCATED_ROLLOUTS``. Returns None when the prompt
        leaves no room for a completion within maxModelLen (counted: ``METRIC_DROPPED_PROMPTS{reason=too_long}``).
        """
        task = self.env.task(task_index)
        prompt_ids, prompt_text = render_prompt(self.tokenizer, task.prompt)
        max_tokens = min(self.view.max_tokens, self.view.max_model_len - len(prompt_ids))
        if max_tokens < 1:
            log.warning("task %d: prompt of %d tokens leaves no room under maxModelLen %d; skipped",
                        task_index, len(prompt_ids), self.view.max_model_len)
            self.metrics.dropped_prompts.labels("too_long").inc()
            return None
        # Never stamp a new request while a weight update is in flight (sync_weights_once): it would carry
        # the old version but run on the new weights. Nothing else is waited for: generation overlaps training.
        await self.weights_stable.wait()
        version = self.loaded_version
        # One request with n = rolloutsPerPrompt (vLLM samples choice i with seed + i) instead of n HTTP
        # requests; n requests of n: 1 with seeds seed + i when disaggregated: the same samples either way.
        group_size, per_request = self.view.rollouts_per_prompt, self.choices_per_request
        seed = self.seed_rng.randrange(2**31 - group_size)
        bodies = [get_completion_request(prompt_ids, self.sampling, max_tokens, version, seed=seed + first,
                                         n=per_request) for first in range(0, group_size, per_request)]
        answers = await asyncio.gather(*(self._complete(body, engines) for body in bodies))
        choices = [choice for answer in answers for choice in answer]
        problems = [get_choice_problem(choice) for choice in choices]
        completions = [c for c in map(parse_completion_choice, choices) if c is not None]
        bad_logprobs, bad_token_ids = problems.count(BAD_LOGPROBS), problems.count(BAD_TOKEN_IDS)
        if bad_token_ids:
            log.warning("task %d: %d of %d completions without usable token_ids dropped", task_index,
                        bad_token_ids, len(choices))
        rewards = []
        scorer_errors, last_error = 0, None
        for completion in completions:
            try:
                rewards.append(float(self.env.score(task, completion.text)))
            except Exception as err:  # a broken scorer: NaN reward, dropped and counted at assembly
                scorer_errors += 1
                last_error = f"{type(err).__name__}: {err}"
                rewards.append(math.nan)
        if scorer_errors:
            log.warning("task %d: scorer failed for %d of %d completions: %s", task_index, scorer_errors,
                        len(completions), last_error)
            self.metrics.scorer_errors.inc(scorer_errors)
        self.metrics.rollouts.inc(len(completions))
        self.metrics.tokens.inc(sum(len(c.token_ids) for c in completions))
        if truncated := sum(c.truncated for c in completions):
            self.metrics.truncated_rollouts.inc(truncated)
        for reason, count in ((BAD_LOGPROBS, bad_logprobs), (BAD_TOKEN_IDS, bad_token_ids)):
            if count:
                self.metrics.dropped_samples.labels(reason).inc(count)
        return Group(task_index, prompt_ids, prompt_text, version, completions, rewards, bad_logprobs,
                     dropped_bad_token_ids=bad_token_ids, scorer_errors=scorer_errors, last_scorer_error=last_error)

    async def make_batch(self, step: int, cursor: int) -> tuple[dict[str, Any], int]:
        """Generate and assemble batch ``step`` starting at task ``cursor``; returns (batch, new cursor).

        Besides :func:`assemble_batch`'s keys the batch counts what its generation rounds saw:
        ``generated_rollouts`` (choices received), ``dropped_bad_logprob_samples``,
        ``dropped_bad_token_ids_samples``, ``scorer_errors`` (+ ``last_scorer_error``), ``dropped_long_prompts``,
        ``prompts_requested`` (tasks drawn: with ``dropped_long_prompts`` equal to it, every prompt was too
        long) and ``leftover_groups`` (generated groups that did not fit, carried to the next batch, where the
        ones too old for it are dropped as stale).
        """
        started = time.monotonic()
        view = self.view
        candidates = list(self.leftover)
        assembled = None
        dropped_bad = bad_token_ids = scorer_errors = generated = long_prompts = requested = 0
        last_error: str | None = None
        for round_index in range(MAX_ROUNDS_PER_BATCH):
            assembled = assemble_batch(step, candidates, batch_size=view.batch_size,
                                       max_off_policy_steps=view.max_off_policy_steps,
                                       std_normalize=view.advantage_std_normalization, truncation=view.truncation)
            if assembled.num_samples > view.batch_size - view.rollouts_per_prompt:
                break
            missing_groups = plan_group_count(view.batch_size - assembled.num_samples, view.rollouts_per_prompt,
                                              1.0 if self.signal_rate is None else self.signal_rate)
            engines = await self.engines()
            indices, cursor = self.next_task_indices(cursor, missing_groups)
            groups = await asyncio.gather(*(self.generate_group(i, engines) for i in indices))
            new = [g for g in groups if g is not None]
            requested += len(indices)
            long_prompts += len(groups) - len(new)
            dropped_bad += sum(g.dropped_samples for g in new)
            bad_token_ids += sum(g.dropped_bad_token_ids for g in new)
            scorer_errors += sum(g.scorer_errors for g in new)
            generated += sum(len(g.completions) + g.dropped_samples + g.dropped_bad_token_ids for g in new)
            last_error = next((g.last_scorer_error for g in reversed(new) if g.last_scorer_error), last_error)
            candidates.extend(new)
        else:
            assembled = assemble_batch(step, candidates, batch_size=view.batch_size,
                                       max_off_policy_steps=view.max_off_policy_steps,
                                       std_normalize=view.advantage_std_normalization, truncation=view.truncation)
        assert assembled is not None
        looked_at = len(assembled.used_groups) + assembled.dropped_zero_advantage_groups
        if looked_at:  # share of groups with a learning signal, smoothed over batches
            rate = len(assembled.used_groups) / looked_at
            self.signal_rate = rate if self.signal_rate is None else 0.5 * (self.signal_rate + rate)
        self.leftover = assembled.leftover
        batch = assembled.batch
        batch["dropped_bad_logprob_samples"] = dropped_bad
        batch["dropped_bad_token_ids_samples"] = bad_token_ids
        batch["dropped_long_prompts"] = long_prompts
        batch["prompts_requested"] = requested
        batch["leftover_groups"] = len(assembled.leftover)
        batch["generated_rollouts"] = generated
        batch["scorer_errors"] = scorer_errors
        batch["last_scorer_error"] = last_error
        batch["generation_seconds"] = round(time.monotonic() - started, 3)
        batch["prompt_cursor"] = cursor
        for reason, count in (("stale", assembled.dropped_stale_groups),
                              ("zero_advantage", assembled.dropped_zero_advantage_groups),
                              ("small", assembled.dropped_small_groups)):
            if count:
                self.metrics.dropped_groups.labels(reason).inc(count)
        if assembled.dropped_nonfinite_rewards:
            self.metrics.dropped_samples.labels("nonfinite_reward").inc(assembled.dropped_nonfinite_rewards)
        if assembled.dropped_truncated_samples:
            self.metrics.dropped_samples.labels("truncated").inc(assembled.dropped_truncated_samples)
        self._write_samples(step, assembled.used_groups)
        return batch, cursor

    def _write_samples(self, step: int, groups: Sequence[Group]) -> None:
        written = 0
        for group in groups:
            for completion, reward in zip(group.completions, group.rewards):
                if written >= SAMPLES_PER_STEP:
                    return
                append_jsonl(self.storage.rollout_samples_file, {
                    "step": step, "policy_version": group.policy_version, "task_index": group.task_index,
                    "prompt": group.prompt_text, "completion": completion.text, "reward": reward,
                    "finish_reason": completion.finish_reason})
                written += 1

    def get_empty_batch_streak(self, step: int, batch: Mapping[str, Any], streak: int) -> int:
        """The count of consecutive batches without a sample once batch ``step`` is added (0 if it has one).

        Args:
            step: the batch's trainer step.
            batch: the batch from :meth:`make_batch`.
            streak: consecutive empty batches before this one.

        Raises:
            NoLearningSignalError: the batch is empty and every prompt drawn for it was too long for
                ``model.maxModelLen``; or it is the ``maxEmptyBatches``-th empty batch in a row, or the last
                batch of a run whose every batch was empty (``maxEmptyBatches: 0`` never fails for empty
                batches). The message names ``spec.environment`` and the reason from the batch's counters.
        """
        if batch["samples"]:
            self.metrics.empty_batch_streak.set(0)
            return 0
        streak += 1
        self.metrics.empty_batch_streak.set(streak)
        environment = self.view.environment.describe()
        requested, too_long = int(batch.get("prompts_requested") or 0), int(batch.get("dropped_long_prompts") or 0)
        if requested and too_long == requested:
            raise NoLearningSignalError(
                f"batch {step_name(step)}: all {requested} prompts drawn from environment {environment} were too "
                f"long for model.maxModelLen {self.view.max_model_len} (no room left for a completion); nothing "
                "can be trained. Shorten the environment's prompts or raise model.maxModelLen")
        reason = get_empty_batch_reason(batch)
        limit = self.view.max_empty_batches
        # A run shorter than the limit must not end "Succeeded" with nothing but empty batches either.
        if limit and (streak >= limit or (step == self.view.max_steps and streak >= step)):
            raise NoLearningSignalError(
                f"{streak} consecutive batches without a trainable sample (steps {step - streak + 1}..{step}, "
                f"algorithm.maxEmptyBatches {limit}); environment {environment}: {reason}. Fix the environment "
                "or its scorer, or set algorithm.maxEmptyBatches: 0 to go on regardless")
        log.warning("batch %s has no trainable sample (%d in a row, the run fails at %s): environment %s: %s",
                    step_name(step), streak, limit or "never", environment, reason)
        return streak

    async def batch_loop(self, next_step: int, cursor: int, empty_streak: int = 0) -> None:
        """Write batches ``next_step`` .. maxSteps, each once the async gate lets it be generated.

        ``empty_streak``: consecutive empty batches just before ``next_step`` (resumed from storage, so a
        restarted orchestrator does not start counting again). The batch that reaches
        ``algorithm.maxEmptyBatches`` is not written (:meth:`get_empty_batch_streak` raises).
        """
        for step in range(next_step, self.view.max_steps + 1):
            waited = time.monotonic()
            self.metrics.gate_wait.start(waited)
            try:
                while self.loaded_version < 0 or not may_generate(step, self.loaded_version,
                                                                  self.view.max_async_level):
                    self.version_changed.clear()
                    await self.version_changed.wait()
            finally:
                self.metrics.gate_wait.stop(time.monotonic())
            waited = time.monotonic() - waited
            batch, cursor = await self.make_batch(step, cursor)
            batch["gate_wait_seconds"] = round(waited, 3)  # inference idle, waiting for newer weights
            empty_streak = self.get_empty_batch_streak(step, batch, empty_streak)
            batch["empty_batch_streak"] = empty_streak
            atomic_write_json(self.storage.rollout_batch(step), batch)
            if step == self.trainer_needs:  # the trainer's wait ends here; its own figure follows in metrics.jsonl
                self.metrics.data_wait.stop(time.monotonic(), keep=False)
            atomic_write_json(self.storage.orchestrator_state, {"next_step": step + 1, "prompt_cursor": cursor,
                                                                "empty_batch_streak": empty_streak})
            self.metrics.batch_step.set(step)
            if batch["reward_mean"] is not None:
                self.metrics.last_reward.set(batch["reward_mean"])
            log.info("batch %s: %d samples, reward_mean %s, policy versions %s, dropped stale/zero/small %d/%d/%d, "
                     "truncated %d, %.2f s",
                     step_name(step), len(batch["samples"]), batch["reward_mean"], batch["policy_versions"],
                     batch["dropped_stale_groups"], batch["dropped_zero_advantage_groups"],
                     batch["dropped_small_groups"], batch["truncated_rollouts"], batch["generation_seconds"])

    # --- the whole run ------------------------------------------------------------------------------
    def _read_resume_files(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        state = None
        if self.storage.orchestrator_state.is_file():
            state = json.loads(self.storage.orchestrator_state.read_text(encoding="utf-8"))
        steps = list_steps(self.storage.rollouts_dir)
        last = json.loads(self.storage.rollout_batch(steps[-1]).read_text(encoding="utf-8")) if steps else None
        return state, last

    async def check_kv_handoffs(self, engines: Sequence[str]) -> None:
        """Under prefill/decode disaggregation, before the weight loop and the first batch: one KV hand-off from
        every prefill engine to every decode engine among ``engines`` (the healthy engines' base URLs),
        sent straight to them (:func:`rlrun_runtime.kv_handoff.send_handoff`). A pair's first NIXL connection
        can outlast the prefill's KV lease on CPU (benchmarks/README.md); without this the first rollouts
        wait for it and may read KV blocks already freed. Decode engines are checked at once, the prefill
        engines of one decode engine one after another (its counters then count one hand-off). Takes at most
        2 x ``kv_handoff.HANDOFF_TIMEOUT_S`` per prefill engine. A hand-off that fails is logged and the run
        goes on: decode recomputes what it cannot read. Raises nothing."""
        try:
            prefill = set(resolve_engines(self.prefill_endpoints)) & set(engines)
        except (OSError, ValueError) as err:
            log.warning("KV hand-off check skipped: %s", err)
            return
        pairs = get_handoff_pairs(sorted(prefill), engines)
        by_decode: dict[str, list[str]] = {}
        for p, d in pairs:
            by_decode.setdefault(d, []).append(p)

        def check(decode: str, producers: list[str]) -> None:
            for p in producers:
                _send_handoff_logged(p, decode)

        await asyncio.gather(*(asyncio.to_thread(check, d, ps) for d, ps in by_decode.items()))
        self.kv_checked = set(engines)  # engines that appear from now on are joiners (check_joined)

    def load_resume_point(self) -> tuple[int, int]:
        """(next step, prompt cursor) from storage: see :func:`get_resume_point`."""
        return get_resume_point(*self._read_resume_files())

    def load_empty_batch_streak(self) -> int:
        """Consecutive empty batches before the resume point: see :func:`get_resume_empty_streak`."""
        return get_resume_empty_streak(*self._read_resume_files())

    async def run(self) -> int:
        """Run until version maxSteps is loaded on every engine; returns the exit code (0)."""
        try:
            healthy = await self.wait_healthy(router=False)
            if self.prefill_endpoints:
                await self.check_kv_handoffs(healthy)  # before the weight loop: no update pauses them meanwhile
            next_step, cursor = self.load_resume_point()
            log.info("starting at batch %d, prompt cursor %d (maxSteps %d, maxAsyncLevel %d, maxOffPolicySteps %d)",
                     next_step, cursor, self.view.max_steps, self.view.max_async_level,
                     self.view.max_off_policy_steps)
            # The weight loop starts before the router is waited for: under P/D in a cluster the router adds a
            # pod only once it is Ready, i.e. serves the version this loop loads and records (the readiness of
            # prefill and decode pods, weights.update.get_readiness).
            weights = asyncio.create_task(self.weight_loop(), name="weights")
            watchdog = asyncio.create_task(self.watchdog_loop(), name="watchdog")
            trainer_wait = asyncio.create_task(self.trainer_wait_loop(), name="trainer-wait")
            batches = evaluation = tracking = None
            try:
                if self.router_url:
                    await _first(self.wait_healthy(), weights)  # a failing weight loop ends the wait
                batches = asyncio.create_task(self.batch_loop(next_step, cursor, self.load_empty_batch_streak()),
                                              name="batches")
                evaluation = self.evaluator.start() if self.evaluator else None  # spec.evaluation
                tracking = asyncio.create_task(self.tracker.loop(), name="tracking") if self.tracker else None
                await asyncio.gather(batches, weights)  # the first failure of either ends the run
                if self.evaluator:
                    await self.evaluator.finish()  # the final policy's evaluation
            finally:
                for task in (weights, batches, watchdog, trainer_wait, evaluation, tracking, *self._kv_checks.values()):
                    if task is None:
                        continue
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if self.tracker:
                await self.tracker.finish(self.view.max_steps)  # the trainer's last lines, then close
            log.info("policy version %d loaded on every engine: run complete", self.loaded_version)
            return 0
        finally:
            if self.tracker:
                self.tracker.close()
            await self.aclose()


async def _in_daemon_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread (unlike ``asyncio.to_thread``, a loop that ends does not wait for it);
    its result or error comes back to the awaiting task. Cancelling the await leaves the thread running."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(error: BaseException | None, value: Any) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task
            value, error = None, err
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, error, value)

    threading.Thread(target=run, name=f"rlrun-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future


def _send_handoff_logged(prefill: str, decode: str) -> None:
    """One KV hand-off (:func:`rlrun_runtime.kv_handoff.send_handoff`), its outcome logged; raises nothing."""
    try:
        outcome = send_handoff(prefill, decode, HANDOFF_TIMEOUT_S)
    except Exception as err:  # HandoffError, or anything else: logged, the run goes on
        log.warning("KV hand-off %s -> %s failed: %s", prefill, decode, err)
        return
    if outcome.ok:
        log.info("KV hand-off %s -> %s read over NIXL in %.1f s", prefill, decode, outcome.seconds)
    else:
        log.warning("KV hand-off %s -> %s not read over NIXL (%.0f transfers, %.0f failed) in %.1f s",
                    prefill, decode, outcome.transfers, outcome.failed, outcome.seconds)


async def _first(awaitable: Any, task: asyncio.Task) -> None:
    """Await ``awaitable``; if ``task`` ends first, raise its error (or return if it ended without one, after
    still awaiting ``awaitable``)."""
    waiter = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
        if task.done() and not waiter.done() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        await waiter
    finally:
        if not waiter.done():
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter


@role_main("orchestrator")
def main(argv: list[str]) -> int:
    """Parse ``--config``, read the env (see docs/runtime-contract.md) and run the loop.

    Exit codes: 0 when the run is complete, 2 on bad input (spec, environment, env vars), 3 when batches
    carry nothing to train on (:class:`NoLearningSignalError`), 1 on other failures.
    """
    parser = argparse.ArgumentParser(prog="rlrun-runtime orchestrator", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the RLRun YAML")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s orchestrator %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    env = os.environ
    spec = load_spec(ns.config)
    try:
        view = OrchestratorView.from_spec(spec)
    except ValueError as err:  # a malformed spec.environment (the message names the field)
        raise RoleConfigError(str(err)) from err
    storage = RunStorage(env_required(env, constants.ENV_STORAGE_DIR))
    endpoints = env_list(env, constants.ENV_INFERENCE_ENDPOINTS, "host:port of the inference servers")
    prefill_endpoints = (env_list(env, constants.ENV_PREFILL_ENDPOINTS, "host:port of the prefill servers")
                         if env.get(constants.ENV_PREFILL_ENDPOINTS, "").strip() else [])
    metrics_port = env_port(env, constants.ENV_METRICS_PORT, constants.ORCHESTRATOR_METRICS_PORT)
    from rlrun_runtime.environments import EnvironmentSpecError, load_environment

    try:
        environment = load_environment(view.environment)
    except EnvironmentSpecError as err:
        raise RoleConfigError(str(err)) from err
    from transformers import AutoTokenizer

    from rlrun_runtime.tiny_model import ensure_model

    model = ensure_model(view.model_name, storage)
    revision = view.model_revision if model == view.model_name else None
    tokenizer = AutoTokenizer.from_pretrained(model, revision=revision)
    try:  # spec.evaluation's held-out tasks and spec.tracking's sinks: bad input, exit 2, before serving
        held_out = HeldOutTasks(environment, view.evaluation.prompts) if view.evaluation else None
        tracker = build_tracker(view.tracking, storage, run_name=env.get(constants.ENV_RUN_NAME, "").strip() or "rlrun",
                                config=OrchestratorView.project(spec))
    except (EvaluationSpecError, TrackingSetupError) as err:
        raise RoleConfigError(str(err)) from err
    metrics = OrchestratorMetrics(view.max_steps)
    server, _ = metrics.serve(metrics_port, addr=env_bind_host(env))
    orchestrator = Orchestrator(view, storage, environment, tokenizer, endpoints,
                                env.get(constants.ENV_ROUTER_URL, "").strip() or None, metrics,
                                prefill_endpoints=prefill_endpoints,
                                servers_file=env.get(constants.ENV_LOCAL_SERVERS_FILE, "").strip() or None,
                                held_out=held_out, tracker=tracker)
    try:
        return asyncio.run(orchestrator.run())
    except NoLearningSignalError as err:
        # One "rlrun-runtime orchestrator: ..." line: `rlrun local` prints it as the failed role's cause; in a
        # pod the termination message carries it into the pod status (docs/orchestrator.md).
        print_role_error("orchestrator", err)
        write_termination_message(str(err))
        return EXIT_NO_SIGNAL
    except OrchestratorError as err:
        log.error("%s", err)
        write_termination_message(str(err))
        return 1
    finally:
        server.shutdown()
