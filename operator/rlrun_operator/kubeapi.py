"""A thin asynchronous REST layer for the operator's own API calls (I/O).

The operator only needs create / get / list / patch / delete of a dozen kinds, as plain dicts. The typed
`kubernetes` APIs deserialize every answer into model objects (slow for hundreds of children) and cannot
handle the RLRun custom resource. The `kubernetes` client still does the login: its ``Configuration``
(from the pod's service account or KUBECONFIG: server, CA, client certificate, bearer token and its
refresh hook, proxy) is read on every request, and the request itself is sent with aiohttp on the
operator's event loop. (Until 2026-12 the client's urllib3 transport was used from worker threads:
0.77 ms of CPU per request against 0.29 ms now, measured against a local server, plus the thread hand-offs
competing with the event loop for the GIL; see benchmarks/README.md.) Every call has a total timeout.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
import kubernetes
import orjson

from rlrun_api import constants

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class KindInfo:
    """Where a kind lives in the REST API: ``api_version`` ("apps/v1" or "v1") and ``plural``."""

    api_version: str
    plural: str


# Every kind the operator reads or writes (all namespaced).
KINDS: dict[str, KindInfo] = {
    "ConfigMap": KindInfo("v1", "configmaps"),
    "PersistentVolumeClaim": KindInfo("v1", "persistentvolumeclaims"),
    "ServiceAccount": KindInfo("v1", "serviceaccounts"),
    "Service": KindInfo("v1", "services"),
    "Pod": KindInfo("v1", "pods"),
    "Event": KindInfo("v1", "events"),
    "Role": KindInfo("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": KindInfo("rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": KindInfo("networking.k8s.io/v1", "networkpolicies"),
    "StatefulSet": KindInfo("apps/v1", "statefulsets"),
    "Deployment": KindInfo("apps/v1", "deployments"),
    "Job": KindInfo("batch/v1", "jobs"),
    constants.KIND: KindInfo(constants.API_VERSION, constants.PLURAL),
}


class ApiError(Exception):
    """A non-2xx answer of the API server: ``status`` (HTTP code), ``reason`` and the server's message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def get_path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
    """REST path of a namespaced ``kind`` (collection when ``name`` is None), e.g.
    ``/apis/apps/v1/namespaces/rl/deployments/run-router``.

    Raises KeyError for a kind missing from KINDS.
    """
    info = KINDS[kind]
    root = "/api/v1" if info.api_version == "v1" else f"/apis/{info.api_version}"
    path = f"{root}/namespaces/{namespace}/{info.plural}"
    if name is not None:
        path += f"/{name}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def get_selector(labels: dict[str, str]) -> str:
    """Equality-based label selector text ``k1=v1,k2=v2`` (keys sorted) for ``labelSelector``."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def load_api_client() -> kubernetes.client.ApiClient:
    """An ApiClient configured like `kopf run` logs in: in-cluster service account, else KUBECONFIG.

    Raises kubernetes.config.ConfigException when neither is available.
    """
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


def get_api_client(server: str) -> kubernetes.client.ApiClient:
    """An ApiClient for an unauthenticated API server URL (a test server on loopback)."""
    config = kubernetes.client.Configuration()
    config.host = server
    return kubernetes.client.ApiClient(config)


def get_ssl(config: kubernetes.client.Configuration) -> ssl.SSLContext | bool:
    """What aiohttp's ``ssl`` argument must be for ``config``: False when it skips verification, else an
    SSLContext with its CA bundle, client certificate and hostname check (True for plain http)."""
    if not str(config.host).startswith("https"):
        return True
    if not config.verify_ssl:
        return False
    context = ssl.create_default_context(cafile=config.ssl_ca_cert)
    if config.cert_file:
        context.load_cert_chain(config.cert_file, config.key_file)
    if config.assert_hostname is False:
        context.check_hostname = False
    return context


def encode_json(body: Any) -> bytes:
    """``body`` as compact JSON (UTF-8): orjson's, 6x faster than json.dumps (the operator's largest CPU share
    per request); json.dumps's for what orjson refuses (integers beyond 64 bits), which the API server judges.
    Unlike json.dumps, orjson writes NaN and infinities as null and encodes datetimes and UUIDs itself; the
    operator's bodies hold none (a spec with them fails validation's check_values before anything is sent).

    Raises:
        TypeError: ``body`` holds a value neither can encode.
    """
    try:
        return orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(body, separators=(",", ":")).encode()


class KubeApi:
    """Async create/get/list/patch/delete of namespaced objects as dicts.

    Args:
        api_client: a configured ``kubernetes.client.ApiClient`` (see load_api_client, get_api_client); its
            configuration gives the server, TLS, proxy and the (refreshed) credentials of every request.
        timeout_s: total timeout of every request, seconds.

    The HTTP connections are opened on first use in the running event loop and kept until :meth:`close`
    (a later call opens new ones).
    """

    def __init__(self, api_client: kubernetes.client.ApiClient, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s
        self._ssl = get_ssl(api_client.configuration)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        """Close the HTTP connections (idempotent)."""
        if self._session is not None and not self._session.closed and self._loop is asyncio.get_running_loop():
            await self._session.close()

    def _get_headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self.api_client.user_agent}
        if content_type:
            headers["Content-Type"] = content_type
        auth = self.api_client.configuration.auth_settings().get("BearerToken")  # runs the refresh hook
        if auth and auth.get("value"):
            headers[auth["key"]] = auth["value"]
        return headers

    async def request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                      content_type: str | None = None, answer: bool = True) -> dict[str, Any]:
        """One REST call; returns the parsed JSON answer ({} with ``answer=False``: a caller that does not read
        it saves the parse, about 15 us for a child and more for an RLRun).

        Raises:
            ApiError: a non-2xx answer (its status, reason and the server's message), or status 0 when the
                server could not be reached or did not answer within ``timeout_s``.
        """
        config = self.api_client.configuration
        data = None if body is None else encode_json(body)
        headers = self._get_headers((content_type or "application/json") if body is not None else None)
        try:
            async with self._get_session().request(
                    method, f"{str(config.host).rstrip('/')}{path}", params=query, data=data, headers=headers,
                    ssl=self._ssl, proxy=config.proxy or None) as response:
                raw = await response.read()
                status, reason = response.status, response.reason or ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:  # transport-level failure
            raise ApiError(0, type(exc).__name__, str(exc) or type(exc).__name__) from exc
        if not 200 <= status <= 299:
            message = ""
            try:
                message = json.loads(raw).get("message", "")
            except (ValueError, AttributeError):
                message = raw.decode("utf-8", "replace")[:500]
            raise ApiError(status, str(reason), message)
        # orjson reads an integer beyond 64 bits as a float, as the API server itself decodes one
        return orjson.loads(raw) if raw and answer else {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The live object, or None when it does not exist (404)."""
        try:
            return await self.request("GET", get_path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Objects of ``kind`` in ``namespace`` matching every label in ``labels`` (server-side selector)."""
        query = {"labelSelector": get_selector(labels)} if labels else None
        answer = await self.request("GET", get_path(kind, namespace), query=query)
        return list(answer.get("items") or [])

    async def create(self, obj: dict[str, Any], answer: bool = True) -> dict[str, Any]:
        """POST ``obj`` (apiVersion/kind/metadata.namespace set); returns the stored object ({} with
        ``answer=False``). 409 -> ApiError."""
        meta = obj["metadata"]
        return await self.request("POST", get_path(obj["kind"], meta["namespace"]), body=obj, answer=answer)

    async def json_patch(self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]],
                         subresource: str | None = None, answer: bool = True) -> dict[str, Any]:
        """RFC 6902 JSON patch; a failed ``test`` op answers 422 (ApiError). Returns the patched object ({}
        with ``answer=False``)."""
        return await self.request("PATCH", get_path(kind, namespace, name, subresource), body=ops,
                                  content_type="application/json-patch+json", answer=answer)

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None, answer: bool = True) -> dict[str, Any]:
        """RFC 7386 JSON merge patch (``None`` deletes a key). Returns the patched object ({} with
        ``answer=False``)."""
        return await self.request("PATCH", get_path(kind, namespace, name, subresource), body=patch,
                                  content_type="application/merge-patch+json", answer=answer)

    async def delete(self, kind: str, namespace: str, name: str, propagation: str = "Background") -> bool:
        """DELETE with a propagation policy; False when it was already gone (404)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        try:
            await self.request("DELETE", get_path(kind, namespace, name), body=body)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
