"""rlrun's vLLM general plugin: two process-level settings that vLLM 0.32 offers no flag for, and the
readiness endpoint of prefill and decode servers (:class:`ReadinessMiddleware`, given to vLLM's
``--middleware``).

vLLM runs general plugins (entry point group ``vllm.general_plugins``, pyproject.toml) in each process it
starts, workers included, before they read their shared-memory rings or create a NIXL agent. Each setting is
applied only when its env var is set; the inference role sets them (:func:`rlrun_runtime.inference.get_vllm_env`).

1. ``RLRUN_VLLM_SHM_RECHECK_MS``: the most an idle vLLM process sleeps on a lost wake-up. The engine core and
   its workers hand each step over a shared-memory ring (``vllm/distributed/device_communicators/
   shm_broadcast.py``); an idle reader sleeps on a ZeroMQ notification (the writer's socket holds at most one
   message, ``SNDHWM`` 1) and re-reads the ring's written-flag only every ``SHM_READER_RECHECK_INTERVAL_MS``
   (5000; vLLM's comment: it "bounds lost-notify recovery latency to ~5s"). Engine-core logs of the P/D CI test
   on 2 loaded cores showed "Poller timed out" before steps the other side had long finished. 50 ms bounds that
   wait; an idle reader then checks one flag 20 times a second.
2. ``RLRUN_NIXL_PROGRESS_DELAY_US``: the pause of NIXL's UCX progress thread between polls. NIXL's Python
   agent hard-codes ``pthrDelay = 0`` (``nixl/_api.py``), so that thread spins: measured here, a prefill
   server's worker used 94 % of a core (100 % system time, ``epoll_wait`` with timeout 0 in libucp) while it
   served nothing, and on 2 cores that starved the decode server's start-up and every other role. Without the
   thread, a decode READ over UCX's TCP transport never completes while the prefill side is idle (measured: still
   in progress after 15 s); with a 1 ms pause it completed in 23 ms and the idle agent used no measurable CPU
   (``benchmarks/README.md``, the P/D CI test). Set for CPU servers only: on GPU the transfers are RDMA and a
   dedicated core is cheap.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable, Mapping

from rlrun_api import constants

log = logging.getLogger(__name__)


def get_positive_int(env: Mapping[str, str], name: str) -> int | None:
    """The positive integer in ``env[name]``; None when unset, empty or not a positive integer (the setting is
    then left to vLLM / NIXL)."""
    raw = env.get(name, "").strip()
    if not raw.isdigit() or int(raw) <= 0:
        return None
    return int(raw)


def bound_shm_recheck(recheck_ms: int) -> bool:
    """Lower vLLM's ``SHM_READER_RECHECK_INTERVAL_MS`` to ``recheck_ms`` (never raise it). False when this vLLM
    has no such constant (nothing changed, a warning logged)."""
    from vllm.distributed.device_communicators import shm_broadcast

    current = getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None)
    if not isinstance(current, int):
        log.warning("vLLM has no shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS; %s has no effect",
                    constants.ENV_VLLM_SHM_RECHECK_MS)
        return False
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(current, recheck_ms)
    return True


def get_delayed_agent(make_agent: Callable[[Any, Any], Any], delay_us: int) -> Callable[[Any, Any], Any]:
    """``make_agent`` (NIXL's ``nixlAgent(name, config)``) with the config's progress-thread delay set to
    ``delay_us`` first."""
    def make(name: Any, config: Any) -> Any:
        config.pthrDelay = delay_us
        return make_agent(name, config)

    make.rlrun_delay_us = delay_us  # type: ignore[attr-defined]  # marks the wrapper (applied once)
    return make


def set_nixl_progress_delay(delay_us: int) -> bool:
    """Make every NIXL agent this process creates pause ``delay_us`` between progress polls. False when NIXL is
    not installed or has no ``nixlAgent`` binding (nothing changed)."""
    try:
        import nixl._api as nixl_api
    except ImportError:
        return False
    bindings = getattr(nixl_api, "nixlBind", None)
    make_agent = getattr(bindings, "nixlAgent", None)
    if make_agent is None:
        log.warning("NIXL has no nixlBind.nixlAgent; %s has no effect", constants.ENV_NIXL_PROGRESS_DELAY_US)
        return False
    if getattr(make_agent, "rlrun_delay_us", None) is None:
        bindings.nixlAgent = get_delayed_agent(make_agent, delay_us)
    return True


def register() -> None:
    """The plugin's entry point: apply the settings the env asks for."""
    recheck_ms = get_positive_int(os.environ, constants.ENV_VLLM_SHM_RECHECK_MS)
    if recheck_ms is not None:
        bound_shm_recheck(recheck_ms)
    delay_us = get_positive_int(os.environ, constants.ENV_NIXL_PROGRESS_DELAY_US)
    if delay_us is not None:
        set_nixl_progress_delay(delay_us)


class ReadinessMiddleware:
    """Pure ASGI middleware of the vLLM API server (``--middleware``, set by the inference role for prefill and
    decode servers): ``GET constants.INFERENCE_READY_PATH`` answers 200 while the server serves the run's
    current policy version, else 503; every other request passes through untouched.

    "Current" is the version the orchestrator last loaded on every engine
    (``weights.update.read_serving_record`` under ``RLRUN_STORAGE_DIR``); the decision is
    ``weights.update.get_readiness`` on the engine's own version (``EngineClient.get_weight_version``, what
    ``GET /weight_info`` reports). A dead engine (``check_health`` raises) is not ready either, nor one the
    record lists as out of service (a failed update left it paused: it would hold whatever the router sent it;
    the orchestrator still reaches it directly and resumes it in a later round), nor one that joined a P/D run
    and whose first KV hand-offs the orchestrator has not sent yet (the record's ``kv_pending``). The JSON body
    says why: ``{"ready": bool, "reason": str}``. This is the pod's readinessProbe in a cluster, so a pod that
    joins (scale-up, restart) starts from the initial model, is updated by the orchestrator (which sees
    not-ready pods: the pools' headless Services publish them) and gets traffic from the router, which adds
    only Ready pods, once it serves the current version.
    """

    # ``get_weight_version`` is a utility call to the engine core, queued behind whatever the core runs: during
    # a weight reload (``collective_rpc``) it waits for the whole reload, which for a large model can outlast
    # the probe's timeout on every pod of a pool at once (they reload in the same round) and empty the
    # router. So the call gets VERSION_WAIT_S; when it does not answer in time the last version it answered
    # stands (the engine is busy reloading, not dead: ``check_health`` has passed).
    VERSION_WAIT_S = 1.0

    def __init__(self, app: Any) -> None:
        self.app = app
        self._last_version: str | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") != constants.INFERENCE_READY_PATH:
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        ready, reason = await self.readiness(scope)
        await JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)(scope, receive, send)

    async def readiness(self, scope: dict[str, Any]) -> tuple[bool, str]:
        """(ready, reason) of this server now."""
        from rlrun_runtime.storage import RunStorage
        from rlrun_runtime.weights.update import get_readiness, is_listed, read_serving_record

        app = scope.get("app")
        client = getattr(getattr(app, "state", None), "engine_client", None)
        if client is None:
            return False, "no engine client"
        try:
            await client.check_health()
        except Exception as err:  # EngineDeadError and whatever a broken engine raises: not ready, said why
            return False, f"engine not healthy: {type(err).__name__}: {err}"
        pending = asyncio.ensure_future(client.get_weight_version())
        try:
            version = str(await asyncio.wait_for(asyncio.shield(pending), self.VERSION_WAIT_S))
            self._last_version = version
        except asyncio.TimeoutError:
            pending.add_done_callback(self._remember)  # it still answers later: keep that answer
            if self._last_version is None:
                return False, f"engine busy: its weight version did not answer within {self.VERSION_WAIT_S:g} s"
            version = self._last_version
        except Exception as err:  # noqa: BLE001 - a broken engine: not ready, said why
            return False, f"engine not healthy: {type(err).__name__}: {err}"
        root = os.environ.get(constants.ENV_STORAGE_DIR, "").strip()
        record = read_serving_record(RunStorage(root)) if root else None
        addresses = self.addresses(scope)
        left = record is not None and is_listed(addresses, record.out_of_service)
        pending = record is not None and is_listed(addresses, record.kv_pending)
        return get_readiness(version, None if record is None else record.version, out_of_service=left,
                             kv_pending=pending)

    @staticmethod
    def addresses(scope: dict[str, Any]) -> list[tuple[str, int]]:
        """(host, port) this server is reached at: the address the probe came in on (the kubelet probes the
        pod IP) and, on the same port, ``POD_IP`` (what the orchestrator resolves the headless Service to)."""
        server = scope.get("server")
        if not server or server[1] is None:
            return []
        found = [(str(server[0]), int(server[1]))]
        pod_ip = os.environ.get(constants.ENV_POD_IP, "").strip()
        if pod_ip:
            found.append((pod_ip, int(server[1])))
        return found

    def _remember(self, done: "asyncio.Future[Any]") -> None:
        if not done.cancelled() and done.exception() is None:
            self._last_version = str(done.result())
