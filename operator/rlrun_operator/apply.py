"""Create-or-patch of a run's children: pure planning (`get_*`, `plan_*`) apart from the API calls (`apply_*`).

Rules (docs/operator.md explains them):
- A child is created when absent. When present, it is patched only if the hash of its rendered content
  (stored on the child in constants.ANNOTATION_SPEC_HASH) differs from the rendered one, so a reconcile with
  nothing to change makes no write call at all.
- A patch is an RFC 6902 JSON patch guarded by a ``test`` of metadata.resourceVersion (a conflicting writer
  makes it fail with 422; the child is then read again and re-planned). It sets our labels, annotations and
  ownerReferences key by key and replaces each top-level field we render (each key of ``spec`` separately),
  so fields set by the API server or by others (a Service's clusterIP, foreign labels) are left alone.
- The replicas of the inference/prefill/decode Deployments are seeded from the render at creation; after
  that the live value is kept (a person's ``kubectl scale``, the autoscaler's decision) and a patch sends
  replicas only in three cases (plan_replicas): suspend scales to 0 after saving the live count in
  constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND, resume restores that count, and, with autoscaling off, a
  change of the spec's size fields (compared with constants.ANNOTATION_APPLIED_SIZES, the sizes last
  applied) resizes the pool to the new spec, with an Event. Never ``replicas: null``.
- A Job's pod template is immutable: when the orchestrator Job's rendered content changes it is deleted
  with foreground propagation (the Job stays, with a deletionTimestamp, until its pods are gone, so the
  create answers 409 and is retried — ApplyConflict after MAX_ATTEMPTS, then kopf's retry: two
  orchestrators never run at once) and created again; ``spec.suspend`` alone is patched in place.
- A 422 that is not a failed resourceVersion ``test`` means the API server refuses the rendered object
  itself: InvalidChild, reported as InvalidSpec, never retried in a loop.
- A PersistentVolumeClaim is only ever created (its spec is immutable but for a resize, done by hand).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

import orjson

from rlrun_api import constants
from rlrun_operator.kubeapi import ApiError, KubeApi

# Deployments whose replicas the operator owns after creation (seeded by render).
# Kinds a spec change can make obsolete (deleted when no longer rendered). PVCs are never deleted.
PRUNABLE_KINDS = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Service", "NetworkPolicy",
                  "StatefulSet", "Deployment", "Job")
CREATE_ONLY_KINDS = ("PersistentVolumeClaim",)
MAX_ATTEMPTS = 4


EventSpec = tuple[str, str, str]  # (type, reason, message) of an Event to post on the RLRun


@dataclass(frozen=True)
class Plan:
    """What to do with one child: ``action`` is create | patch | replace | none; ``body`` for create and
    replace (the object to POST), ``ops`` for patch (a JSON patch); ``events`` to post once it is done."""

    action: str
    body: dict[str, Any] | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)
    events: tuple[EventSpec, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """Result of applying one child: the action taken, the live object afterwards ({} for a child this
    call wrote without asking for the answer: apply_children's ``answered``) and the Events to post (a pool
    resized to a new spec, plan_replicas)."""

    kind: str
    name: str
    action: str
    obj: dict[str, Any]
    events: tuple[EventSpec, ...] = ()


@dataclass(frozen=True)
class PoolSizes:
    """Where the pool Deployments' replicas come from in one reconcile (reconcile.get_pool_sizes).

    Attributes:
        fields: the spec's size fields the pools are sized from, by path: ``{"spec.inference.replicas": 2}``,
            or ``{"spec.inference.disaggregation.ratio": "1:2", "spec.inference.disaggregation.replicas": 6}``
            when disaggregated. Stored on every pool Deployment (``encoded()``) in
            constants.ANNOTATION_APPLIED_SIZES when its replicas are set from them.
        autoscaled: the autoscaler owns the replicas (spec.autoscaling.enabled on a disaggregated run, not
            dryRun): a change of ``fields`` is not applied to the pools (the spec's sizes were the initial split).
    """

    fields: Mapping[str, Any]
    autoscaled: bool = False

    def encoded(self) -> str:
        """``fields`` as canonical JSON (sorted keys, no spaces), the annotation's value."""
        return json.dumps(dict(self.fields), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ReplicaPlan:
    """JSON-patch ops on a pool Deployment's replicas and annotations (plan_replicas), and the Events that
    say why."""

    ops: list[dict[str, Any]] = field(default_factory=list)
    events: tuple[EventSpec, ...] = ()


def is_scaled(manifest: dict[str, Any]) -> bool:
    """True for the Deployments whose replicas the operator keeps after creation (inference/prefill/decode)."""
    labels = manifest.get("metadata", {}).get("labels") or {}
    return manifest.get("kind") == "Deployment" and labels.get(constants.LABEL_COMPONENT) in constants.POOL_COMPONENTS


def _volatile_spec_key(manifest: dict[str, Any]) -> str | None:
    if is_scaled(manifest):
        return "replicas"
    if manifest.get("kind") == "Job":
        return "suspend"
    return None


# Annotations stamped at apply time, not rendered: never part of the spec hash.
_UNHASHED_ANNOTATIONS = frozenset({constants.ANNOTATION_SPEC_HASH, constants.ANNOTATION_APPLIED_SIZES})


def get_spec_hash(manifest: dict[str, Any]) -> str:
    """Stable hash (16 hex chars of SHA-256 over canonical JSON) of everything we render for a child, minus
    the fields handled apart: a scaled Deployment's ``spec.replicas``, a Job's ``spec.suspend``, ``status``,
    the hash annotation itself and the applied-sizes annotation (neither is rendered)."""
    # Shallow copies of the few dicts we drop keys from; the rest is only read.
    body = {k: v for k, v in manifest.items() if k != "status"}
    meta = dict(body.get("metadata") or {})
    if _UNHASHED_ANNOTATIONS & set(meta.get("annotations") or {}):
        meta["annotations"] = {k: v for k, v in meta["annotations"].items() if k not in _UNHASHED_ANNOTATIONS}
    body["metadata"] = meta
    volatile = _volatile_spec_key(manifest)
    if volatile is not None and isinstance(body.get("spec"), dict):
        body["spec"] = {k: v for k, v in body["spec"].items() if k != volatile}
    # orjson writes the text json.dumps(sort_keys=True, separators=(",", ":")) writes, 7x faster (0.05 ms
    # for a run's 14 children), except for non-ASCII text and DEL (raw bytes where json writes \u escapes),
    # floats below 1e-4 (0.00001 for 1e-05), and NaN, infinities, datetimes and UUIDs (which json refuses or
    # writes otherwise). Non-ASCII, DEL and what orjson refuses take json.dumps, so those hashes stay as earlier
    # releases stamped them; the other cases never reach a rendered child (validation's check_values refuses
    # them in a spec, and the spec's floats are in the ConfigMap's text).
    try:
        text = orjson.dumps(body, option=orjson.OPT_SORT_KEYS, default=str)
    except TypeError:  # orjson.JSONEncodeError: e.g. a non-string key or an integer beyond 64 bits
        text = b"\xff"
    if not text.isascii() or b"\x7f" in text:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def get_creatable(manifest: dict[str, Any], suspended: bool, sizes: PoolSizes | None = None) -> dict[str, Any]:
    """The object to POST: the manifest with its spec-hash annotation; a scaled Deployment of a suspended
    run starts at 0 replicas and remembers its seed in ANNOTATION_REPLICAS_BEFORE_SUSPEND; with ``sizes``,
    a scaled Deployment also records the size fields it was seeded from (ANNOTATION_APPLIED_SIZES)."""
    body = dict(manifest)  # shallow: only metadata.annotations and spec.replicas are replaced below
    meta = body["metadata"] = dict(manifest.get("metadata") or {})
    annotations = meta["annotations"] = dict(meta.get("annotations") or {})
    annotations[constants.ANNOTATION_SPEC_HASH] = get_spec_hash(manifest)
    if sizes is not None and is_scaled(manifest):
        annotations[constants.ANNOTATION_APPLIED_SIZES] = sizes.encoded()
    if suspended and is_scaled(manifest):
        seed = int(manifest.get("spec", {}).get("replicas", 1) or 0)
        if seed > 0:
            annotations[constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND] = str(seed)
        body["spec"] = {**manifest["spec"], "replicas": 0}
    return body


def _pointer(*parts: str) -> str:
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in parts)


def _map_ops(live_meta: dict[str, Any], key: str, wanted: dict[str, str]) -> list[dict[str, Any]]:
    live_map = live_meta.get(key) or {}
    return [{"op": "add", "path": _pointer("metadata", key, k), "value": v}
            for k, v in sorted(wanted.items()) if live_map.get(k) != v]


def get_content_ops(desired: dict[str, Any], live: dict[str, Any]) -> list[dict[str, Any]]:
    """JSON-patch ops that make ``live`` carry everything ``desired`` renders (labels, annotations and
    ownerReferences merged key by key; each rendered top-level field, and each key of ``spec``, replaced;
    the volatile spec key left out)."""
    meta = desired.get("metadata", {})
    live_meta = live.get("metadata", {})
    ops = _map_ops(live_meta, "labels", meta.get("labels") or {})
    ops += _map_ops(live_meta, "annotations", meta.get("annotations") or {})
    if "ownerReferences" in meta and live_meta.get("ownerReferences") != meta["ownerReferences"]:
        ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": meta["ownerReferences"]})
    volatile = _volatile_spec_key(desired)
    for key, value in desired.items():
        if key in ("apiVersion", "kind", "metadata", "status"):
            continue
        if key == "spec" and isinstance(value, dict) and isinstance(live.get("spec"), dict):
            for sub, sub_value in value.items():
                if sub != volatile and live["spec"].get(sub) != sub_value:
                    ops.append({"op": "add", "path": _pointer("spec", sub), "value": sub_value})
        elif live.get(key) != value:
            ops.append({"op": "add", "path": _pointer(key), "value": value})
    return ops


def get_applied_sizes(live: dict[str, Any]) -> dict[str, Any] | None:
    """The size fields a live pool Deployment's replicas were last set from (ANNOTATION_APPLIED_SIZES), or
    None when it has none (created before the annotation existed) or it does not parse as a JSON object."""
    text = (live.get("metadata", {}).get("annotations") or {}).get(constants.ANNOTATION_APPLIED_SIZES)
    try:
        found = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def get_size_changes(applied: Mapping[str, Any], wanted: Mapping[str, Any]) -> str:
    """The size fields that differ, as "path old -> new" joined by "; " (a missing field reads "unset")."""
    return "; ".join(f"{key} {applied.get(key, 'unset')} -> {wanted.get(key, 'unset')}"
                     for key in sorted(set(applied) | set(wanted)) if applied.get(key) != wanted.get(key))


def plan_replicas(desired: dict[str, Any], live: dict[str, Any], suspended: bool,
                  sizes: PoolSizes | None = None) -> ReplicaPlan:
    """Who sets a scaled (inference/prefill/decode) Deployment's replicas in this reconcile (pure).

    Args:
        desired: the rendered Deployment; its ``spec.replicas`` is the spec's size for the pool (the seed).
        live: the Deployment as the API server has it.
        suspended: the run is suspended (or finished).
        sizes: the spec's size fields and whether the autoscaler owns the replicas; None: the live replicas
            are kept but for suspend/resume (the rule before the applied-sizes annotation existed).

    Returns:
        ReplicaPlan: ``ops`` that never carry ``replicas: null``, and Events. Rules:
        - suspended: save the live count (ANNOTATION_REPLICAS_BEFORE_SUSPEND) and scale to 0;
        - otherwise the current count is the saved one (resume: restored, the annotation removed) or the live
          one, and it is kept, unless the spec's size fields differ from ANNOTATION_APPLIED_SIZES: with
          autoscaling off the pool is set to the spec's size and the annotation to the new fields (Event
          ``Resized`` naming the fields and the replicas old -> new, when the count changes); with autoscaling
          on nothing changes (Event ``ResizeLeftToAutoscaler``, the annotation keeps the sizes last applied);
        - a Deployment without a readable annotation (created before it existed) gets the current fields
          stamped and keeps its replicas; nothing else is written while suspended.
    """
    if not is_scaled(desired):
        return ReplicaPlan()
    annotations = live.get("metadata", {}).get("annotations") or {}
    saved = annotations.get(constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND)
    live_replicas = live.get("spec", {}).get("replicas", 1)  # absent: the API server's default, 1
    saved_path = _pointer("metadata", "annotations", constants.ANNOTATION_REPLICAS_BEFORE_SUSPEND)
    sizes_path = _pointer("metadata", "annotations", constants.ANNOTATION_APPLIED_SIZES)
    applied = get_applied_sizes(live) if sizes is not None else None
    ops: list[dict[str, Any]] = []
    events: list[EventSpec] = []
    if sizes is not None and applied is None:  # adopt: the current spec counts as applied; nothing is resized
        ops.append({"op": "add", "path": sizes_path, "value": sizes.encoded()})
    if suspended:
        if live_replicas != 0:
            ops.append({"op": "add", "path": saved_path, "value": str(live_replicas)})
            ops.append({"op": "add", "path": "/spec/replicas", "value": 0})
        return ReplicaPlan(ops)
    current = int(saved) if saved is not None else live_replicas
    target = current
    if sizes is not None and applied is not None and applied != dict(sizes.fields):
        changes = get_size_changes(applied, sizes.fields)
        component = desired["metadata"]["labels"][constants.LABEL_COMPONENT]
        if sizes.autoscaled:
            events.append(("Normal", constants.EVENT_RESIZE_LEFT_TO_AUTOSCALER,
                           f"{changes}: not applied, spec.autoscaling.enabled lets the autoscaler own the replicas "
                           f"(the spec's sizes are the initial split only)"))
        else:
            target = int(desired.get("spec", {}).get("replicas", 1))
            ops.append({"op": "add", "path": sizes_path, "value": sizes.encoded()})
            if target != current:
                events.append(("Normal", constants.EVENT_RESIZED,
                               f"{changes}: {component} replicas {current} -> {target}"))
    if saved is not None:
        ops.append({"op": "add", "path": "/spec/replicas", "value": target})
        ops.append({"op": "remove", "path": saved_path})
    elif target != live_replicas:
        ops.append({"op": "add", "path": "/spec/replicas", "value": target})
    return ReplicaPlan(ops, tuple(events))


def plan_child(desired: dict[str, Any], live: dict[str, Any] | None, suspended: bool,
               sizes: PoolSizes | None = None) -> Plan:
    """Decide how to converge one child (pure).

    Args:
        desired: the rendered manifest (without the spec-hash annotation).
        live: the object as the API server has it, or None when absent.
        suspended: the RLRun's spec.suspend.
        sizes: the spec's pool size fields (plan_replicas); None keeps the live replicas of the pools.

    Returns:
        Plan(create | patch | replace | none), with the Events of plan_replicas (also on "none": a spec
        resize left to the autoscaler). A patch's ops start with a ``test`` of resourceVersion.
    """
    if live is None:
        return Plan("create", body=get_creatable(desired, suspended, sizes))
    if desired["kind"] in CREATE_ONLY_KINDS:
        return Plan("none")
    live_hash = (live.get("metadata", {}).get("annotations") or {}).get(constants.ANNOTATION_SPEC_HASH)
    changed = live_hash != get_spec_hash(desired)
    if changed and desired["kind"] == "Job":
        return Plan("replace", body=get_creatable(desired, suspended))
    ops: list[dict[str, Any]] = []
    if changed:
        stamped = get_creatable(desired, suspended=False)
        ops += get_content_ops(stamped, live)
    replica_plan = plan_replicas(desired, live, suspended, sizes)
    ops += replica_plan.ops
    # Label/annotation ops add single keys: create a missing map first (JSON patch needs the parent).
    live_meta = live.get("metadata", {})
    prefix = [{"op": "add", "path": _pointer("metadata", key), "value": {}} for key in ("labels", "annotations")
              if not isinstance(live_meta.get(key), dict) and any(
                  op["path"].startswith(_pointer("metadata", key) + "/") for op in ops)]
    ops = prefix + ops
    if desired["kind"] == "Job":
        wanted = bool(desired.get("spec", {}).get("suspend", False))
        if bool(live.get("spec", {}).get("suspend", False)) != wanted:
            ops.append({"op": "add", "path": "/spec/suspend", "value": wanted})
    if not ops:
        return Plan("none", events=replica_plan.events)
    version = live.get("metadata", {}).get("resourceVersion")
    return Plan("patch", ops=[{"op": "test", "path": "/metadata/resourceVersion", "value": version}] + ops,
                events=replica_plan.events)


def plan_prune(owner_uid: str, desired: list[dict[str, Any]], live: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(kind, name) of live children owned by ``owner_uid`` (controller ownerReference) that the render no
    longer produces (pure). PVCs are never pruned (they hold the run's data)."""
    wanted = {(m["kind"], m["metadata"]["name"]) for m in desired}
    doomed = []
    for obj in live:
        key = (obj.get("kind", ""), obj.get("metadata", {}).get("name", ""))
        owners = obj.get("metadata", {}).get("ownerReferences") or []
        owned = any(ref.get("uid") == owner_uid and ref.get("controller") for ref in owners)
        if owned and key not in wanted and key[0] in PRUNABLE_KINDS:
            doomed.append(key)
    return sorted(doomed)


class ApplyConflict(Exception):
    """A child kept changing under us (or a replaced Job was not gone yet); retry the reconcile later."""


class InvalidChild(Exception):
    """The API server refused a rendered child as invalid (422 on create, or on a patch whose
    resourceVersion ``test`` held): the spec renders an object Kubernetes does not accept (e.g. a malformed
    ``spec.pod.affinity``). Retrying cannot help; the run is reported InvalidSpec until its spec changes.
    ``message`` is the API server's, prefixed with the child's kind and name."""

    def __init__(self, kind: str, name: str, message: str) -> None:
        super().__init__(f"{kind} {name} was refused by the API server: {message}")
        self.kind = kind
        self.name = name


def _tested_version(ops: list[dict[str, Any]]) -> str | None:
    """The resourceVersion a patch's leading ``test`` op expects (plan_child always puts it first)."""
    if ops and ops[0].get("op") == "test" and ops[0].get("path") == "/metadata/resourceVersion":
        return ops[0].get("value")
    return None


async def apply_child(api: KubeApi, desired: dict[str, Any], suspended: bool,
                      assume_absent: bool = False, sizes: PoolSizes | None = None, answer: bool = True) -> Outcome:
    """Converge one child: GET (skipped on the first attempt when ``assume_absent``: a brand-new run),
    plan (``sizes``: plan_child's), then create/patch/replace. A 404 or 409 re-reads and re-plans. A 422 on
    a patch re-plans only when the resourceVersion ``test`` failed (the child changed since it was read: a
    newer resourceVersion when read again); any other 422, and every 422 on create, means the object itself
    is invalid.

    ``answer=False``: a create or patch does not parse the stored object (Outcome.obj is {} then).

    Raises InvalidChild at once for an invalid object, ApplyConflict after MAX_ATTEMPTS conflicts,
    ApiError for any other API failure.
    """
    kind, meta = desired["kind"], desired["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    for attempt in range(MAX_ATTEMPTS):
        live = None if (assume_absent and attempt == 0) else await api.get(kind, namespace, name)
        plan = plan_child(desired, live, suspended, sizes)
        try:
            if plan.action == "none":
                assert live is not None
                return Outcome(kind, name, "none", live, plan.events)
            if plan.action == "create":
                return Outcome(kind, name, "create", await api.create(plan.body or {}, answer=answer))
            if plan.action == "patch":
                return Outcome(kind, name, "patch",
                               await api.json_patch(kind, namespace, name, plan.ops, answer=answer), plan.events)
            if not (live or {}).get("metadata", {}).get("deletionTimestamp"):
                # Foreground: the old Job stays until its pod is gone, so the create below answers 409
                # (retried) instead of starting a second orchestrator next to the old one.
                await api.delete(kind, namespace, name, propagation="Foreground")
            return Outcome(kind, name, "replace", await api.create(plan.body or {}))
        except ApiError as exc:
            if exc.status == 422 and plan.action == "patch":
                again = await api.get(kind, namespace, name)
                version = (again or {}).get("metadata", {}).get("resourceVersion")
                if again is not None and version == _tested_version(plan.ops):
                    raise InvalidChild(kind, name, exc.message) from exc
            elif exc.status == 422:
                raise InvalidChild(kind, name, exc.message) from exc
            elif exc.status not in (404, 409):
                raise
    raise ApplyConflict(f"{kind} {namespace}/{name}: still conflicting after {MAX_ATTEMPTS} attempts")


async def apply_children(api: KubeApi, manifests: list[dict[str, Any]], suspended: bool,
                         assume_absent: bool = False, sizes: PoolSizes | None = None,
                         answered: Collection[str] | None = None) -> list[Outcome]:
    """Converge every rendered child, in the render's apply order (``sizes``: plan_child's). Returns one
    Outcome per manifest. ``answered``: the kinds whose stored object the caller reads after a write (None:
    every kind); the API server's answers for the others are not parsed."""
    return [await apply_child(api, m, suspended, assume_absent, sizes,
                              answer=answered is None or m["kind"] in answered) for m in manifests]


async def apply_prune(api: KubeApi, namespace: str, name: str, owner_uid: str,
                      manifests: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Delete the run's children that the render no longer produces (e.g. the single inference Deployment
    after disaggregation is turned on). Lists each prunable kind by the run's instance label."""
    labels = {constants.LABEL_INSTANCE: name, constants.LABEL_MANAGED_BY: constants.MANAGED_BY}
    live: list[dict[str, Any]] = []
    for kind in PRUNABLE_KINDS:
        for obj in await api.list(kind, namespace, labels):
            live.append({**obj, "kind": obj.get("kind") or kind})
    doomed = plan_prune(owner_uid, manifests, live)
    for kind, child in doomed:
        await api.delete(kind, namespace, child)
    return doomed
