"""The kopf handlers of the RLRun operator (thin: the work is in reconcile.py).

``get_registry(config)`` builds a fresh kopf registry, so the operator can be embedded (tests, benchmark) with
its own settings (:class:`rlrun_operator.config.OperatorConfig`). kopf's memo is an
:class:`rlrun_operator.memo.OperatorMemo`: ``config``, ``api``, ``http`` and ``clock`` shared by the runs, and
each run's own :class:`rlrun_operator.reconcile.RunState` in ``run``. Handlers:
- startup: kopf settings (finalizer and annotation prefix under rlrun.dev, timeouts from the config, Events
  only for warnings), the API client in ``memo.api`` unless the embedder put one there, an HTTP session for
  scrapes; ``memo.config`` is the embedder's when it gave one, else the registry's.
- create / update (spec only) / resume: reconcile the children, then write the status; update also prunes
  children the render no longer produces. A semantically invalid spec writes Ready=False reason InvalidSpec
  and one Warning Event, and creates nothing.
- timer (every ``config.status_interval_s`` seconds): refresh the status from children and metrics (and,
  for a run with spec.autoscaling.enabled, one autoscaler decision per scrapeIntervalSeconds:
  ``reconcile.run_autoscaler``; the clock is ``memo.clock``, time.time unless an embedder set one), then do
  what ``reconcile.plan_after_refresh`` decides (finish: give a finished run's GPUs back; drift: recreate a
  missing child). kopf puts its finalizer (constants.FINALIZER) on served RLRuns because of it. A refresh in
  flight when the operator stops (SIGTERM) is cancelled (``run_unless_stopped``), so the operator exits
  within ``config.stop_timeout_s`` without orphaning it.
- delete (optional, no finalizer of its own): forget the run's metric series.

Status writes: the handlers and the timer of one run run concurrently in kopf, so each status write holds
a per-run lock, reads the RLRun afresh, computes the wanted status against that fresh status and sends a
merge patch to the status subresource only when something changed (an idle resync writes nothing).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import aiohttp
import kopf

from rlrun_api import constants, validation
from rlrun_operator import metrics
from rlrun_operator.apply import ApplyConflict
from rlrun_operator.config import OperatorConfig
from rlrun_operator.kubeapi import ApiError, KubeApi, load_api_client
from rlrun_operator.memo import OperatorMemo, complete_memo, get_run_state
from rlrun_operator.observe import read_workloads
from rlrun_operator.reconcile import (StatusChange, get_rlrun, get_workloads, plan_after_refresh,
                                      plan_status, reconcile_run, refresh_run)
from rlrun_operator.status import PHASE_FAILED, REASON_INVALID_SPEC

RESOURCE = (constants.GROUP, constants.VERSION, constants.PLURAL)


def _invalid_already_reported(rlrun: dict[str, Any], invalid: list[str]) -> bool:
    for cond in (rlrun.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("reason") == REASON_INVALID_SPEC and cond.get("message") == "; ".join(invalid)
    return False


async def publish_status(memo: OperatorMemo, namespace: str, name: str,
                         compute: Callable[[dict[str, Any]], Awaitable[StatusChange]],
                         current: dict[str, Any] | None = None) -> None:
    """Under the run's lock: GET the RLRun (unless ``current`` is known to be the latest, as in the create
    handler, before anything else wrote a status), ``compute`` the change against it, write it to the
    status subresource when not empty, count the phase, post an Event on a phase transition."""
    async with get_run_state(memo).status_lock:
        fresh = current if current is not None else await memo.api.get(constants.KIND, namespace, name)
        if fresh is None or fresh.get("metadata", {}).get("deletionTimestamp"):
            return
        change = await compute(fresh)
        if change.patch:
            await memo.api.merge_patch(constants.KIND, namespace, name, {"status": change.patch},
                                       subresource="status")
        metrics.set_run_phase(namespace, name, change.new_phase)
        metrics.set_run_conditions(namespace, name, change.patch.get("conditions")
                                   or (fresh.get("status") or {}).get("conditions"))
        for event_type, reason, message in change.events:  # the autoscaler's (reconcile.plan_scaling)
            kopf.event(fresh, type=event_type, reason=reason, message=message)
        if change.old_phase != change.new_phase:
            kopf.event(fresh, type="Warning" if change.new_phase == PHASE_FAILED else "Normal",
                       reason=change.new_phase, message=f"phase {change.old_phase or 'none'} -> {change.new_phase}")


async def run_unless_stopped(work: Awaitable[None], stopped: kopf.DaemonStopped) -> None:
    """Await ``work`` (one status refresh); when kopf's stopper fires first (the operator is exiting, or
    the run is being deleted), cancel it and return.

    kopf never cancels a timer: on exit it sets the stopper and, if the timer is still running, leaves it
    orphaned ("did not exit in time") and goes on to the cleanup handlers, which close the HTTP session
    the refresh scrapes with ("Session is closed"). A refresh cancelled here writes nothing more; the next
    operator's resume and timer redo it.
    """
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if not stopped:  # cancelled from outside, not by the stopper: let kopf see it
            raise


def get_registry(config: OperatorConfig | None = None, login: bool = True) -> kopf.OperatorRegistry:
    """A kopf registry with every handler of the operator.

    Args:
        config: the operator's settings (default: ``OperatorConfig.from_env()``); an embedder's
            ``memo.config`` wins at startup, but the timer interval and retry backoff are fixed here.
        login: log in like `kopf run` (kopf's own in-cluster service account, else KUBECONFIG login);
            False leaves it to the embedder, who adds an ``@kopf.on.login`` handler to the registry.
    """
    config = config or OperatorConfig.from_env()
    registry = kopf.OperatorRegistry()

    if login:
        @kopf.on.login(registry=registry)
        def log_in(**kwargs: Any) -> kopf.ConnectionInfo | None:
            return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
        settings.persistence.finalizer = constants.FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=constants.ANNOTATION_PREFIX, key="last-handled-configuration")
        complete_memo(memo, config)
        settings.watching.server_timeout = memo.config.watch_server_timeout_s
        settings.watching.client_timeout = memo.config.watch_client_timeout_s
        settings.watching.connect_timeout = memo.config.connect_timeout_s
        settings.networking.request_timeout = memo.config.request_timeout_s
        settings.posting.level = logging.WARNING
        # On exit, wait up to this long for a timer to return once its stopper is set (run_unless_stopped
        # makes that immediate) instead of 10 event-loop cycles, after which kopf orphans it.
        settings.background.instant_exit_timeout = memo.config.stop_timeout_s
        if memo.api is None:
            memo.api = KubeApi(load_api_client())
        memo.http = aiohttp.ClientSession()
        # Compile the CRD's CEL rules and schema validator now (about 1 s, cached: a no-op after main.py's
        # call) rather than in the first reconcile; an embedder that skips main.py gets them here.
        await asyncio.to_thread(validation.prepare)

    @kopf.on.cleanup(registry=registry)
    async def close(memo: OperatorMemo, **_: Any) -> None:
        if memo.http is not None:
            await memo.http.close()
        if memo.api is not None:
            await memo.api.close()  # its connections (a later call would open new ones)

    async def reconcile(body: Any, memo: OperatorMemo, trigger: str, prune: bool, assume_absent: bool,
                        finished: bool | None = None) -> None:
        rlrun = get_rlrun(body)
        meta = rlrun["metadata"]
        state = get_run_state(memo)
        try:
            result = await reconcile_run(memo.api, rlrun, trigger, prune=prune, assume_absent=assume_absent,
                                         finished=finished, operator_namespace=memo.config.operator_namespace)
            if result.invalid:
                workloads = await read_workloads(memo.api, meta["namespace"], meta["name"])
            else:
                workloads = get_workloads(result)
                state.reconciled_generation = meta.get("generation")
            state.invalid = result.invalid

            async def compute(fresh: dict[str, Any]) -> StatusChange:
                if result.invalid and not _invalid_already_reported(fresh, result.invalid):
                    kopf.event(fresh, type="Warning", reason=REASON_INVALID_SPEC, message="; ".join(result.invalid))
                for event_type, reason, message in result.events:  # pools resized to a new spec (plan_replicas)
                    kopf.event(fresh, type=event_type, reason=reason, message=message)
                return plan_status(fresh, workloads, None, state.get_reconciled_generation(fresh), result.invalid)

            # A new run: nobody has written its status yet (the timer waits for RunState.reconciled).
            first = rlrun if trigger == "create" and not (rlrun.get("status") or {}) else None
            await publish_status(memo, meta["namespace"], meta["name"], compute, current=first)
        except (ApiError, ApplyConflict) as exc:
            raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=memo.config.retry_delay_s) from exc
        state.reconciled = True

    @kopf.on.create(*RESOURCE, registry=registry, backoff=config.retry_delay_s)
    async def on_create(body: Any, memo: OperatorMemo, **_: Any) -> None:
        await reconcile(body, memo, "create", prune=False, assume_absent=True)

    @kopf.on.update(*RESOURCE, field="spec", registry=registry, backoff=config.retry_delay_s)
    async def on_update(body: Any, memo: OperatorMemo, **_: Any) -> None:
        await reconcile(body, memo, "update", prune=True, assume_absent=False)

    @kopf.on.resume(*RESOURCE, registry=registry, backoff=config.retry_delay_s)
    async def on_resume(body: Any, memo: OperatorMemo, **_: Any) -> None:
        await reconcile(body, memo, "resume", prune=False, assume_absent=False)

    @kopf.timer(*RESOURCE, registry=registry, interval=config.status_interval_s,
                initial_delay=config.status_interval_s)
    async def refresh(body: Any, memo: OperatorMemo, stopped: kopf.DaemonStopped, **_: Any) -> None:
        await run_unless_stopped(refresh_once(body, memo), stopped)

    async def refresh_once(body: Any, memo: OperatorMemo) -> None:
        state = get_run_state(memo)
        if not state.reconciled:
            return  # the create/resume handler has not finished yet (it writes the first status)
        meta = body["metadata"]

        async def compute(fresh: dict[str, Any]) -> StatusChange:
            return await refresh_run(memo.api, memo.http, fresh, state.get_reconciled_generation(fresh),
                                     state.invalid, run_state=state, clock=memo.clock)

        seen: list[tuple[dict[str, Any], StatusChange]] = []

        async def compute_and_keep(fresh: dict[str, Any]) -> StatusChange:
            seen.append((fresh, await compute(fresh)))
            return seen[-1][1]

        try:
            await publish_status(memo, meta["namespace"], meta["name"], compute_and_keep)
        except ApiError as exc:
            raise kopf.TemporaryError(f"status refresh failed: {exc}", delay=memo.config.retry_delay_s) from exc
        metrics.STATUS_REFRESHES.labels(meta["namespace"], meta["name"]).inc()
        if not seen:
            return
        fresh, change = seen[-1]
        follow_up = plan_after_refresh(fresh, change, state.reconciled_generation)
        if follow_up is not None:
            await reconcile(fresh, memo, follow_up, prune=False, assume_absent=False,
                            finished=True if follow_up == "finish" else None)

    @kopf.on.delete(*RESOURCE, registry=registry, optional=True)
    async def forget(body: Any, **_: Any) -> None:
        metrics.forget_run(body["metadata"]["namespace"], body["metadata"]["name"])

    return registry
