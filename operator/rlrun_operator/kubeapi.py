"""A thin asynchronous layer over the `kubernetes` client's REST transport (I/O).

The operator only needs create / get / list / patch / delete of a dozen kinds, as plain dicts. The typed
`kubernetes` APIs deserialize every answer into model objects (slow for hundreds of children) and cannot
handle the RLRun custom resource, so this module uses the client's own transport
(`ApiClient.param_serialize` + `ApiClient.call_api`: authentication, TLS and proxies exactly as the
client configures them from the pod's service account or KUBECONFIG) and parses JSON itself. Every call
runs in a worker thread (`asyncio.to_thread`) with a request timeout.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import kubernetes

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


class KubeApi:
    """Async create/get/list/patch/delete of namespaced objects as dicts.

    Args:
        api_client: a configured ``kubernetes.client.ApiClient`` (see load_api_client, get_api_client).
        timeout_s: total timeout of every request, seconds.
    """

    def __init__(self, api_client: kubernetes.client.ApiClient, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.api_client = api_client
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                 content_type: str | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        params = self.api_client.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
            auth_settings=["BearerToken"])
        try:
            response = self.api_client.call_api(*params, _request_timeout=self.timeout_s)
            data = response.read()
        except kubernetes.client.ApiException as exc:  # transport-level failure
            raise ApiError(exc.status or 0, str(exc.reason), str(exc.body or "")) from exc
        if not 200 <= response.status <= 299:
            message = ""
            try:
                message = json.loads(data).get("message", "")
            except (ValueError, AttributeError):
                message = data.decode("utf-8", "replace")[:500]
            raise ApiError(response.status, str(response.reason), message)
        return json.loads(data) if data else {}

    async def request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                      content_type: str | None = None) -> dict[str, Any]:
        """One REST call in a worker thread; returns the parsed JSON answer. Raises ApiError on non-2xx."""
        return await asyncio.to_thread(self._request, method, path, body, query, content_type)

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

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST ``obj`` (apiVersion/kind/metadata.namespace set); returns the stored object. 409 -> ApiError."""
        meta = obj["metadata"]
        return await self.request("POST", get_path(obj["kind"], meta["namespace"]), body=obj)

    async def json_patch(self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]],
                         subresource: str | None = None) -> dict[str, Any]:
        """RFC 6902 JSON patch; a failed ``test`` op answers 422 (ApiError)."""
        return await self.request("PATCH", get_path(kind, namespace, name, subresource), body=ops,
                                  content_type="application/json-patch+json")

    async def merge_patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                          subresource: str | None = None) -> dict[str, Any]:
        """RFC 7386 JSON merge patch (``None`` deletes a key)."""
        return await self.request("PATCH", get_path(kind, namespace, name, subresource), body=patch,
                                  content_type="application/merge-patch+json")

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
