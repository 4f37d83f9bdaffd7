"""The kopf handlers of the RLRun operator (thin: the work is in reconcile.py).

``get_registry()`` builds a fresh kopf registry, so the operator can be embedded (tests, benchmark) with
its own settings. Handlers:
- startup: kopf settings (finalizer and annotation prefix under rlrun.dev, watch timeouts, Events only for
  warnings), the API client in ``memo.api`` unless the embedder put one there, an HTTP session for scrapes.
- create / update (spec only) / resume: reconcile the children and write the status; update also prunes
  children the render no longer produces. A semantically invalid spec writes Ready=False reason InvalidSpec
  and a Warning Event, and creates nothing.
- timer (every ``status_interval`` seconds): refresh status from children and metrics; writes only when
  something changed. kopf puts its finalizer (constants.FINALIZER) on served RLRuns because of it.
- delete (optional, no finalizer of its own): forget the run's metric series.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import kopf

from rlrun_operator import constants, metrics
from rlrun_operator.apply import ApplyConflict
from rlrun_operator.kubeapi import ApiError, KubeApi, load_api_client
from rlrun_operator.observe import read_workloads
from rlrun_operator.reconcile import (StatusChange, get_rlrun, get_workloads, plan_status, reconcile_run,
                                      refresh_run)
from rlrun_operator.status import PHASE_FAILED, REASON_INVALID_SPEC

RESOURCE = (constants.GROUP, constants.VERSION, constants.PLURAL)
RETRY_DELAY_S = 5.0
WATCH_SERVER_TIMEOUT_S = 300
WATCH_CLIENT_TIMEOUT_S = 330


def write_status(body: Any, patch: kopf.Patch, change: StatusChange) -> None:
    """Put a status change into kopf's patch (kopf writes it to the status subresource after the handler;
    an empty change writes nothing) and post an Event on a phase transition."""
    for key, value in change.patch.items():
        patch.status[key] = value
    meta = body["metadata"]
    metrics.set_run_phase(meta["namespace"], meta["name"], change.new_phase)
    if change.old_phase != change.new_phase:
        kopf.event(body, type="Warning" if change.new_phase == PHASE_FAILED else "Normal",
                   reason=change.new_phase, message=f"phase {change.old_phase or 'none'} -> {change.new_phase}")


def _invalid_already_reported(rlrun: dict[str, Any], invalid: list[str]) -> bool:
    for cond in (rlrun.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("reason") == REASON_INVALID_SPEC and cond.get("message") == "; ".join(invalid)
    return False


def get_registry(status_interval: float = constants.OPERATOR_STATUS_INTERVAL_S) -> kopf.OperatorRegistry:
    """A kopf registry with every handler of the operator.

    Args:
        status_interval: seconds between status refreshes of each run (also the timer's initial delay).
    """
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.persistence.finalizer = constants.FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.ANNOTATION_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=constants.ANNOTATION_PREFIX, key="last-handled-configuration")
        settings.watching.server_timeout = WATCH_SERVER_TIMEOUT_S
        settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT_S
        settings.watching.connect_timeout = 30
        settings.networking.request_timeout = 60
        settings.posting.level = logging.WARNING
        if getattr(memo, "api", None) is None:
            memo.api = KubeApi(load_api_client())
        memo.http = aiohttp.ClientSession()

    @kopf.on.cleanup(registry=registry)
    async def close(memo: kopf.Memo, **_: Any) -> None:
        http = getattr(memo, "http", None)
        if http is not None:
            await http.close()

    async def reconcile(body: Any, memo: kopf.Memo, patch: kopf.Patch, trigger: str, prune: bool,
                        assume_absent: bool) -> None:
        rlrun = get_rlrun(body)
        try:
            result = await reconcile_run(memo.api, rlrun, trigger, prune=prune, assume_absent=assume_absent)
        except (ApiError, ApplyConflict) as exc:
            raise kopf.TemporaryError(f"reconcile failed: {exc}", delay=RETRY_DELAY_S) from exc
        memo.invalid = result.invalid
        generation = rlrun["metadata"].get("generation")
        if result.invalid:
            if not _invalid_already_reported(rlrun, result.invalid):
                kopf.event(body, type="Warning", reason=REASON_INVALID_SPEC, message="; ".join(result.invalid))
            meta = rlrun["metadata"]
            workloads = await read_workloads(memo.api, meta["namespace"], meta["name"])
            reconciled = (rlrun.get("status") or {}).get("observedGeneration")
            write_status(body, patch, plan_status(rlrun, workloads, None, reconciled, result.invalid))
            return
        write_status(body, patch, plan_status(rlrun, get_workloads(result), None, generation, []))

    @kopf.on.create(*RESOURCE, registry=registry, backoff=RETRY_DELAY_S)
    async def on_create(body: Any, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        await reconcile(body, memo, patch, "create", prune=False, assume_absent=True)

    @kopf.on.update(*RESOURCE, field="spec", registry=registry, backoff=RETRY_DELAY_S)
    async def on_update(body: Any, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        await reconcile(body, memo, patch, "update", prune=True, assume_absent=False)

    @kopf.on.resume(*RESOURCE, registry=registry, backoff=RETRY_DELAY_S)
    async def on_resume(body: Any, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        await reconcile(body, memo, patch, "resume", prune=False, assume_absent=False)

    @kopf.timer(*RESOURCE, registry=registry, interval=status_interval, initial_delay=status_interval)
    async def refresh(body: Any, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        rlrun = get_rlrun(body)
        invalid = getattr(memo, "invalid", None) or []
        try:
            change = await refresh_run(memo.api, memo.http, rlrun, invalid)
        except ApiError as exc:
            raise kopf.TemporaryError(f"status refresh failed: {exc}", delay=RETRY_DELAY_S) from exc
        write_status(body, patch, change)

    @kopf.on.delete(*RESOURCE, registry=registry, optional=True)
    async def forget(body: Any, **_: Any) -> None:
        metrics.forget_run(body["metadata"]["namespace"], body["metadata"]["name"])

    return registry
