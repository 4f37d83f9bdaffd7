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
- status refresh (every ``config.status_interval_s`` seconds, first after one interval): one asyncio task per
  run (:func:`start_refresher`, started by its first reconcile), not a kopf timer: kopf puts a finalizer on
  every object that has a timer, which costs each new run a patch and a watch event and leaves a deleted run
  stuck in Terminating while no operator runs. The refresh updates the status from children and metrics (and,
  for a run with spec.autoscaling.enabled, one autoscaler decision per scrapeIntervalSeconds:
  ``reconcile.run_autoscaler``; the clock is ``memo.clock``, time.time unless an embedder set one), then does
  what ``reconcile.plan_after_refresh`` decides (finish: give a finished run's GPUs back; drift: recreate a
  missing child). The task ends when the run is gone (then its metric series are forgotten); at exit the
  cleanup handler cancels every task (a refresh in flight writes nothing more), so the operator stops within
  ``config.stop_timeout_s``. kopf removes the finalizer ``constants.FINALIZER`` that older operators put on.
- delete (optional, no finalizer: it runs only while another controller's finalizer holds the run): forget
  the run's metric series.

Status writes: the handlers and the status refresh of one run run concurrently, so each status write holds
a per-run lock, reads the RLRun afresh, computes the wanted status against that fresh status and sends a
merge patch to the status subresource only when something changed (an idle resync writes nothing), with the
read's resourceVersion as a precondition (``publish_status``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Awaitable, Callable, Mapping

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
log = logging.getLogger(__name__)


class UnmarkedProgressStorage(kopf.AnnotationsProgressStorage):
    """kopf's progress storage in ``rlrun.dev/`` annotations, without its ``rlrun.dev/kopf-managed: yes`` marker.

    kopf records a handler's progress when it starts and purges the record when it succeeds at once, so a
    run whose handler never retries gets no progress annotation; but the marker, which tells other kopf-based
    operators to leave ``rlrun.dev/`` annotations out of their diffs, stays in the patch: one write per new
    run, and one watch event, for nothing (the marker is for annotation diff bases, and ours is
    :class:`GenerationDiffBase`). Retries still write their progress annotations. ``_store_marker`` is kopf's
    own hook (kopf 1.45, ``kopf/_cogs/configs/conventions.py``); tests/unit/test_operator_kopf.py fails if a
    kopf upgrade renames it.
    """

    def _store_marker(self, prefix: str, patch: kopf.Patch, body: kopf.Body) -> None:
        return None


class GenerationDiffBase(kopf.DiffBaseStorage):
    """kopf's "last handled configuration", read from the status instead of stored in an annotation.

    kopf compares the essence it stored after the last successful handling with the object's essence now, to
    tell a create from an update or a no-op. Here the essence is ``{"spec": {"generation": N}}``: the API
    server increments ``metadata.generation`` on every spec change of a custom resource with a status
    subresource, and every successful reconcile records in the status the generation it handled:
    ``status.observedGeneration`` for a spec it applied, the Ready condition's ``observedGeneration`` with
    reason InvalidSpec for a spec it refused (the status refresh never writes either for a generation no
    reconcile has handled). So nothing is stored: no annotation patch per handled change, and no watch event
    of it for kopf to process. No handled generation: kopf's create; an older one: kopf's update (on
    ``field="spec"``). Label or annotation edits do not change the generation and are not reconciled, as
    with the update handler's ``field="spec"`` before.
    """

    def __init__(self) -> None:
        super().__init__()
        # uid -> the generation this process's last reconcile handled. Watch events can reach kopf out of
        # order with respect to the status writes (a refresh's write read before the reconcile's lands after
        # it), so a stale event's status may name an older generation than was handled: the newer one wins.
        self.handled: dict[str, int] = {}

    def record(self, uid: str, generation: int) -> None:
        """Remember that a reconcile handled ``generation`` of run ``uid`` (after its status write)."""
        self.handled[uid] = max(generation, self.handled.get(uid, 0))

    def forget(self, uid: str) -> None:
        self.handled.pop(uid, None)

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return {"spec": {"generation": body.get("metadata", {}).get("generation")}}  # type: ignore[return-value]

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        handled = get_handled_generation(body.get("status") or {})
        remembered = self.handled.get(body.get("metadata", {}).get("uid") or "")
        if remembered is not None:
            handled = max(handled or 0, remembered)
        return None if handled is None else {"spec": {"generation": handled}}  # type: ignore[return-value]

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing to store: the reconcile's own status write records the handled generation."""


def get_handled_generation(status: Mapping[str, Any]) -> int | None:
    """The newest generation a reconcile handled, from an RLRun's status (see GenerationDiffBase); None if none."""
    handled = status.get("observedGeneration")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("reason") == REASON_INVALID_SPEC \
                and isinstance(cond.get("observedGeneration"), int):
            handled = max(handled or 0, cond["observedGeneration"])
    return handled


def _invalid_already_reported(rlrun: dict[str, Any], invalid: list[str]) -> bool:
    for cond in (rlrun.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("reason") == REASON_INVALID_SPEC and cond.get("message") == "; ".join(invalid)
    return False


PRESENT, GONE, REPLACED = "present", "gone", "replaced"  # what publish_status found
STATUS_WRITE_ATTEMPTS = 3  # a status write that conflicts (someone wrote the run since its GET) is recomputed


async def publish_status(memo: OperatorMemo, namespace: str, name: str,
                         compute: Callable[[dict[str, Any]], Awaitable[StatusChange]],
                         current: dict[str, Any] | None = None, uid: str | None = None) -> str:
    """Under the run's lock: GET the RLRun (unless ``current`` is known to be the latest, as in the create
    handler, before anything else wrote a status), ``compute`` the change against it, write it to the
    status subresource when not empty, count the phase, post an Event on a phase transition.

    The write carries the GET's ``metadata.resourceVersion``, which the API server checks before it applies
    a patch (409 Conflict when the object changed since): a status computed for a run that was deleted and
    created again under the same name (no finalizer holds a deletion) never lands on the new object. On a
    conflict the run is read again and the change recomputed, up to STATUS_WRITE_ATTEMPTS times. ``compute``
    may run more than once: it must not post Events itself (it returns them in ``StatusChange.events``).

    Returns:
        GONE when no such object exists, REPLACED when one of that name has another uid than ``uid``
        (deleted and created again), PRESENT otherwise (also while it is being deleted: nothing is written).

    Raises:
        ApiError: the write failed, or still conflicted after STATUS_WRITE_ATTEMPTS attempts.
    """
    async with get_run_state(memo).status_lock:
        for attempt in range(STATUS_WRITE_ATTEMPTS):
            fresh = current if current is not None and attempt == 0 else \
                await memo.api.get(constants.KIND, namespace, name)
            if fresh is None:
                return GONE
            meta = fresh.get("metadata", {})
            if uid is not None and meta.get("uid") != uid:
                return REPLACED
            if meta.get("deletionTimestamp"):
                return PRESENT
            change = await compute(fresh)
            if change.patch:
                body: dict[str, Any] = {"status": change.patch}
                if meta.get("resourceVersion"):
                    body["metadata"] = {"resourceVersion": meta["resourceVersion"]}
                try:
                    await memo.api.merge_patch(constants.KIND, namespace, name, body, subresource="status",
                                               answer=False)
                except ApiError as exc:
                    if exc.status == 409 and attempt + 1 < STATUS_WRITE_ATTEMPTS:
                        continue
                    raise
            break
        metrics.set_run_phase(namespace, name, change.new_phase)
        metrics.set_run_conditions(namespace, name, change.patch.get("conditions")
                                   or (fresh.get("status") or {}).get("conditions"))
        for event_type, reason, message in change.events:  # the reconcile's and the autoscaler's
            kopf.event(fresh, type=event_type, reason=reason, message=message)
        if change.old_phase != change.new_phase:
            kopf.event(fresh, type="Warning" if change.new_phase == PHASE_FAILED else "Normal",
                       reason=change.new_phase, message=f"phase {change.old_phase or 'none'} -> {change.new_phase}")
    return PRESENT


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
    diffbase = GenerationDiffBase()

    if login:
        @kopf.on.login(registry=registry)
        def log_in(**kwargs: Any) -> kopf.ConnectionInfo | None:
            return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
        settings.persistence.finalizer = constants.FINALIZER
        settings.persistence.progress_storage = UnmarkedProgressStorage(prefix=constants.ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = diffbase
        complete_memo(memo, config)
        settings.watching.server_timeout = memo.config.watch_server_timeout_s
        settings.watching.client_timeout = memo.config.watch_client_timeout_s
        settings.watching.connect_timeout = memo.config.connect_timeout_s
        settings.networking.request_timeout = memo.config.request_timeout_s
        settings.posting.level = logging.WARNING
        if memo.api is None:
            memo.api = KubeApi(load_api_client())
        memo.http = aiohttp.ClientSession()
        # Compile the CRD's CEL rules and schema validator now (about 1 s, cached: a no-op after main.py's
        # call) rather than in the first reconcile; an embedder that skips main.py gets them here.
        await asyncio.to_thread(validation.prepare)

    @kopf.on.cleanup(registry=registry)
    async def close(memo: OperatorMemo, **_: Any) -> None:
        tasks = list(memo.refreshers)
        for task in tasks:
            task.cancel()  # a refresh in flight writes nothing more; the next operator's resume redoes it
        if tasks:
            await asyncio.wait(tasks, timeout=memo.config.stop_timeout_s)
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
            state.invalid, state.invalid_generation = result.invalid, meta.get("generation")

            async def compute(fresh: dict[str, Any]) -> StatusChange:
                # This reconcile's verdict on the spec holds for its own generation only: if the run moved on
                # meanwhile, the newer generation is pending, not invalid (GenerationDiffBase relies on it).
                same = fresh.get("metadata", {}).get("generation") == meta.get("generation")
                invalid = result.invalid if same else []
                events = list(result.events)  # pools resized to a new spec (plan_replicas)
                if invalid and not _invalid_already_reported(fresh, invalid):
                    events.insert(0, ("Warning", REASON_INVALID_SPEC, "; ".join(invalid)))
                change = plan_status(fresh, workloads, None, state.get_reconciled_generation(fresh), invalid)
                return dataclasses.replace(change, events=(*events, *change.events))

            # A new run: nobody has written its status yet, and its refresh starts below.
            first = rlrun if trigger == "create" and not (rlrun.get("status") or {}) else None
            found = await publish_status(memo, meta["namespace"], meta["name"], compute, current=first,
                                         uid=meta.get("uid"))
            if found == PRESENT and isinstance(meta.get("generation"), int):
                diffbase.record(meta["uid"], meta["generation"])
        except (ApiError, ApplyConflict) as exc:
            raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=memo.config.retry_delay_s) from exc
        start_refresher(memo, meta["namespace"], meta["name"], meta["uid"])

    def start_refresher(memo: OperatorMemo, namespace: str, name: str, uid: str) -> None:
        """Start the run's status-refresh task unless it runs already (see the module docstring)."""
        state = get_run_state(memo)
        if state.refresher is not None and not state.refresher.done():
            return
        task = asyncio.get_running_loop().create_task(refresh_loop(memo, namespace, name, uid),
                                                      name=f"rlrun status refresh {namespace}/{name}")
        state.refresher = task
        memo.refreshers.add(task)
        task.add_done_callback(memo.refreshers.discard)

    async def refresh_loop(memo: OperatorMemo, namespace: str, name: str, uid: str) -> None:
        """Refresh the run's status every ``status_interval_s`` (``retry_delay_s`` after an API error) until
        the run is gone, then forget its metric series."""
        delay = memo.config.status_interval_s
        while True:
            await asyncio.sleep(delay)
            delay = memo.config.status_interval_s
            try:
                found = await refresh_once(memo, namespace, name, uid)
            except asyncio.CancelledError:
                raise
            except (ApiError, ApplyConflict, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("status refresh of %s/%s failed, retrying in %.0f s: %s", namespace, name,
                            memo.config.retry_delay_s, exc)
                delay = memo.config.retry_delay_s
                continue
            except kopf.TemporaryError as exc:  # the follow-up reconcile's API error, already worded
                log.warning("status refresh of %s/%s: %s", namespace, name, exc)
                delay = memo.config.retry_delay_s
                continue
            except Exception:  # noqa: BLE001 - a bug: log it with its traceback, keep refreshing the run
                log.exception("status refresh of %s/%s failed", namespace, name)
                delay = memo.config.retry_delay_s
                continue
            if found == GONE:
                metrics.forget_run(namespace, name)
            if found != PRESENT:  # gone, or replaced by a new run of that name (its own refresh keeps its series)
                diffbase.forget(uid)
                return

    @kopf.on.create(*RESOURCE, registry=registry, backoff=config.retry_delay_s)
    async def on_create(body: Any, memo: OperatorMemo, **_: Any) -> None:
        await reconcile(body, memo, "create", prune=False, assume_absent=True)

    @kopf.on.update(*RESOURCE, field="spec", registry=registry, backoff=config.retry_delay_s)
    async def on_update(body: Any, memo: OperatorMemo, **_: Any) -> None:
        await reconcile(body, memo, "update", prune=True, assume_absent=False)

    @kopf.on.resume(*RESOURCE, registry=registry, backoff=config.retry_delay_s)
    async def on_resume(body: Any, memo: OperatorMemo, **_: Any) -> None:
        await reconcile(body, memo, "resume", prune=False, assume_absent=False)

    async def refresh_once(memo: OperatorMemo, namespace: str, name: str, uid: str) -> str:
        """One refresh (and its follow-up reconcile); what publish_status found (PRESENT, GONE, REPLACED)."""
        state = get_run_state(memo)

        async def compute(fresh: dict[str, Any]) -> StatusChange:
            # The last reconcile's verdict on the spec holds for the generation it handled only: a newer
            # generation is pending (ReconcilePending), not invalid (GenerationDiffBase relies on that).
            invalid = state.invalid if state.invalid_generation == fresh["metadata"].get("generation") else []
            return await refresh_run(memo.api, memo.http, fresh, state.get_reconciled_generation(fresh),
                                     invalid, run_state=state, clock=memo.clock)

        seen: list[tuple[dict[str, Any], StatusChange]] = []

        async def compute_and_keep(fresh: dict[str, Any]) -> StatusChange:
            seen.append((fresh, await compute(fresh)))
            return seen[-1][1]

        found = await publish_status(memo, namespace, name, compute_and_keep, uid=uid)
        if found != PRESENT:
            return found
        metrics.STATUS_REFRESHES.labels(namespace, name).inc()
        if not seen:
            return PRESENT
        fresh, change = seen[-1]
        follow_up = plan_after_refresh(fresh, change, state.reconciled_generation)
        if follow_up is not None:
            await reconcile(fresh, memo, follow_up, prune=False, assume_absent=False,
                            finished=True if follow_up == "finish" else None)
        return PRESENT

    @kopf.on.delete(*RESOURCE, registry=registry, optional=True)
    async def forget(body: Any, **_: Any) -> None:
        metrics.forget_run(body["metadata"]["namespace"], body["metadata"]["name"])

    return registry
