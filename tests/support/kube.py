"""A Kubernetes API server for tests: kmock's KubernetesEmulator plus a fidelity layer, and a helper that
runs the real operator (kopf, over HTTP) against it.

kmock 0.8 (pinned: this layer uses its internals `_handle`, `_serve_list`, `_buses`, `_lock`) is an
in-memory object store served over HTTP. What it lacks and this layer adds, the way kube-apiserver does it:
- on create: metadata.uid, resourceVersion, generation 1, creationTimestamp, namespace, apiVersion, kind;
- on every write: a new resourceVersion (one global counter; a merge patch that names another
  metadata.resourceVersion answers 409, as kube-apiserver's precondition); generation + 1 when anything outside
  metadata and status changed;
- JSON patches whose ``test`` op fails answer 422 (kmock: 500); JSON-patch and merge-patch both supported;
- the status subresource: PATCH .../status changes only ``status``; a PATCH of the main resource of a kind
  with a status subresource leaves ``status`` alone;
- watches from a resourceVersion do not replay objects the client already listed (kmock replays all);
- ``labelSelector`` on lists (equality, ``!=``, ``in``/``notin``, existence, ``!key``);
- ownerReference garbage collection: when an object is gone, its dependents (by ownerReferences.uid) are
  deleted in the background, recursively (finalizers honoured: they only get a deletionTimestamp);
- foreground cascading deletion (DELETE with ``propagationPolicy: Foreground``): an object with live
  dependents gets the ``foregroundDeletion`` finalizer and a deletionTimestamp, so it stays (a create of
  the same name answers 409) until its dependents are gone, then it is deleted;
- with ``check_kinds`` (``serve_kubernetes``'s default): the API server's validation of the built-in kinds a
  run owns (CHECKED_KINDS), emulated with kubernetes-validate (strict, the pinned KUBE_VERSION schemas) on
  create and on every patch of the main resource: an invalid object answers 422 Invalid, as
  kube-apiserver does, and is not stored. (Not the server's full validation: schema and unknown fields
  only, no cross-field rules.)
Optionally (``defaulter``, off unless a test sets it): the API server's defaulting of the fields it fills in
(a function of (kind, object) that adds them in place), applied like kube-apiserver does on create and on every
write of the main resource, before validation and before the generation is compared.
Every write request (POST, PUT, PATCH, DELETE) is recorded in ``writes`` for the tests to count (kmock's
own request views only see the requests in flight: see ``__iter__``).
Not emulated (the operator must not rely on them): admission, schema validation and defaulting, field
selectors, watch bookmarks and 410 Gone, server-side apply, strategic merge (treated as merge).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import re
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import jsonpatch
import kmock
import kopf
from kmock._internal import enums

from rlrun_api import constants
from rlrun_operator.config import OperatorConfig
from rlrun_operator.handlers import get_registry
from rlrun_operator.kubeapi import KINDS, KubeApi, get_api_client
from rlrun_operator.memo import OperatorMemo

# Kinds with a status subresource (patching the main resource keeps their status).
STATUS_SUBRESOURCE_KINDS = {"Deployment", "StatefulSet", "Job", "Pod", "PersistentVolumeClaim", "Service",
                            constants.KIND}
KIND_BY_RESOURCE = {(info.api_version, info.plural): kind for kind, info in KINDS.items()}
# Built-in kinds whose writes are checked against the official schemas when ``check_kinds`` is on.
CHECKED_KINDS = {"ConfigMap", "PersistentVolumeClaim", "ServiceAccount", "Role", "RoleBinding", "Service",
                 "NetworkPolicy", "StatefulSet", "Deployment", "Job"}
KUBE_VERSION = "1.37"  # the newest schemas kubernetes-validate 1.37.0 ships
FOREGROUND_FINALIZER = "foregroundDeletion"  # what kube-apiserver puts on an object in foreground deletion


@dataclass(frozen=True)
class Write:
    """One write request the emulator served."""

    method: str
    kind: str
    namespace: str | None
    name: str | None
    subresource: str | None
    status: int
    body: Any = None


def _api_version(resource: kmock.resource) -> str:
    return resource.version if not resource.group else f"{resource.group}/{resource.version}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_REQ = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def match_selector(selector: str, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics for one object's labels. Raises ValueError on bad syntax."""
    parts = re.split(r",(?![^(]*\))", selector) if selector.strip() else []
    for part in parts:
        m = _REQ.match(part)
        if not m:
            raise ValueError(f"bad label selector {selector!r}")
        negate, key, op, value, set_op, values = m.groups()
        if negate:
            ok = key not in labels
        elif op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        elif set_op:
            options = {v.strip() for v in values.split(",")}
            ok = (labels.get(key) in options) if set_op == "in" else (labels.get(key) not in options)
        else:
            ok = key in labels
        if not ok:
            return False
    return True


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch turning ``old`` into ``new`` (what kmock then applies)."""
    diff: dict[str, Any] = {}
    for key in old:
        if key not in new:
            diff[key] = None
    for key, value in new.items():
        if key not in old:
            diff[key] = value
        elif isinstance(value, dict) and isinstance(old[key], dict):
            sub = _merge_diff(old[key], value)
            if sub:
                diff[key] = sub
        elif old[key] != value:
            diff[key] = value
    return diff


class FidelityEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the fidelity layer described in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.revision = 0
        self.check_kinds = False
        # (kind, object) -> None, adding server-defaulted fields in place (None: no defaulting); see _default.
        self.defaulter: Callable[[str, dict[str, Any]], None] | None = None
        self.foreground: set[Any] = set()  # keys of objects in foreground deletion
        self.writes: list[Write] = []
        self.write_lock = asyncio.Lock()
        self.routing: list[kmock.Request] = []
        for kind, info in KINDS.items():
            group, _, version = info.api_version.rpartition("/")
            subresources = ["status"] if kind in STATUS_SUBRESOURCE_KINDS else []
            self.resources[f"{group}/{version}/{info.plural}"] = kmock.ResourceInfo(
                kind=kind, namespaced=True, subresources=subresources,
                verbs=["create", "get", "list", "watch", "patch", "update", "delete"])
        # Cluster-scoped resources kopf's own machinery looks for in discovery.
        self.resources["/v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False,
                                                              verbs=["get", "list", "watch"])
        self.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs=["get", "list", "watch"])

    def _next_revision(self) -> str:
        self.revision += 1
        return str(self.revision)

    def kind_of(self, resource: kmock.resource) -> str:
        """The kind served at a resource (our known kinds; else the plural)."""
        return KIND_BY_RESOURCE.get((_api_version(resource), resource.plural), str(resource.plural))

    def find(self, kind: str, namespace: str | None = None, selector: str = "") -> list[dict[str, Any]]:
        """Live (not deleted) objects of ``kind`` as plain dicts, for assertions."""
        out = []
        for (resource, ns, _), obj in list(self.objects.items()):
            if obj.deleted or self.kind_of(resource) != kind or (namespace and ns != namespace):
                continue
            raw = copy.deepcopy(obj.raw)
            if match_selector(selector, raw.get("metadata", {}).get("labels") or {}):
                out.append(raw)
        return out

    def write_count(self, kinds: set[str] | None = None, exclude: set[str] = frozenset({"Event"})) -> int:
        """Number of write requests served, optionally only for ``kinds``; Events excluded by default."""
        return sum(1 for w in self.writes if (kinds is None or w.kind in kinds) and w.kind not in exclude)

    def __iter__(self) -> Any:
        # kmock routes a request by checking it against every reaction's view, and the root view is the
        # list of ALL requests served so far: quadratic in the number of requests (78 ms per request after
        # a few thousand). Routing only needs the requests being handled now.
        yield from list(self.routing)

    async def _handle(self, request: kmock.Request) -> Any:
        self.routing.append(request)
        try:
            return await self._handle_with_fidelity(request)
        finally:
            self.routing.remove(request)

    async def _handle_with_fidelity(self, request: kmock.Request) -> Any:
        if request.resource is None or request.action not in (enums.action.CREATE, enums.action.UPDATE,
                                                              enums.action.DELETE):
            return await super()._handle(request)
        kind = self.kind_of(request.resource)
        async with self.write_lock:
            key = (request.resource, request.namespace, request.name)
            sent = copy.deepcopy(request.data)
            try:
                if request.action == enums.action.CREATE:
                    self._prepare_create(request, kind)
                elif request.action == enums.action.UPDATE:
                    self._prepare_update(request, key, kind)
            except kmock.KubernetesError as exc:
                self.writes.append(Write(request.method.value, kind, request.namespace, request.name,
                                         request.subresource, exc.status, sent))
                return await self._render_error(exc)
            gone_uid = None
            if key in self.objects and not self.objects[key].deleted:
                gone_uid = self.objects[key].raw.get("metadata", {}).get("uid")
            foreground = (request.action == enums.action.DELETE and gone_uid is not None
                          and isinstance(request.data, dict)
                          and request.data.get("propagationPolicy") == "Foreground"
                          and not self.objects[key].raw.get("metadata", {}).get("deletionTimestamp")
                          and self._has_dependents(gone_uid))
            if foreground:
                self.foreground.add(key)
                meta = self.objects[key].raw.get("metadata", {})
                self.objects[key].patch({"metadata": {
                    "finalizers": [*(meta.get("finalizers") or []), FOREGROUND_FINALIZER],
                    "resourceVersion": self._next_revision()}})
            response = await super()._handle(request)
            self.writes.append(Write(request.method.value, kind, request.namespace, request.name,
                                     request.subresource, response.status, sent))
            if foreground:
                await self._collect_garbage(gone_uid)
            elif gone_uid and (key not in self.objects or self.objects[key].deleted):
                await self._collect_garbage(gone_uid)
            if self.foreground:
                await self._finish_foreground()
            return response

    def _has_dependents(self, owner_uid: str) -> bool:
        return any(not obj.deleted and any(ref.get("uid") == owner_uid
                                           for ref in obj.raw.get("metadata", {}).get("ownerReferences") or [])
                   for obj in list(self.objects.values()))

    async def _finish_foreground(self) -> None:
        """Delete the objects in foreground deletion whose dependents are all gone (then collect theirs)."""
        done: list[str] = []
        async with self._lock:
            for key in list(self.foreground):
                (resource, _, _), obj = key, self.objects[key]
                meta = {} if obj.deleted else (obj.raw.get("metadata") or {})
                if FOREGROUND_FINALIZER not in (meta.get("finalizers") or []):
                    self.foreground.discard(key)
                    continue
                if self._has_dependents(meta["uid"]):
                    continue
                self.foreground.discard(key)
                rest = [f for f in meta["finalizers"] if f != FOREGROUND_FINALIZER]
                if rest:
                    obj.patch({"metadata": {"finalizers": rest, "resourceVersion": self._next_revision()}})
                    await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})
                    continue
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})
                done.append(meta["uid"])
        for uid in done:
            await self._collect_garbage(uid)

    def _prepare_create(self, request: kmock.Request, kind: str) -> None:
        body = request.data
        if not isinstance(body, dict):
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="body is not an object")
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta.setdefault("namespace", request.namespace)
        body.setdefault("apiVersion", _api_version(request.resource))
        body.setdefault("kind", kind)
        self._default(kind, body)
        self._check(kind, body)
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_revision(), generation=1,
                    creationTimestamp=_now())

    def _default(self, kind: str, obj: dict[str, Any]) -> None:
        """Fill in the server-defaulted fields of ``obj`` (in place) when a test set ``defaulter``."""
        if self.defaulter is not None:
            self.defaulter(kind, obj)

    def _check(self, kind: str, obj: dict[str, Any]) -> None:
        """Raise 422 Invalid for a built-in object the official schema refuses (when ``check_kinds``)."""
        if not self.check_kinds or kind not in CHECKED_KINDS:
            return
        import kubernetes_validate  # here: the benchmark uses this module without it (check_kinds off)

        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            first = str(exc).splitlines()[0]
            name = obj.get("metadata", {}).get("name", "")
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message=f'{kind} "{name}" is invalid: {where}: {first}') from None

    def _prepare_update(self, request: kmock.Request, key: Any, kind: str) -> None:
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        old = copy.deepcopy(self.objects[key].raw)
        patch = request.data
        expected = ((patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None)
        if expected is not None and str(expected) != str(old.get("metadata", {}).get("resourceVersion")):
            # kube-apiserver: a resourceVersion in a patch is a precondition, checked before the patch applies
            raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                f'Operation cannot be fulfilled on {kind} "{old.get("metadata", {}).get("name")}": the object '
                "has been modified; please apply your changes to the latest version and try again"))
        try:
            if isinstance(patch, list):
                new = jsonpatch.apply_patch(old, patch, in_place=False)
            elif isinstance(patch, dict):
                new = _merge_patch(old, patch)
            else:
                raise kmock.KubernetesError(status=400, reason="BadRequest", message="unsupported patch body")
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=f"test failed: {exc}") from exc
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        new = copy.deepcopy(new)  # never share nested dicts with ``old``
        if request.subresource == "status":
            new = {**old, "status": new.get("status")} if new.get("status") is not None else \
                {k: v for k, v in old.items() if k != "status"}
        elif kind in STATUS_SUBRESOURCE_KINDS:
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in old:
                new["status"] = old["status"]
        meta = new.setdefault("metadata", {})
        for immutable in ("uid", "creationTimestamp", "namespace", "name"):
            if immutable in old.get("metadata", {}):
                meta[immutable] = old["metadata"][immutable]
        if request.subresource is None:
            self._default(kind, new)
        content_old = {k: v for k, v in old.items() if k not in ("metadata", "status")}
        content_new = {k: v for k, v in new.items() if k not in ("metadata", "status")}
        if content_old != content_new:
            meta["generation"] = int(old.get("metadata", {}).get("generation", 1)) + 1
        if request.subresource is None:
            self._check(kind, new)
        meta["resourceVersion"] = self._next_revision()
        diff = _merge_diff(old, new)
        if isinstance(request.data, list):
            request.data[:] = [{"op": "replace", "path": "", "value": new}]
        else:
            request.data.clear()
            request.data.update(diff)

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = (request.params or {}).get("labelSelector", "")
        if selector:
            result["items"] = [o for o in result["items"]
                               if match_selector(selector, (o.get("metadata") or {}).get("labels") or {})]
        result["metadata"]["resourceVersion"] = str(self.revision)
        return result

    # kmock finds the object of a fetch/create/patch/delete by scanning every stored object (O(objects) per
    # request); these look it up by key, as an API server's storage does.
    def _stored(self, request: kmock.Request, namespace: str | None = None, name: str | None = None) -> Any:
        key = (request.resource, namespace or request.namespace, name or request.name)
        return self.objects[key] if key in self.objects else None

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = self._stored(request)
        if obj is None or obj.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return obj.raw

    async def _serve_create(self, request: kmock.Request) -> Any:
        meta = (request.data or {}).get("metadata", {}) if isinstance(request.data, dict) else {}
        return self._stored(request, meta.get("namespace"), meta.get("name")).last.raw

    async def _serve_update(self, request: kmock.Request) -> Any:
        return self._stored(request).last.raw

    async def _serve_delete(self, request: kmock.Request) -> Any:
        return self._stored(request).last.raw

    async def _serve_watch(self, request: kmock.Request) -> Any:
        # kmock replays every existing object as ADDED; a watch from resourceVersion N (what a client
        # passes after a list) must not see objects again that it already listed.
        since = (request.params or {}).get("resourceVersion", "")
        async for item in super()._serve_watch(request):
            if since.isdigit() and isinstance(item, dict) and item.get("type") == "ADDED":
                version = str((item.get("object") or {}).get("metadata", {}).get("resourceVersion", "0"))
                if version.isdigit() and int(version) <= int(since):
                    continue
            yield item

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Background-propagation deletion of the dependents of a deleted owner, recursively."""
        gone: list[str] = []
        async with self._lock:
            for (resource, _, _), obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                raw = obj.raw
                meta = raw.get("metadata") or {}
                if not any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or []):
                    continue
                if meta.get("finalizers"):
                    if not meta.get("deletionTimestamp"):
                        obj.patch({"metadata": {"deletionTimestamp": _now(),
                                                "resourceVersion": self._next_revision()}})
                        await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})
                    continue
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})
                if meta.get("uid"):
                    gone.append(meta["uid"])
        for uid in gone:
            await self._collect_garbage(uid)


@contextlib.asynccontextmanager
async def serve_kubernetes(check_kinds: bool = True) -> AsyncIterator[tuple[FidelityEmulator, str]]:
    """Start the emulator on a free loopback port; yields (emulator, server URL). ``check_kinds``: answer
    422 for built-in objects the official schemas refuse (see the module docstring)."""
    async with FidelityEmulator() as emulator, kmock.Server(emulator) as server:
        emulator.check_kinds = check_kinds
        yield emulator, str(server.url).rstrip("/")


@contextlib.asynccontextmanager
async def run_operator(server: str, status_interval: float = 1.0,
                       operator_namespace: str | None = None) -> AsyncIterator[OperatorMemo]:
    """Run the real operator (rlrun_operator.handlers) embedded, cluster-wide and standalone, logged in
    to ``server`` through an ``@kopf.on.login`` handler; stops it (stop flag, then cancel) on exit.
    ``operator_namespace``: the namespace the operator believes it runs in (None: its own default)."""
    config = OperatorConfig.from_env({}, status_interval_s=status_interval, operator_namespace=operator_namespace)
    registry = get_registry(config, login=False)

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=server)

    memo = OperatorMemo(config=config, api=KubeApi(get_api_client(server)))
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=registry, clusterwide=True, standalone=True,
                                             memo=memo, ready_flag=ready, stop_flag=stop))
    try:
        await asyncio.wait_for(ready.wait(), timeout=30)
        yield memo
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def wait_for(predicate: Any, timeout: float = 20.0, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` (sync) until it returns a truthy value; returns it. Raises TimeoutError."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def count_refreshes(namespace: str, name: str) -> float:
    """Status refreshes the embedded operator's timer has finished for the run (its own counter)."""
    from rlrun_operator import metrics

    return metrics.REGISTRY.get_sample_value(
        "rlrun_operator_status_refreshes_total", {"namespace": namespace, "name": name}) or 0.0


async def wait_for_refreshes(namespace: str, name: str, count: int, timeout: float = 30.0) -> None:
    """Wait until the operator's timer has refreshed the run ``count`` more times: an idle window measured in
    the operator's own work, not in seconds, so a slow machine cannot shorten it."""
    start = count_refreshes(namespace, name)
    await wait_for(lambda: count_refreshes(namespace, name) >= start + count, timeout=timeout)
