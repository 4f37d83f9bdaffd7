"""HTTP client for the RL admin endpoints of ONE vLLM engine (the update sequence over them is
:mod:`rlrun_runtime.weights.update`).

The endpoints exist when the server runs with ``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.32:
``vllm/entrypoints/rl/online/api_router.py``, ``vllm/entrypoints/serve/dev/``). Admin calls go to every
engine directly, never through the router (which would pick one engine at random).

``reload_weights`` is ``POST /collective_rpc`` ``rlrun_reload_weights(weights_path=DIR)``: the workers reload an HF
safetensors directory in place with vLLM's ``reload_weights``, then refresh tied LM heads, which vLLM 0.32 on
CPU leaves stale (:mod:`rlrun_runtime.vllm_worker`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Iterable

import httpx

from rlrun_api import constants

log = logging.getLogger(__name__)

# Every admin call (pause, version, reset, resume, weight_info) answers in milliseconds on a healthy engine;
# one call to a stalled engine gives up after (1 + DEFAULT_RETRIES) * DEFAULT_TIMEOUT_S + backoff, 90.6 s. The
# orchestrator's watchdog reports a stalled engine long before that (orchestrator.STALL_AFTER_S).
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 2
DEFAULT_BACKOFF_S = 0.2
HEALTH_PROBE_TIMEOUT_S = 5.0  # one GET /health (no retry)
# A reload reads the whole checkpoint from shared storage: multi-GB models take far longer than an admin
# call, and re-sending a reload whose first attempt timed out would run two at once. So the reload gets its
# own, long timeout and is never retried after a read timeout (only when the connection could not be made).
RELOAD_TIMEOUT_S = 900.0


class EngineError(RuntimeError):
    """An admin call to one engine failed after its retries; ``engine`` is its base URL.

    ``out_of_service`` lists the engines this failure leaves paused on purpose or by force (a failed load
    that could not be restored, a resume that did not go through): they must not get traffic until a later
    update loads a version into them and resumes them.
    """

    def __init__(self, engine: str, message: str, out_of_service: tuple[str, ...] = ()):
        super().__init__(f"vLLM engine {engine}: {message}")
        self.engine = engine
        self.out_of_service = tuple(out_of_service)


class EngineOutOfService(EngineError):
    """The engine is left paused (its weights are unknown, or it did not answer the resume)."""

    def __init__(self, engine: str, message: str):
        super().__init__(engine, message, out_of_service=(engine,))


class VLLMAdmin:
    """Async client for one engine's admin endpoints.

    Every call has a timeout (``timeout_s``) and is retried up to ``retries`` more times on connection
    errors, timeouts and HTTP 5xx, sleeping ``backoff_s * 2**attempt`` seconds between attempts; HTTP 4xx
    is not retried. Failures raise :class:`EngineError` naming the engine.

    Args:
        base_url: ``http://host:port`` of the engine.
    """

    def __init__(self, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES,
                 backoff_s: float = DEFAULT_BACKOFF_S):
        self.base_url = base_url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def __aenter__(self) -> "VLLMAdmin":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, *, retries: int | None = None, retry_on_timeout: bool = True,
                    **kwargs: Any) -> httpx.Response:
        attempts = (self.retries if retries is None else retries) + 1
        last = ""
        for attempt in range(attempts):
            try:
                response = await self._client.request(method, path, **kwargs)
            except httpx.HTTPError as err:  # connection refused, timeouts, protocol errors
                last = f"{method} {path}: {type(err).__name__}: {err}"
                if not retry_on_timeout and isinstance(err, (httpx.ReadTimeout, httpx.WriteTimeout)):
                    break  # the engine may still be working on it: never send it twice
            else:
                if response.status_code < 400:
                    return response
                last = f"{method} {path}: HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code < 500:
                    break
            if attempt + 1 < attempts:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineError(self.base_url, f"{last} (after {attempt + 1} attempt(s))")

    async def health(self, timeout_s: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
        """True when ``GET /health`` answers 200 within ``timeout_s`` (one attempt; False on any error)."""
        try:
            response = await self._client.get("/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """``POST /pause?mode=MODE&clear_cache=false``: keep (freeze in-flight requests), wait (drain) or abort.

        ``clear_cache`` is sent explicitly because vLLM 0.32 defaults it to true and, despite its docstring,
        honours it for ``keep``: the engine then resets the KV cache with ``reset_running_requests=True``,
        which preempts every running request (recomputed from scratch after resume) and fails outright on a
        decode server waiting for remote KV (P/D). rlrun pauses with false (docs/orchestrator.md, measured).
        """
        await self._call("POST", "/pause", params={"mode": mode, "clear_cache": str(bool(clear_cache)).lower()})

    async def resume(self) -> None:
        """``POST /resume``."""
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return bool((await self._call("GET", "/is_paused")).json()["is_paused"])

    async def reload_weights(self, weights_path: str, method: str = constants.VLLM_RELOAD_METHOD) -> None:
        """Reload every worker's weights in place from an HF safetensors directory (a path the engine sees).

        ``method`` is the worker method run through ``POST /collective_rpc``: rlrun's
        ``rlrun_reload_weights`` (vLLM's ``reload_weights`` plus a refresh of tied LM heads, see
        :mod:`rlrun_runtime.vllm_worker`; needs ``--worker-extension-cls``, which the inference role passes),
        or vLLM's own ``reload_weights``.
        """
        await self._call("POST", "/collective_rpc", timeout=RELOAD_TIMEOUT_S, retry_on_timeout=False,
                         json={"method": method, "kwargs": {"weights_path": str(weights_path)}})

    # --- vLLM's weight-transfer protocol (the push transports, rlrun_runtime.weights.push) -------------------
    async def worker_count(self) -> int:
        """How many workers the engine runs (``POST /collective_rpc check_health`` answers once per worker)."""
        response = await self._call("POST", "/collective_rpc", json={"method": "check_health"})
        return len(response.json().get("results") or [None])

    async def expected_weights(self) -> list[dict[str, Any]]:
        """What each worker's model loads, ``[{"dtype", "shapes": {name: shape} | null}]`` in worker order:
        rlrun's worker method :data:`constants.VLLM_EXPECTED_WEIGHTS_METHOD` through ``POST /collective_rpc``
        (needs ``--worker-extension-cls``, which the inference role passes)."""
        response = await self._call("POST", "/collective_rpc", json={"method": constants.VLLM_EXPECTED_WEIGHTS_METHOD})
        return list(response.json().get("results") or [])

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], timeout_s: float) -> None:
        """``POST /init_weight_transfer_engine``: the workers join the trainer's group (blocks until they have;
        never retried: a second join would wait for a trainer that already left)."""
        await self._call("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, timeout=timeout_s,
                         retries=0)

    async def start_weight_update(self) -> None:
        """``POST /start_weight_update`` (vLLM refuses ``update_weights`` before it)."""
        await self._call("POST", "/start_weight_update", retries=0)

    async def update_weights(self, update_info: dict[str, Any], timeout_s: float) -> None:
        """``POST /update_weights``: the workers receive every bucket the trainer sends (blocks until done)."""
        await self._call("POST", "/update_weights", json={"update_info": update_info}, timeout=timeout_s,
                         retries=0)

    async def finish_weight_update(self, version: int | str | None = None) -> None:
        """``POST /finish_weight_update``; with ``version``, vLLM also sets the version ``GET /weight_info``
        reports, in the same call and only once the workers' finish succeeded (``AsyncLLM.finish_weight_update``:
        the workers' finish, then ``update_weight_version``), which saves the update sequence its own
        ``/update_weight_version`` call. Without ``version`` it only ends the workers' session (the push's
        clean-up of a session that loaded nothing)."""
        body = None if version is None else {"weight_version": str(version)}
        await self._call("POST", "/finish_weight_update", json=body, retries=0)

    async def shutdown_weight_transfer_engine(self) -> None:
        """``POST /shutdown_weight_transfer_engine``: drop the workers' group."""
        await self._call("POST", "/shutdown_weight_transfer_engine", retries=0)

    async def update_weight_version(self, version: int | str) -> None:
        """Set the version ``GET /weight_info`` reports (vLLM stores it as a string)."""
        await self._call("POST", "/update_weight_version", json={"new_version": str(version)})

    async def weight_info(self) -> str:
        """The engine's weight version string (vLLM's initial value is ``"default"``)."""
        return str((await self._call("GET", "/weight_info")).json()["weight_version"])

    async def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``; returns vLLM's ``success`` flag (False while requests hold blocks)."""
        return bool((await self._call("POST", "/reset_prefix_cache")).json().get("success", False))


def parse_version(weight_version: str) -> int | None:
    """vLLM's weight-version string as a policy version: ``"7"`` -> 7; ``"default"`` or junk -> None."""
    return int(weight_version) if weight_version.strip().isdigit() else None


def resolve_engines(endpoints: str | Iterable[str]) -> list[str]:
    """Base URLs of every engine behind ``endpoints`` (``host:port`` items, or a comma-separated string).

    Each host is resolved with ``getaddrinfo`` (a headless Service name resolves to every ready pod, and to
    every pod, ready or not, for the prefill and decode Services, which publish not-ready addresses),
    so the list is re-read before every weight update. Sorted, duplicates removed.

    Raises:
        ValueError: an item is not ``host:port``.
        socket.gaierror: a host does not resolve.
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    urls: set[str] = set()
    for item in (i.strip() for i in items):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"inference endpoint {item!r} is not host:port")
        for family, _, _, _, sockaddr in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM):
            address = sockaddr[0]
            urls.add(f"http://[{address}]:{port}" if family == socket.AF_INET6 else f"http://{address}:{port}")
    return sorted(urls)
