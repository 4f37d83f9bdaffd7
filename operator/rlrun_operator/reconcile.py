"""One reconcile of a run (validate -> render -> create-or-patch children) and one status refresh (read
children and metrics -> status). Called by the kopf handlers in handlers.py; no kopf imports here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import aiohttp

from rlrun_api import constants
from rlrun_operator import apply, autoscale, metrics, observe, status
from rlrun_operator.kubeapi import ApiError, KubeApi
from rlrun_operator.render import RenderError, render
from rlrun_api.sizing import SizingError
from rlrun_api.spec import apply_defaults, copy_json
from rlrun_api.validation import validate
from rlrun_api.views import REPLICA_SEEDS, AutoscalingView


@dataclass
class ReconcileResult:
    """``invalid``: "path: message" lines (nothing was applied), else the outcome per child and the
    pruned (kind, name) pairs."""

    invalid: list[str] = field(default_factory=list)
    outcomes: list[apply.Outcome] = field(default_factory=list)
    pruned: list[tuple[str, str]] = field(default_factory=list)

    @property
    def writes(self) -> int:
        """Write calls made on children (create 1, patch 1, replace 2, prune 1 each)."""
        cost = {"create": 1, "patch": 1, "replace": 2, "none": 0}
        return sum(cost[o.action] for o in self.outcomes) + len(self.pruned)

    @property
    def events(self) -> tuple[tuple[str, str, str], ...]:
        """(type, reason, message) of the Events the children's plans asked for (apply.plan_replicas: a pool
        resized to a new spec), in apply order, each distinct Event once."""
        return tuple(dict.fromkeys(e for o in self.outcomes for e in o.events))


def get_plain(value: Any) -> Any:
    """Deep copy of a kopf body (nested Mappings) as plain dicts and lists."""
    if isinstance(value, Mapping):
        return {k: get_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [get_plain(v) for v in value]
    return value


def get_rlrun(body: Mapping[str, Any]) -> dict[str, Any]:
    """The RLRun as a plain dict (apiVersion, kind, metadata, spec, status) from a kopf body."""
    plain = get_plain(body)
    return {k: plain[k] for k in ("apiVersion", "kind", "metadata", "spec", "status") if k in plain}


def get_now() -> str:
    """Current UTC time, RFC 3339 with seconds ("2026-11-29T10:00:00Z")."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_DEFAULTED_SPECS: dict[tuple[str, int], dict[str, Any]] = {}
_DEFAULTED_SPECS_MAX = 4096


def get_defaulted(rlrun: dict[str, Any]) -> dict[str, Any]:
    """``spec.apply_defaults(rlrun)``, with the defaulted spec memoised per (metadata.uid,
    metadata.generation) — the API server bumps the generation on every spec change — so status refreshes
    do not default the same spec again. Objects without uid or generation are defaulted every time."""
    meta = rlrun.get("metadata") or {}
    key = (meta.get("uid"), meta.get("generation"))
    if key[0] is None or key[1] is None:
        return apply_defaults(rlrun)
    spec = _DEFAULTED_SPECS.get(key)
    if spec is None:
        if len(_DEFAULTED_SPECS) >= _DEFAULTED_SPECS_MAX:
            _DEFAULTED_SPECS.clear()
        spec = _DEFAULTED_SPECS[key] = apply_defaults({"spec": rlrun.get("spec") or {}})["spec"]
    return {**rlrun, "spec": copy_json(spec)}


def get_without_stored_default(rlrun: dict[str, Any]) -> dict[str, Any]:
    """``rlrun`` without a spec.storage.size that the API server stored as a default (a shallow copy).

    Until storage.size lost its schema default, the API server wrote ``size: 100Gi``
    (constants.DEFAULT_STORAGE_SIZE) into every stored run, also those with storage.claimName, which the
    CRD's rules now refuse. Such a stored run was valid when it was written; its size was never used, so
    it is validated without it. The render keeps reading the stored spec, so its children (and their
    hashes) stay as they are. A new run cannot get here with both: the API server refuses it at admission.
    """
    run_spec = rlrun.get("spec")
    storage = run_spec.get("storage") if isinstance(run_spec, dict) else None  # any type: not validated yet
    if not isinstance(storage, dict) or not storage.get("claimName") \
            or storage.get("size") != constants.DEFAULT_STORAGE_SIZE:
        return rlrun
    return {**rlrun, "spec": {**rlrun["spec"], "storage": {k: v for k, v in storage.items() if k != "size"}}}


_INVALID: dict[tuple[str, int], list[str]] = {}


def get_invalid(rlrun: dict[str, Any]) -> list[str]:
    """Validation errors of an RLRun as "path: message" lines (empty when valid); never raises.

    Validated without status and without a stored storage.size default (get_without_stored_default).
    Memoised per (metadata.uid, metadata.generation), like get_defaulted: what validate() reads besides
    the spec (apiVersion, kind, metadata.name and namespace) cannot change within one object's generation.
    Objects without uid or generation are validated every time.
    """
    meta = rlrun.get("metadata") or {}
    key = (meta.get("uid"), meta.get("generation"))
    found = _INVALID.get(key) if None not in key else None
    if found is None:
        subject = get_without_stored_default({k: v for k, v in rlrun.items() if k != "status"})
        found = [f"{e.path}: {e.message}" for e in validate(subject)]
        if None not in key:
            if len(_INVALID) >= _DEFAULTED_SPECS_MAX:
                _INVALID.clear()
            _INVALID[key] = found
    return list(found)


def is_finished(rlrun: dict[str, Any]) -> bool:
    """True when the run's status.phase is Succeeded or Failed (its orchestrator Job finished)."""
    return (rlrun.get("status") or {}).get("phase") in status.TERMINAL_PHASES


def get_pool_sizes(spec: Mapping[str, Any]) -> apply.PoolSizes:
    """The size fields the pool Deployments are sized from, and whether the autoscaler owns them (pure).

    Args:
        spec: a defaulted, valid RLRun spec.

    Returns:
        apply.PoolSizes: ``fields`` = {"spec.inference.replicas": n} without disaggregation, else the
        disaggregation's ratio and replicas by path (views.REPLICA_SEEDS); ``autoscaled`` when the autoscaler
        acts on the run's replicas: autoscaling.enabled on a disaggregated run without dryRun (a dry run only
        records decisions, so the spec keeps sizing the pools).
    """
    view = AutoscalingView.from_spec(spec)
    paths = [p for p in REPLICA_SEEDS if ("disaggregation" in p) == view.disaggregated]
    fields = {}
    for path in paths:
        value: Any = spec
        for key in path:
            value = value[key]
        fields[".".join(("spec", *path))] = value
    return apply.PoolSizes(fields, autoscaled=view.enabled and view.disaggregated and not view.dry_run)


def get_finished_manifests(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a finished run keeps applying: everything but the orchestrator Job (a finished Job is left
    as it is: never suspended, patched nor replaced). ``manifests`` must be rendered with spec.suspend
    true, so every other workload is at 0 replicas."""
    return [m for m in manifests if m["kind"] != "Job"]


async def reconcile_run(api: KubeApi, rlrun: dict[str, Any], trigger: str, prune: bool = False,
                        assume_absent: bool = False, finished: bool | None = None,
                        operator_namespace: str = constants.DEFAULT_OPERATOR_NAMESPACE) -> ReconcileResult:
    """Validate, render and converge every child of ``rlrun`` (a plain RLRun with metadata.uid).

    A finished run (``finished``; None: ``is_finished(rlrun)``) gives its GPUs back: its children are
    applied as if spec.suspend were true (trainer, inference pools and router at 0 replicas; the live pool
    sizes saved for a later resume), while the finished Job, the ConfigMap and the PVC are kept.

    Args:
        trigger: create | update | resume | drift | finish (a metrics label).
        prune: also delete children the render no longer produces (on spec updates).
        assume_absent: POST first without a GET (a brand-new run); a 409 falls back to GET + patch.
        operator_namespace: the operator's own namespace (render's keyword: the NetworkPolicy peer).

    Returns:
        ReconcileResult; ``invalid`` set means the spec is invalid: nothing was written when validation
        or rendering refused it; when the API server refused a rendered child (apply.InvalidChild), the
        children before it in apply order may have been written.

    Raises:
        kubeapi.ApiError, apply.ApplyConflict: the API refused or kept conflicting (kopf retries).
    """
    started = time.perf_counter()
    metrics.RECONCILES.labels(trigger).inc()
    try:
        invalid = get_invalid(rlrun)
        if invalid:
            return ReconcileResult(invalid=invalid)
        defaulted = get_defaulted(rlrun)
        finished = is_finished(rlrun) if finished is None else finished
        if finished:
            defaulted["spec"]["suspend"] = True
        try:
            manifests = render(defaulted, operator_namespace=operator_namespace)
        except (RenderError, SizingError) as exc:
            return ReconcileResult(invalid=[str(exc)])
        remember_children(rlrun, manifests)
        suspended = bool(defaulted["spec"].get("suspend"))
        applied = get_finished_manifests(manifests) if finished else manifests
        try:
            outcomes = await apply.apply_children(api, applied, suspended, assume_absent,
                                                  sizes=get_pool_sizes(defaulted["spec"]),
                                                  answered=observe.WORKLOAD_KINDS)  # get_workloads reads them
        except apply.InvalidChild as exc:
            return ReconcileResult(invalid=[f"{exc}; fix the RLRun field it is rendered from (spec.pod, "
                                            f"spec.*.resources, spec.inference.vllmArgs, ...)"])
        for kept in manifests if finished else []:
            if kept["kind"] == "Job":  # read, so the status still sees the finished Job
                live = await api.get("Job", kept["metadata"]["namespace"], kept["metadata"]["name"])
                if live is not None:
                    outcomes.append(apply.Outcome("Job", kept["metadata"]["name"], "none", live))
        for outcome in outcomes:
            if outcome.action != "none":
                metrics.CHILD_WRITES.labels(outcome.action).inc()
        pruned: list[tuple[str, str]] = []
        if prune:
            meta = rlrun["metadata"]
            pruned = await apply.apply_prune(api, meta["namespace"], meta["name"], meta["uid"], manifests)
        return ReconcileResult(outcomes=outcomes, pruned=pruned)
    except Exception:
        metrics.RECONCILE_ERRORS.labels("reconcile").inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)


def get_workloads(result: ReconcileResult) -> list[dict[str, Any]]:
    """The workload objects (StatefulSet, Deployments, Job) as the API answered during a reconcile."""
    return [{**o.obj, "kind": o.obj.get("kind") or o.kind} for o in result.outcomes
            if o.kind in observe.WORKLOAD_KINDS]


_EXPECTED: dict[tuple[str, int], frozenset[tuple[str, str]]] = {}


def get_expected_children(rlrun: dict[str, Any]) -> frozenset[tuple[str, str]]:
    """(kind, name) of every child the render produces for ``rlrun`` (empty when it does not render),
    memoised per (metadata.uid, metadata.generation) like get_defaulted."""
    meta = rlrun.get("metadata") or {}
    key = (meta.get("uid"), meta.get("generation"))
    found = _EXPECTED.get(key) if None not in key else None
    if found is None:
        try:
            found = remember_children(rlrun, render(get_defaulted(rlrun)))
        except (RenderError, SizingError, KeyError, TypeError, ValueError):
            found = frozenset()
    return found


def remember_children(rlrun: dict[str, Any], manifests: list[dict[str, Any]]) -> frozenset[tuple[str, str]]:
    """Record the (kind, name) of ``manifests``, the render of ``rlrun``, for get_expected_children (so
    the status timer does not render the run again); returns them."""
    found = frozenset((m["kind"], m["metadata"]["name"]) for m in manifests)
    meta = rlrun.get("metadata") or {}
    key = (meta.get("uid"), meta.get("generation"))
    if None not in key:
        if len(_EXPECTED) >= _DEFAULTED_SPECS_MAX:
            _EXPECTED.clear()
        _EXPECTED[key] = found
    return found


@dataclass(frozen=True)
class StatusChange:
    """A status merge patch (empty: no write), the phase transition it makes, if any, and the rendered
    children ("Kind/name") missing although the live run should have them (drift: recreate them)."""

    patch: dict[str, Any]
    old_phase: str | None
    new_phase: str
    missing: tuple[str, ...] = ()
    events: tuple[tuple[str, str, str], ...] = ()  # (type, reason, message) to post after the write


def plan_status(rlrun: dict[str, Any], workloads: list[dict[str, Any]], progress: status.Progress | None,
                reconciled_generation: int | None, invalid: list[str], now: Callable[[], str] = get_now,
                others: list[dict[str, Any]] | None = None, failure: str | None = None) -> StatusChange:
    """Wanted status vs the current one (pure apart from the clock, which only matters when something
    changed). ``others``: the run's non-workload children as listed (observe.read_children); when given,
    the drift check covers every rendered (kind, name), else only the workloads. ``failure``: the
    orchestrator's last termination message (observe.get_orchestrator_failure)."""
    defaulted = get_defaulted(rlrun)
    wanted = status.get_status(defaulted, workloads, progress, now(), reconciled_generation, invalid,
                               failure=failure)
    old = rlrun.get("status") or {}
    drifted = bool(workloads) and not invalid and wanted["phase"] not in status.TERMINAL_PHASES
    missing: tuple[str, ...] = ()
    if drifted:
        present = {(o.get("kind"), o.get("metadata", {}).get("name")) for o in [*workloads, *(others or [])]}
        checked = set(observe.WORKLOAD_KINDS) | (set(observe.OTHER_CHILD_KINDS) if others is not None else set())
        missing = tuple(f"{kind}/{name}" for kind, name in sorted(get_expected_children(rlrun))
                        if kind in checked and (kind, name) not in present)
    return StatusChange(status.get_status_patch(old, wanted), old.get("phase"), wanted["phase"], missing)


@dataclass
class RunState:
    """What the operator remembers about one run between its handlers (kept in kopf's per-object memo).

    Attributes:
        status_lock: held for each status write (the handlers and the status refresh of one run run
            concurrently).
        reconciled_generation: metadata.generation of the last reconcile that rendered the children.
        invalid: the spec's errors found by the last reconcile ([] when valid); invalid_generation: the
            generation that reconcile handled.
        autoscale: the autoscaler's state after its last decision (None: derive it from
            status.scalingHistory, as after an operator restart); autoscale_time: when it decided;
            autoscale_known: the pool sizes it last saw or set (a different live value is a hand edit).
        refresher: the run's status-refresh task (``handlers.start_refresher``), None before its first reconcile.
    """

    status_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reconciled_generation: int | None = None
    invalid: list[str] = field(default_factory=list)
    invalid_generation: int | None = None
    autoscale: autoscale.State | None = None
    autoscale_time: float | None = None
    autoscale_known: dict[str, int] | None = None
    refresher: asyncio.Task[None] | None = None

    def get_reconciled_generation(self, rlrun: dict[str, Any]) -> int | None:
        """The generation the children were last rendered for: ours, else (after an operator restart, before
        the resume handler ran) the one the status says."""
        return self.reconciled_generation or (rlrun.get("status") or {}).get("observedGeneration")


FollowUp = Literal["finish", "drift"]


def plan_after_refresh(rlrun: dict[str, Any], change: StatusChange,
                       reconciled_generation: int | None) -> FollowUp | None:
    """What the status refresh does after a refresh of ``rlrun`` made ``change`` (pure).

    - ``"finish"``: the run has just reached Succeeded or Failed and no spec change is pending: reconcile it
      as finished (every workload but the orchestrator Job scaled to 0, so its GPUs are given back). With a
      spec change pending, the update handler's reconcile applies the run as finished (with pruning), and a
      finish here would record the pending generation as handled without pruning.
    - ``"drift"``: a rendered child of a live run is missing and no spec change is pending (the update
      handler applies those): reconcile again to recreate it.
    - None: nothing to do.
    """
    current = rlrun.get("metadata", {}).get("generation") == reconciled_generation
    if change.new_phase in status.TERMINAL_PHASES and change.old_phase not in status.TERMINAL_PHASES:
        return "finish" if current else None
    if change.missing and current:
        return "drift"
    return None


def get_autoscaling(rlrun: dict[str, Any], reconciled_generation: int | None,
                    invalid: list[str]) -> AutoscalingView | None:
    """The autoscaling view of a run the autoscaler acts on now (pure), else None: autoscaling enabled on
    a disaggregated, valid, live (not suspended, not finished) run whose current spec is applied."""
    if invalid or is_finished(rlrun) or rlrun.get("metadata", {}).get("generation") != reconciled_generation:
        return None
    try:
        defaulted = get_defaulted(rlrun)["spec"]
        view = AutoscalingView.from_spec(defaulted)
    except (KeyError, TypeError, ValueError):
        return None
    if not view.enabled or not view.disaggregated or defaulted.get("suspend"):
        return None
    return view


def is_autoscale_due(last: float | None, now: float, view: AutoscalingView) -> bool:
    """One decision per scrapeIntervalSeconds (5 % slack for the timer's jitter)."""
    return last is None or now - last >= 0.95 * view.scrape_interval_s


@dataclass(frozen=True)
class ScalingPlan:
    """What the status timer does with one autoscaler Decision (plan_scaling).

    ``patches``: (Deployment name, JSON patch) setting spec.replicas, each guarded by a ``test`` of the
    replicas the decision read (a concurrent hand edit makes it fail: the decision is then dropped);
    ``history``: the new status.scalingHistory (None: unchanged); ``events``: (type, reason, message)."""

    decision: autoscale.Decision
    patches: tuple[tuple[str, list[dict[str, Any]]], ...] = ()
    history: list[dict[str, Any]] | None = None
    events: tuple[tuple[str, str, str], ...] = ()


_HISTORY_KEYS = ("prefill", "decode", "prefillBefore", "decodeBefore", "action", "code", "dryRun")


def plan_scaling(rlrun: dict[str, Any], decision: autoscale.Decision, now: float, dry_run: bool,
                 known: Mapping[str, int] | None = None) -> ScalingPlan:
    """Turn a Decision into writes (pure). A decision that changes replicas patches the pool Deployments
    (never with dryRun), appends a status.scalingHistory entry and posts an Event (ScaledPrefill,
    ScaledDecode or AutoscalerDryRun). A dry-run decision identical to the newest history entry (same
    sizes, action, code) is not recorded again: the pools did not move, so it would repeat every interval.
    ``known``: the sizes the autoscaler last saw or set; a different live size is a hand edit, taken as the
    current value and said in an Event. Holds write nothing."""
    name = rlrun["metadata"]["name"]
    events: list[tuple[str, str, str]] = []
    before = {autoscale.PREFILL: decision.prefill_before, autoscale.DECODE: decision.decode_before}
    for pool in autoscale.POOLS:
        if known and pool in known and known[pool] != before[pool]:
            events.append(("Normal", constants.EVENT_REPLICAS_EDITED,
                           f"{pool} replicas changed from {known[pool]} to {before[pool]} outside the autoscaler; "
                           f"it decides from {before[pool]}"))
    if not decision.changed:
        return ScalingPlan(decision, events=tuple(events))
    history = list((rlrun.get("status") or {}).get("scalingHistory") or [])
    entry = decision.history_entry(now, dry_run=dry_run)
    if dry_run and history and isinstance(history[-1], Mapping) \
            and all(history[-1].get(k) == entry[k] for k in _HISTORY_KEYS):
        return ScalingPlan(decision, events=tuple(events))
    sizes = f"prefill {decision.prefill_before} -> {decision.prefill}, decode {decision.decode_before} -> {decision.decode}"
    if dry_run:
        events.append(("Normal", constants.EVENT_AUTOSCALER_DRY_RUN, f"would {decision.action} ({sizes}): "
                                                                    f"{decision.reason}"))
        return ScalingPlan(decision, history=autoscale.append_history(history, entry), events=tuple(events))
    patches = []
    for pool in autoscale.POOLS:
        after = decision.replicas(pool)
        if after != before[pool]:
            child = name + constants.CHILD_NAME_SUFFIXES[pool]  # the pool's Deployment
            patches.append((child, [{"op": "test", "path": "/spec/replicas", "value": before[pool]},
                                    {"op": "replace", "path": "/spec/replicas", "value": int(after)}]))
            reason = constants.EVENT_SCALED_PREFILL if pool == autoscale.PREFILL else constants.EVENT_SCALED_DECODE
            events.append(("Normal", reason, f"{pool} {before[pool]} -> {after} ({decision.action}, "
                                             f"{decision.code}): {decision.reason}"))
    return ScalingPlan(decision, patches=tuple(patches), history=autoscale.append_history(history, entry),
                       events=tuple(events))


async def run_autoscaler(api: KubeApi, rlrun: dict[str, Any], workloads: list[dict[str, Any]],
                         pods: list[dict[str, Any]], scrape: observe.Scrape, view: AutoscalingView,
                         run_state: RunState, now: float) -> tuple[list[dict[str, Any]], ScalingPlan | None]:
    """One autoscaler decision of a run (observe -> decide -> plan_scaling -> patch the Deployments).
    Returns the workloads with the patched Deployments as the API answered, and the plan (None when a
    patch was refused because the replicas changed meanwhile: nothing is recorded, the next interval
    decides again from the live values)."""
    meta = rlrun["metadata"]
    observations = observe.get_observations(workloads, pods, scrape)
    state = run_state.autoscale or autoscale.get_state_from_history(
        (rlrun.get("status") or {}).get("scalingHistory"))
    decision = autoscale.decide(observations, state, view, now)
    plan = plan_scaling(rlrun, decision, now, view.dry_run, run_state.autoscale_known)
    patched: dict[str, dict[str, Any]] = {}
    for child, ops in plan.patches:
        try:
            patched[child] = await api.json_patch("Deployment", meta["namespace"], child, ops)
        except ApiError as exc:
            if exc.status in (404, 409, 422):
                run_state.autoscale_time = now
                run_state.autoscale_known = None
                return workloads, None
            raise
        metrics.CHILD_WRITES.labels("scale").inc()
    run_state.autoscale, run_state.autoscale_time = decision.state, now
    applied = not view.dry_run
    run_state.autoscale_known = {p: decision.replicas(p) if applied else observations.pool(p).desired
                                 for p in autoscale.POOLS}
    metrics.set_autoscaler(meta["namespace"], meta["name"], {p: decision.replicas(p) for p in autoscale.POOLS},
                           {p: observations.pool(p).ready for p in autoscale.POOLS}, decision.action, decision.code)
    out = [{**patched[o["metadata"]["name"]], "kind": "Deployment"}
           if o.get("kind") == "Deployment" and o.get("metadata", {}).get("name") in patched else o for o in workloads]
    return out, plan


async def refresh_run(api: KubeApi, session: aiohttp.ClientSession, rlrun: dict[str, Any],
                      reconciled_generation: int | None, invalid: list[str], run_state: RunState | None = None,
                      clock: Callable[[], float] = time.time) -> StatusChange:
    """Read the run's workloads, pods and other children, scrape its orchestrator and inference pods,
    re-export the scraped values as operator metrics, run the autoscaler when it is due (``run_state``
    given and get_autoscaling says so; ``clock``: unix time), and return the status change (empty when
    nothing changed) with the rendered children that are missing and the Events to post."""
    meta = rlrun["metadata"]
    try:
        workloads = await observe.read_workloads(api, meta["namespace"], meta["name"])
        pods = await observe.read_pods(api, meta["namespace"], meta["name"])
        others = await observe.read_children(api, meta["namespace"], meta["name"])
    except Exception:
        metrics.RECONCILE_ERRORS.labels("refresh").inc()
        raise
    scrape = await observe.read_scrape(session, pods)
    progress, depth = scrape.progress, scrape.depth
    metrics.set_run_progress(meta["namespace"], meta["name"], progress, depth)
    plan = None
    view = get_autoscaling(rlrun, reconciled_generation, invalid) if run_state is not None else None
    if view is not None and run_state is not None:
        now = clock()
        if is_autoscale_due(run_state.autoscale_time, now, view):
            workloads, plan = await run_autoscaler(api, rlrun, workloads, pods, scrape, view, run_state, now)
    change = plan_status(rlrun, workloads, progress, reconciled_generation, invalid, others=others,
                         failure=observe.get_orchestrator_failure(pods))
    if plan is None:
        return change
    patch = {**change.patch, "scalingHistory": plan.history} if plan.history is not None else change.patch
    return dataclasses.replace(change, patch=patch, events=plan.events)
