"""The weight update every engine goes through, whatever the transport (docs/runtime-contract.md):

``POST /pause?mode=keep`` -> the transport's load (``WeightTransport.load_into``) ->
``POST /update_weight_version`` (what ``GET /weight_info`` then reports) -> ``POST /reset_prefix_cache`` ->
``POST /resume`` -> ``GET /weight_info`` must name the new version.

Resume always runs, even when a step before it failed. vLLM refuses the prefix-cache reset while requests
hold KV blocks (HTTP 200 with ``success: false``), which is expected after a ``keep`` pause; requests carry
``cache_salt = "policy-<version>"`` so that KV computed with older weights is never reused anyway. This is
the one module that orders these calls; the P/D ordering and the hardening of a failed pause or load belong
here too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Sequence

from rlrun_runtime.vllm_admin import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, EngineError, VLLMAdmin, parse_version
from rlrun_runtime.weights.transport import WeightTransport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineUpdate:
    """Result of one engine's weight update: ``latency_ms`` from pause sent to resume answered.

    ``reported_version`` is what the engine's own ``GET /weight_info`` says after the resume (None when it
    names no integer version): the proof that the engine serves ``version``.
    """

    engine: str
    version: int
    latency_ms: float
    prefix_cache_reset: bool
    reported_version: int | None = None


async def update_engine(admin: VLLMAdmin, version: int, transport: WeightTransport) -> EngineUpdate:
    """pause(keep) -> load -> set version -> reset prefix cache -> resume on one engine, then check it.

    Resume runs in a ``finally``; an error in any step is raised (as :class:`EngineError`) after it.
    Afterwards ``GET /weight_info`` must report ``version`` (EngineError otherwise); its answer is
    returned as ``reported_version``. The latency covers pause to resume only.
    """
    start = time.perf_counter()
    await admin.pause("keep")
    try:
        await transport.load_into(admin, version)
        await admin.update_weight_version(version)
        reset = await admin.reset_prefix_cache()
    finally:
        await admin.resume()
    latency_ms = (time.perf_counter() - start) * 1000.0
    reported = parse_version(await admin.weight_info())
    if reported != version:
        raise EngineError(admin.base_url, f"reports weight version {reported} after loading version {version}")
    if not reset:
        log.info("engine %s: prefix-cache reset refused while requests hold blocks; cache_salt isolates old KV",
                 admin.base_url)
    return EngineUpdate(admin.base_url, version, latency_ms, reset, reported)


async def update_engines(engines: Sequence[str], version: int, transport: WeightTransport, *,
                         timeout_s: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES) -> list[EngineUpdate]:
    """:func:`update_engine` on each base URL in ``engines`` concurrently.

    Raises:
        ValueError: ``transport.check_loadable(version)`` refused (checked before any engine is paused).
        EngineError: one or more engines failed (every other engine is still updated and resumed); the
            message names them.
    """
    transport.check_loadable(version)

    async def one(url: str) -> EngineUpdate:
        async with VLLMAdmin(url, timeout_s=timeout_s, retries=retries) as admin:
            return await update_engine(admin, version, transport)

    results = await asyncio.gather(*(one(url) for url in engines), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for failure in failures:
            if not isinstance(failure, Exception):  # cancellation, KeyboardInterrupt
                raise failure
        if len(failures) == 1:
            raise failures[0]
        raise EngineError(", ".join(getattr(f, "engine", "?") for f in failures),
                          f"{len(failures)} engines failed: " + "; ".join(str(f) for f in failures))
    return [r for r in results if isinstance(r, EngineUpdate)]

