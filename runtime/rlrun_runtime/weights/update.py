"""The weight update every engine goes through, whatever the transport (docs/runtime-contract.md):

``POST /pause?mode=keep&clear_cache=false`` (alongside it ``WeightTransport.prepare``: what the load needs that
touches no weight) -> the transport's load (``WeightTransport.load_into``) ->
``POST /update_weight_version`` (what ``GET /weight_info`` then reports; skipped when the load named the
version itself: a push's ``/finish_weight_update`` carries it, vLLM sets it in that call once the workers'
finish succeeded) -> ``POST /reset_prefix_cache`` -> ``POST /resume`` -> ``GET /weight_info`` must name the
new version.

What a transport does alongside the pause is its own (the push: the trainer's accept, the engine's join of
the group, and with rlrun's gloo engine the start of the engine's update session, which touches no weight:
the layerwise reload begins in ``update_weights``); it must leave nothing open when the load does not follow
(``WeightTransport.release``: the push gives the trainer up and ends the session). The version call and the
prefix-cache reset stay one after the other: both are utility calls that vLLM's engine core runs one at a
time, on disjoint state, so sending them together would be safe, but it saves only the filesystem path a few
milliseconds, and a failed version call would no longer skip the reset.

This is the one module that orders these calls. What each failure leaves behind:

- the version is checked (``WeightTransport.check_loadable``: present, every file whole, the served
  version's tensor names and shapes) before any engine is paused: bad weights pause nothing;
- pause, version or prefix-cache reset failing (HTTP error, timeout): resume is still sent, the engine
  serves the weights it holds (the previous ones when the load never ran); a push names the version in its
  ``/finish_weight_update``, so there a failed version counts as a failed load (restored, as below);
- the load failing after the pause: the previous version is loaded again (*restored*) and named, then
  resume; vLLM's in-place reload leaves parameters on the meta device when it fails part-way, and a resume
  into that state kills the engine on its next request. If the restore fails too (or there is no previous
  version to restore) the engine is **not** resumed: :class:`EngineOutOfService`, it stays paused until a
  later update loads a version into it;
- resume failing: :class:`EngineOutOfService` (it may still be paused).

vLLM refuses the prefix-cache reset while requests hold KV blocks (HTTP 200 with ``success: false``), which
is expected after a ``keep`` pause; requests carry ``cache_salt = "policy-<version>"`` so that KV computed
with older weights is never reused anyway.

Prefill/decode disaggregation (``prefill`` engines given): the prefill engines are paused first and the
decode engines only once every prefill pause has returned; the decode engines are resumed first and the
prefill engines only once every decode engine is resumed (or has failed). A ``keep`` pause returns once the
engine's in-flight work is over, and for a prefill engine that includes the KV blocks it holds for decode:
decode, still running, reads them (NIXL reads a paused prefill engine's blocks through its UCX progress
thread), so the prefill pause returns and decode then has no KV load pending. Pausing decode first made the
prefill pause wait for KV the paused decode engine would never read until vLLM's 30 s ``kv_lease_duration``
expired (measured on CPU, benchmarks/README.md, the P/D CI test). New requests are held by the
orchestrator while an update is in flight, so nothing new reaches prefill between the two pauses.
``WeightTransport.prepare`` of a decode engine starts only once that engine may pause (after every prefill
pause): the push's join is an engine utility call, during which the engine core runs no step and so would
start none of decode's pending KV loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import urllib.parse
from pathlib import Path
from typing import Iterable, Sequence

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage, atomic_write_json
from rlrun_runtime.vllm_admin import (DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, EngineError, EngineOutOfService, VLLMAdmin,
                                      parse_version)
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


async def _restore(admin: VLLMAdmin, transport: WeightTransport, previous: int | None) -> str | None:
    """Load ``previous`` back into the paused engine and name it; None when done, else why not."""
    if previous is None:
        return "no previous version is known"
    try:
        transport.check_loadable(previous)
        named = await transport.load_into(admin, previous)
    except (EngineError, ValueError) as err:
        return f"restoring version {previous} failed: {err}"
    if named:
        return None
    with contextlib.suppress(EngineError):  # the weights are right; a wrong name only makes it look behind
        await admin.update_weight_version(previous)
    return None


class PauseOrder:
    """The P/D ordering of one update round (see the module docstring): ``first`` engines (prefill) pause
    before ``second`` engines (decode) and resume after them. Each engine reports ``paused`` once its pause
    attempt is over and ``done`` once its resume attempt is over (or it failed before reaching it): a failed
    engine never blocks the others. Engines in neither set are not ordered."""

    def __init__(self, first: Iterable[str], second: Iterable[str]) -> None:
        self.first, self.second = frozenset(first), frozenset(second) - frozenset(first)
        self._pausing, self._running = set(self.first), set(self.second)
        self._first_paused, self._second_resumed = asyncio.Event(), asyncio.Event()
        self._check()

    def _check(self) -> None:
        if not self._pausing:
            self._first_paused.set()
        if not self._running:
            self._second_resumed.set()

    async def before_pause(self, engine: str) -> None:
        if engine in self.second:
            await self._first_paused.wait()

    def paused(self, engine: str) -> None:
        self._pausing.discard(engine)
        self._check()

    async def before_resume(self, engine: str) -> None:
        if engine in self.first:
            await self._second_resumed.wait()

    def done(self, engine: str) -> None:
        self.paused(engine)
        self._running.discard(engine)
        self._check()


async def update_engine(admin: VLLMAdmin, version: int, transport: WeightTransport,
                        previous: int | None = None, order: PauseOrder | None = None) -> EngineUpdate:
    """pause(keep) -> load -> set version (unless the load did) -> reset prefix cache -> resume on one engine,
    then check it.

    ``previous`` is the version the engine serves (restored when the load fails; see the module
    docstring). ``order``: the round's P/D ordering, when there is one (this engine reports to it, the caller
    calls ``order.done`` when the engine is finished). After the resume ``GET /weight_info`` must report
    ``version``; its answer is returned as ``reported_version``. The latency covers pause to resume only.

    Raises:
        EngineError: a step failed; the engine was resumed and serves its previous weights.
        EngineOutOfService: the engine is left paused (load and restore failed, or resume failed).
    """
    start = time.perf_counter()
    failure: EngineError | None = None
    reset = False
    url = admin.base_url
    preparing: asyncio.Future[None] | None = None
    try:
        if order is not None:
            await order.before_pause(url)
        # What the load needs that touches no weight (a push: the trainer's accept, the engine's join of the
        # group and the start of its update session, the trainer's check) runs alongside the pause; load_into
        # takes it over, release() ends what it did not take. Only after the P/D
        # gate: the join is a utility call that stops the engine core's loop while it runs, and a decode
        # server must go on starting its pending KV loads until every prefill server is paused.
        preparing = asyncio.ensure_future(transport.prepare(admin, version))
        try:
            await admin.pause("keep")
        finally:
            if order is not None:
                order.paused(url)
        try:
            await preparing
            named = await transport.load_into(admin, version)
        except (EngineError, ValueError) as err:
            not_restored = await _restore(admin, transport, previous)
            if not_restored is not None:
                raise EngineOutOfService(admin.base_url, (
                    f"loading version {version} failed ({err}); {not_restored}: left paused (out of service) "
                    "until a later update loads a version")) from err
            log.warning("engine %s: loading version %d failed, version %s restored before resume: %s",
                        admin.base_url, version, previous, err)
            failure = EngineError(admin.base_url, f"loading version {version} failed ({err}); version "
                                                  f"{previous} was restored and the engine resumed")
        else:
            if not named:
                await admin.update_weight_version(version)
            reset = await admin.reset_prefix_cache()
    except EngineOutOfService:
        raise
    except EngineError as err:  # pause, version or reset: the engine holds valid weights, resume it
        failure = err
    except BaseException:  # cancelled mid-update: do not leave the engine paused behind us
        with contextlib.suppress(Exception):
            await admin.resume()
        raise
    finally:
        if preparing is not None:
            if not preparing.done():
                preparing.cancel()
            await asyncio.wait({preparing})  # raises nothing of the task's (prepare never raises; or cancelled)
        await transport.release(admin, version)  # a no-op once load_into took the prepared load
    try:
        if order is not None:
            await order.before_resume(url)
        await admin.resume()
    except EngineError as err:
        raise EngineOutOfService(admin.base_url, f"resume failed, the engine may be left paused: {err}"
                                 + (f" (after: {failure})" if failure else "")) from failure or err
    if failure is not None:
        raise failure
    latency_ms = (time.perf_counter() - start) * 1000.0
    reported = parse_version(await admin.weight_info())
    if reported != version:
        raise EngineError(admin.base_url, f"reports weight version {reported} after loading version {version}")
    if not reset:
        log.info("engine %s: prefix-cache reset refused while requests hold blocks; cache_salt isolates old KV",
                 admin.base_url)
    return EngineUpdate(admin.base_url, version, latency_ms, reset, reported)


async def update_engines(engines: Sequence[str], version: int, transport: WeightTransport, *,
                         previous: int | None = None, prefill: Iterable[str] = (),
                         timeout_s: float = DEFAULT_TIMEOUT_S, retries: int = DEFAULT_RETRIES) -> list[EngineUpdate]:
    """:func:`update_engine` on each base URL in ``engines`` concurrently.

    ``previous``: the version the engines serve (None: unknown); its tensors are the reference of the
    check and what a failed load restores. ``prefill``: the base URLs of the prefill pool under P/D
    disaggregation; the other engines are then decode engines, and the round follows :class:`PauseOrder`.

    Raises:
        ValueError: ``transport.check_loadable(version, previous)`` refused (before any engine is paused).
        EngineError: one or more engines failed (every other engine is still updated and resumed); the
            message names them, ``out_of_service`` lists those left paused.
    """
    transport.check_loadable(version, previous)

    engines = [url.rstrip("/") for url in engines]  # the keys VLLMAdmin.base_url uses
    prefill_engines = {url.rstrip("/") for url in prefill} & set(engines)
    order = PauseOrder(prefill_engines, set(engines) - prefill_engines) if prefill_engines else None

    async def one(url: str) -> EngineUpdate:
        try:
            async with VLLMAdmin(url, timeout_s=timeout_s, retries=retries) as admin:
                return await update_engine(admin, version, transport, previous, order)
        finally:
            if order is not None:
                order.done(url)

    results = await asyncio.gather(*(one(url) for url in engines), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for failure in failures:
            if not isinstance(failure, Exception):  # cancellation, KeyboardInterrupt
                raise failure
        if len(failures) == 1:
            raise failures[0]
        raise EngineError(", ".join(getattr(f, "engine", "?") for f in failures),
                          f"{len(failures)} engines failed: " + "; ".join(str(f) for f in failures),
                          out_of_service=tuple(u for f in failures for u in getattr(f, "out_of_service", ())))
    return [r for r in results if isinstance(r, EngineUpdate)]


# --- the version the run serves (readiness of prefill and decode servers) --------------------------------
def serving_version_file(storage: RunStorage) -> Path:
    """``<storage>/orchestrator/serving-version.json`` (``constants.SERVING_VERSION_FILE``)."""
    return storage.root / constants.SERVING_VERSION_FILE


def write_serving_version(storage: RunStorage, version: int, out_of_service: Iterable[str] = (),
                          kv_pending: Iterable[str] = ()) -> None:
    """Record ``version`` as the one every engine serves, the engines a failed update left paused and the
    joined engines whose first KV hand-offs are not done yet: ``{"version": N, "out_of_service": [base URL,
    ...], "kv_pending": [base URL, ...], "time": unix seconds}``, written atomically by the orchestrator
    whenever one of them changed."""
    atomic_write_json(serving_version_file(storage), {"version": int(version),
                                                      "out_of_service": sorted(set(out_of_service)),
                                                      "kv_pending": sorted(set(kv_pending)),
                                                      "time": time.time()})


@dataclasses.dataclass(frozen=True)
class ServingRecord:
    """What :func:`write_serving_version` recorded: the version, the base URLs left out of service and those
    whose KV hand-offs are pending."""

    version: int
    out_of_service: tuple[str, ...] = ()
    kv_pending: tuple[str, ...] = ()


def read_serving_record(storage: RunStorage) -> ServingRecord | None:
    """The record :func:`write_serving_version` last wrote; None when there is none yet (before the
    orchestrator's first round) or it cannot be read or parsed (a reader never fails on it). A record of an
    older orchestrator, without ``out_of_service`` or ``kv_pending``, has none."""
    try:
        data = json.loads(serving_version_file(storage).read_text(encoding="utf-8"))
        version, left, pending = data["version"], data.get("out_of_service", []), data.get("kv_pending", [])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(version, int) or version < 0:
        return None
    return ServingRecord(version, tuple(str(u) for u in left) if isinstance(left, list) else (),
                         tuple(str(u) for u in pending) if isinstance(pending, list) else ())


def read_serving_version(storage: RunStorage) -> int | None:
    """The version of :func:`read_serving_record` (None: no record)."""
    record = read_serving_record(storage)
    return None if record is None else record.version


def is_listed(addresses: Iterable[tuple[str, int]], urls: Iterable[str]) -> bool:
    """True when one of ``urls`` (base URLs as the orchestrator names engines: ``http://10.0.0.5:8000``)
    points at one of ``addresses`` ((host, port) a server is reached at: its pod IP or bind address and its
    port) (pure; a URL without a port or with a malformed one matches nothing)."""
    own = {(host, int(port)) for host, port in addresses}
    for url in urls:
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            continue
        if parts.hostname is not None and port is not None and (parts.hostname, port) in own:
            return True
    return False


def get_readiness(weight_version: str, current: int | None, out_of_service: bool = False,
                  kv_pending: bool = False) -> tuple[bool, str]:
    """Whether a prefill or decode server that reports ``weight_version`` (``GET /weight_info``) may get
    traffic, and why (pure).

    Args:
        weight_version: what the server reports; vLLM's initial ``"default"`` counts as version 0, the
            initial model every prefill and decode server starts from (``inference.get_start_weights``).
        current: :func:`read_serving_version` (None: no record yet, i.e. the run's first round has not
            happened: every server serves the initial model, ready).
        out_of_service: the record lists this server (:func:`is_listed`): a failed update left it paused, so
            it would hold every request it got until the orchestrator's next round resumes it.
        kv_pending: the record lists this server among those that joined a P/D run and whose first KV hand-off
            with the other pool's servers is not done (``Orchestrator.check_joined``): a pair's first NIXL
            connection can outlast prefill's KV lease on CPU, so real requests wait until it was paid.

    Returns:
        (ready, reason): ready when it is not out of service and ``current`` is None, or when the server's
        version is at least ``current`` (a server already moved to the next version during an update round
        stays ready) and it is not KV-pending.
    """
    if out_of_service:
        return False, ("left paused by a failed weight update: out of service until the orchestrator's next "
                       "round resumes it")
    served = parse_version(weight_version)
    if served is None:
        if weight_version.strip() != "default":
            return False, f"unknown weight version {weight_version!r}"
        served = 0
    if current is None:
        return True, f"serves version {served}; no serving version recorded yet"
    if served < current:
        return False, f"serves version {served}, the run serves {current}: waiting for the orchestrator to load it"
    if kv_pending:
        return False, (f"serves version {served}, joined: waiting for the orchestrator's first KV hand-off with "
                       "the other pool's servers (a pair's first NIXL connection)")
    return True, f"serves version {served} (the run serves {current})"
