"""``weightSync.transport: gloo``: the trainer pushes each version from memory into every engine over
vLLM's weight-transfer protocol (docs/weight-transport.md has the whole sequence and its timeouts).

Three processes take part. The trainer's rank 0 runs a :class:`PushService` (a ``TCPStore`` on
``constants.WEIGHT_PUSH_PORT``, its address in ``weights/push-endpoint.json`` on the run's storage) that holds
the newest published state dict and serves push requests. The orchestrator drives each engine's update
(pause, load, version, cache, resume: :mod:`rlrun_runtime.weights.update`); for the load,
:meth:`PushTransport.prepare` (alongside the engine's pause: it touches no weight) opens the engine's update
session (``/start_weight_update``: rlrun's gloo engine starts the layerwise reload only in ``update_weights``),
posts a request to the service, has the engine join a fresh gloo group with the trainer
(``/init_weight_transfer_engine``) and waits for the trainer's name/dtype/shape check against the engine's
model; :meth:`PushTransport.load_into` (engine paused) then tells the trainer to send (``go``),
``/update_weights`` (the engine receives while the trainer sends) -> ``/finish_weight_update`` with the
version (vLLM names it in the same call, so the update sequence sends no ``/update_weight_version``). Every
path that opened a session and does not reach the load (the pause failed, the trainer gave up, the update
was cancelled) ends it with a ``/finish_weight_update`` that touches no weight, so the next update's start
is not refused as "already active". The engine side is :mod:`rlrun_runtime.weights.gloo_engine`.

Every version is also written to the storage as the filesystem transport writes it (the trainer does this
before the orchestrator learns of the version): a starting or restarted engine serves it from there, a
failed push restores the previous version from there, and when the trainer does not hold the version any
more (restarted, finished) the engine loads it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage, atomic_write_json
from rlrun_runtime.vllm_admin import RELOAD_TIMEOUT_S, EngineError
from rlrun_runtime.weights import push_protocol as proto
from rlrun_runtime.weights.filesystem import FilesystemTransport

if TYPE_CHECKING:
    from rlrun_runtime.vllm_admin import VLLMAdmin

log = logging.getLogger(__name__)

ENDPOINT_FILE = "push-endpoint.json"  # under storage.weights_dir: {"host", "port", "pid"}
ACCEPT_TIMEOUT_S = 10.0  # the trainer's service answers a request in milliseconds; past this it is gone
CONNECT_TIMEOUT_S = 5.0  # opening the orchestrator's connection to the trainer's store
HELD_VERSIONS = 2        # versions the trainer keeps for pushes: a push of N may start after N+1 is published
CLOSE_GRACE_S = 30.0     # how long an exiting trainer waits for its last version to be pushed once
KEY_POLL_S = 0.002       # how often a waiting party looks for its key in the store (a local round trip)
SENT_POLL_S = 0.05       # how often the orchestrator looks for the trainer's "sent" while the engine receives
GO_FAST_S = 1.0          # the checked trainer looks for "go" every KEY_POLL_S for this long (a pause's usual
GO_POLL_S = 0.02         # length: "go" is seen within 2 ms), then every GO_POLL_S (fewer store calls in a long one)
GO_GRACE_S = 30.0        # beyond the push timeout, how long the checked trainer waits for the engine's pause


def _store_client(host: str, port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _wait_key(store: Any, key: str, timeout_s: float, poll_s: float = KEY_POLL_S) -> bool:
    """True once ``key`` is set in ``store``, False after ``timeout_s``. Polls ``check`` every ``poll_s``
    seconds: ``TCPStore.wait`` logs a c10d warning at every timeout, which a serving loop hits twice a
    second."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def _wait_json(store: Any, key: str, timeout_s: float, poll_s: float = KEY_POLL_S) -> dict[str, Any] | None:
    """The JSON value of ``key`` once set, or None after ``timeout_s``."""
    return json.loads(store.get(key)) if _wait_key(store, key, timeout_s, poll_s) else None


def _wait_join_start(store: Any, rid: int, request: proto.PushRequest) -> str | None:
    """The trainer's wait, after accepting request ``rid``, for the orchestrator's word that the engine is
    joining (``KEY_JOINING``): None once it came; why not when the orchestrator gave the push up first (its
    update ended: ``key_go`` with ``ok`` false) or after ``request.timeout_s``. Only past this point does the
    trainer block in the group's rendezvous, which nothing can interrupt."""
    joining, go = proto.group_prefix(request.group) + proto.KEY_JOINING, proto.key_go(rid)
    deadline = time.monotonic() + request.timeout_s
    while not store.check([joining]):
        if store.check([go]):
            return f"the orchestrator gave it up ({json.loads(store.get(go)).get('why')})"
        if time.monotonic() >= deadline:
            return f"the orchestrator did not start the engine's join within {request.timeout_s:.0f} s"
        time.sleep(KEY_POLL_S)
    return None


@dataclasses.dataclass
class PushRecord:
    """What the service did with one request (kept for tests and logs): ``error`` None when it was sent."""

    request: proto.PushRequest
    phase: str = "accepted"
    error: str | None = None
    buckets: int = 0
    seconds: float = 0.0
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(frozen=True)
class _Joined:
    """A push the engine has joined and the trainer has checked (:meth:`PushTransport._join`): the store
    connection, the request's id and request, the ``update_info`` to post."""

    store: Any
    rid: int
    request: proto.PushRequest
    info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Held:
    """One offered version: its manifest, its tensors (views of ``buckets``) and the buckets themselves, packed
    for ``bucket_bytes`` (what a request with that bucket size sends as they are)."""

    version: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    tensors: list[Any]
    buckets: list[Any] = dataclasses.field(default_factory=list)
    bucket_bytes: int = 0


class PushService:
    """Trainer rank 0's side of the push (see the module docstring).

    Args:
        storage: the run's storage (the endpoint file goes there).
        host: the address engines and the orchestrator reach this process at (``MASTER_ADDR`` in a pod).
        port: the store's port (0: any free port).
        on_bucket: called as ``on_bucket(record, index, count)`` after each bucket went out (tests).
        bucket_bytes: the bucket size offered versions are packed for (a request of another size packs
            while it sends).
    """

    def __init__(self, storage: RunStorage, host: str, port: int, *, on_bucket: Callable[..., None] | None = None,
                 bucket_bytes: int = proto.DEFAULT_BUCKET_BYTES):
        import torch.distributed as dist

        self.storage, self.host = storage, host
        self.on_bucket = on_bucket
        self.bucket_bytes = bucket_bytes  # what offered versions are packed for (the requests' usual size)
        self._store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=proto.DEFAULT_TIMEOUT_S))
        self.port = int(self._store.port)
        self._held: dict[int, _Held] = {}  # the newest HELD_VERSIONS versions offered
        self.pushed: set[int] = set()        # versions sent to at least one engine
        self._pushed_changed = threading.Condition()
        self._stop = threading.Event()
        self.records: dict[int, PushRecord] = {}
        self._thread = threading.Thread(target=self._serve, name="rlrun-push", daemon=True)
        self._thread.start()
        storage.weights_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(storage.weights_dir / ENDPOINT_FILE, {"host": host, "port": self.port, "pid": os.getpid()})

    def offer(self, state: dict[str, Any], version: int) -> None:
        """Hold ``state`` (CPU tensors, full) as ``version``: what later requests for ``version`` get. Pushes of
        an older version already under way keep their own reference."""
        names, dtypes, shapes = proto.manifest_of(state)
        # A copy: on CPU the gathered state dict may share storage with the parameters the next optimizer
        # step changes in place, and a push of this version may still be under way then. The copy is made
        # straight into the wire's buckets, so a push of this bucket size sends without packing.
        held = dict(self._held)
        buckets, tensors = proto.pack_buckets([state[n] for n in names], self.bucket_bytes)
        held[version] = _Held(version, names, dtypes, shapes, tensors, buckets, self.bucket_bytes)
        self._held = {v: held[v] for v in sorted(held)[-HELD_VERSIONS:]}

    def close(self, timeout_s: float = proto.DEFAULT_TIMEOUT_S, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop serving: wait up to ``grace_s`` for the newest version to be pushed to an engine at least
        once (the orchestrator asks within milliseconds of its publication), remove the endpoint file (later
        loads read the storage), let the pushes under way finish (each bounded by its own timeout; all of
        them by ``timeout_s``), stop."""
        newest = max(self._held, default=None)
        if newest is not None:
            with self._pushed_changed:
                self._pushed_changed.wait_for(lambda: newest in self.pushed, timeout=grace_s)
        (self.storage.weights_dir / ENDPOINT_FILE).unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        for record in list(self.records.values()):
            record.finished.wait(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._thread.join(timeout=5)

    def _client(self) -> Any:
        return _store_client("127.0.0.1", self.port, proto.DEFAULT_TIMEOUT_S)

    # --- what differs per backend (gloo here; NCCL in nccl_push.NcclPushService) ----------------------------
    def _accept(self, request: proto.PushRequest) -> dict[str, Any]:
        """Fields of the ``accepted`` answer that the orchestrator needs before the engine joins (none for
        gloo: the group's rendezvous is this store)."""
        return {}

    def _open_group(self, store: Any, request: proto.PushRequest, fields: dict[str, Any]) -> Any:
        """Join ``request``'s group as rank 0; blocks until every engine rank joined; raises after
        ``request.timeout_s``."""
        return proto.make_gloo_group(store, request.group, 0, request.world_size, request.timeout_s,
                                     proto.local_address_towards(self.host, self.port))

    def _send(self, group: Any, held: _Held, request: proto.PushRequest, on_bucket: Callable[[int, int], None] | None) -> int:
        """Broadcast ``held``'s tensors in buckets of ``request.bucket_bytes``; returns the bucket count."""
        packed = held.buckets if held.bucket_bytes == request.bucket_bytes else None
        return proto.broadcast_buckets(group, held.tensors, request.bucket_bytes, on_bucket, packed)

    def _close_group(self, group: Any) -> None:
        """Release the trainer's side of ``group`` after the send (gloo: nothing; the object is dropped)."""

    def _forget(self, request: proto.PushRequest) -> None:
        """Drop what :meth:`_accept` kept for ``request`` when its group will never be opened (the orchestrator
        gave the push up before the engine joined; gloo: nothing is kept)."""

    def _serve(self) -> None:
        store = self._client()
        rid = 1
        while not self._stop.is_set():
            if not _wait_key(store, proto.key_request(rid), 0.5):
                continue  # look at the stop flag, wait again
            request = proto.PushRequest.from_json(store.get(proto.key_request(rid)))
            record = self.records[rid] = PushRecord(request)
            threading.Thread(target=self._handle, args=(rid, record), name=f"rlrun-push-{rid}", daemon=True).start()
            rid += 1

    def _handle(self, rid: int, record: PushRecord) -> None:
        request = record.request
        store = self._client()

        def answer(phase: str, error: str | None = None, **fields: Any) -> None:
            record.phase, record.error = phase, error
            store.set(proto.key_status(rid, phase), json.dumps({"ok": error is None, "error": error, **fields}))
            if error is not None:
                log.warning("push %d: %s", rid, error)
                record.finished.set()

        held = self._held.get(request.version)
        if held is None:
            answer("accepted", f"the trainer holds versions {sorted(self._held)}, not {request.version}")
            return
        try:
            fields = self._accept(request)
        except Exception as err:  # noqa: BLE001 - e.g. no NCCL library on this trainer
            answer("accepted", f"the trainer cannot push to engine {request.engine}: {err}")
            return
        answer("accepted", **fields)
        try:
            given_up = _wait_join_start(store, rid, request)
        except Exception as err:  # noqa: BLE001 - the store failed
            given_up = f"the store failed: {err}"
        if given_up is not None:
            self._forget(request)
            answer("checked", f"push of version {request.version} to engine {request.engine} not started: {given_up}")
            return
        try:
            group = self._open_group(store, request, fields)
        except Exception as err:  # noqa: BLE001 - gloo/NCCL/store errors are RuntimeErrors of several kinds
            answer("checked", f"engine {request.engine} did not join the weight-transfer group within "
                              f"{request.timeout_s:.0f} s: {err}")
            return
        try:
            try:
                prefix = proto.group_prefix(request.group) + proto.KEY_EXPECTED
                for rank in range(1, request.world_size):
                    expected = proto.Expected.from_json(store.get(prefix + str(rank)))
                    proto.check_against_engine(held.names, held.dtypes, held.shapes, expected, request.engine)
            except Exception as err:  # noqa: BLE001 - ValueError from the check, store errors
                answer("checked", str(err))
                return
            answer("checked", **proto.update_info(held.names, held.dtypes, held.shapes))
            # The check overlaps the engine's pause; the engine receives only once the orchestrator says go.
            try:
                go = (_wait_json(store, proto.key_go(rid), GO_FAST_S)
                      or _wait_json(store, proto.key_go(rid), request.timeout_s + GO_GRACE_S - GO_FAST_S, GO_POLL_S))
            except Exception as err:  # noqa: BLE001 - the store failed: nothing was sent
                go = {"ok": False, "why": f"the store failed: {err}"}
            if go is None or not go.get("ok"):
                answer("sent", f"push of version {request.version} to engine {request.engine} not started: " + (
                    f"the orchestrator gave it up ({go.get('why')})" if go is not None else
                    f"the orchestrator did not start the load within {request.timeout_s + GO_GRACE_S:.0f} s"))
                return
            start = time.monotonic()
            try:
                record.buckets = self._send(group, held, request,
                                            None if self.on_bucket is None else (lambda i, n: self.on_bucket(record, i, n)))
            except Exception as err:  # noqa: BLE001
                record.seconds = time.monotonic() - start
                answer("sent", f"pushing version {request.version} to engine {request.engine} failed after "
                               f"{record.seconds:.1f} s: {type(err).__name__}: {err}")
                return
        finally:
            self._close_group(group)
        record.seconds = time.monotonic() - start
        answer("sent", buckets=record.buckets, seconds=record.seconds)
        with self._pushed_changed:
            self.pushed.add(request.version)
            self._pushed_changed.notify_all()
        record.finished.set()
        print(f"trainer: pushed version {request.version} to {request.engine} ({record.buckets} buckets, "
              f"{record.seconds:.2f} s)", flush=True)


class PushTransport(FilesystemTransport):
    """``weightSync.transport: gloo`` (see the module docstring). Storage, identity, check and retirement are
    the filesystem transport's; the trainer side also pushes, and ``load_into`` receives the push."""

    name = "gloo"
    backend = "gloo"  # the vLLM weight-transfer backend the engines run (--weight-transfer-config)
    service_cls: type[PushService] = PushService  # the trainer's side of this backend
    # The backends whose engine's start_weight_update touches no weight, so that it may be sent beside the
    # pause while the engine still serves: rlrun's gloo engine only. vLLM's NCCL engine starts its layerwise
    # reload there (every parameter to the meta device): its start waits for the paused engine (_transfer).
    START_WITH_JOIN = frozenset({"gloo"})

    def __init__(self, storage: RunStorage, *, timeout_s: float = proto.DEFAULT_TIMEOUT_S,
                 bucket_bytes: int = proto.DEFAULT_BUCKET_BYTES):
        super().__init__(storage)
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.service: PushService | None = None
        self._workers: dict[str, int] = {}  # engine URL -> its worker count
        self._prepared: dict[tuple[str, int], tuple[str, Any]] = {}  # (engine URL, version) -> prepare's outcome
        self._posted: dict[tuple[str, int], tuple[Any, int]] = {}  # a join under way: its store and request id
        # (engine URL, version) -> the /start_weight_update sent beside the pause, until the load takes it over
        # or the session is ended (_end_session)
        self._sessions: dict[tuple[str, int], asyncio.Future[None]] = {}
        self.fallbacks = 0  # loads that went through the storage copy instead of a push

    # --- trainer side ----------------------------------------------------------------------------------
    def start_service(self, **kwargs: Any) -> PushService:
        """Start the trainer's :class:`PushService` (rank 0, once). Host: ``MASTER_ADDR`` (trainer pod 0's
        name), else 127.0.0.1; port: ``RLRUN_WEIGHT_PUSH_PORT``, else ``constants.WEIGHT_PUSH_PORT``."""
        if self.service is None:
            host = os.environ.get(constants.ENV_MASTER_ADDR) or "127.0.0.1"
            port = int(os.environ.get(constants.ENV_WEIGHT_PUSH_PORT, constants.WEIGHT_PUSH_PORT))
            kwargs.setdefault("bucket_bytes", self.bucket_bytes)
            try:
                self.service = self.service_cls(self.storage, host, port, **kwargs)
            except RuntimeError as err:  # the port is taken (local runs side by side); the endpoint file says
                if port == 0:            # which port is used, so any free one does
                    raise
                log.warning("weight push port %d unavailable (%s); using a free port", port, err)
                self.service = self.service_cls(self.storage, host, 0, **kwargs)
        return self.service

    def publish(self, state_dict: dict[str, Any], version: int, template_dir: Any) -> None:
        """Hold ``state_dict`` for pushes of ``version``, then write it to the storage (which is what tells
        the orchestrator that ``version`` exists)."""
        self.start_service().offer(state_dict, version)
        super().publish(state_dict, version, template_dir)

    def close(self, **kwargs: Any) -> None:
        """Trainer side, at exit: :meth:`PushService.close` with ``kwargs`` (no-op without a service)."""
        if self.service is not None:
            self.service.close(**kwargs)
            self.service = None

    # --- orchestrator side -----------------------------------------------------------------------------
    def _endpoint(self) -> tuple[str, int] | None:
        try:
            data = json.loads((self.storage.weights_dir / ENDPOINT_FILE).read_text(encoding="utf-8"))
            return str(data["host"]), int(data["port"])
        except (OSError, ValueError, KeyError):
            return None

    async def _fallback(self, admin: "VLLMAdmin", version: int, why: str) -> None:
        log.info("engine %s: version %d loaded from the storage instead of pushed: %s", admin.base_url, version, why)
        self.fallbacks += 1
        await super().load_into(admin, version)

    async def prepare(self, admin: "VLLMAdmin", version: int) -> None:
        """The first half of the push, alongside the engine's pause (:meth:`WeightTransport.prepare`): the
        request to the trainer, the engine's join of the group and the start of its update session, the
        trainer's check. Touches no weight: the engine starts its layerwise reload only in ``update_weights``
        (``load_into``). Its outcome (or error) waits for ``load_into`` (or :meth:`release`)."""
        key = (admin.base_url, version)
        try:
            joined = await self._join(admin, version)
        except asyncio.CancelledError:
            raise  # release() tells the trainer, from what _join posted
        except Exception as err:  # noqa: BLE001 - raised by load_into, after the pause
            self._prepared[key] = ("error", err)
        else:
            self._prepared[key] = ("fallback", joined) if isinstance(joined, str) else ("joined", joined)

    async def release(self, admin: "VLLMAdmin", version: int) -> None:
        """Tell the trainer that a prepared push of ``version`` to this engine will not happen: one joined, or
        one whose request was posted when the update ended (pause failed fast, cancelled), so that the
        trainer's thread ends at once instead of at its own bound; end the engine's update session if one was
        started (it loaded nothing: no weight is touched). Best effort."""
        key = (admin.base_url, version)
        kind, joined = self._prepared.pop(key, (None, None))
        posted = self._posted.pop(key, None)
        target = (joined.store, joined.rid) if kind == "joined" and isinstance(joined, _Joined) else posted
        if target is not None:
            await self._give_up(*target, "the update ended before the load")
        await self._end_session(admin, key)

    async def _end_session(self, admin: "VLLMAdmin", key: tuple[str, int],
                           started: "asyncio.Future[None] | None" = None) -> None:
        """End the update session opened beside the pause for ``key`` (``started``: its start, when the caller
        took it already; no-op when there is none): wait for the start to be answered, then
        ``/finish_weight_update`` without a version. Called only where no ``update_weights`` of the session
        ran, so rlrun's gloo engine finalizes nothing (its finish touches no weight; vLLM's worker marks the
        session over). Also sent when the start failed (a timed-out start may still have opened the session;
        a refused one opened none, and the finish's refusal is then expected). The session's entry stays until
        the finish was answered, so a caller cancelled meanwhile leaves it to :meth:`release`. Never raises
        but cancellation."""
        owned = started is None
        started = started if started is not None else self._sessions.get(key)
        if started is None:
            return
        try:
            await asyncio.wait({started})
            start_failed = started.cancelled() or started.exception() is not None  # (retrieves the exception)
            try:
                await admin.finish_weight_update()
            except EngineError as err:
                log.log(logging.INFO if start_failed else logging.WARNING,
                        "engine %s: ending the unused weight-update session failed (%s): %s", admin.base_url,
                        "its start had failed too" if start_failed else "the next update's start may be refused",
                        err)
        except asyncio.CancelledError:
            raise
        else:
            if owned and self._sessions.get(key) is started:
                del self._sessions[key]

    @staticmethod
    async def _give_up(store: Any, rid: int, why: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.set, proto.key_go(rid), json.dumps({"ok": False, "why": why}))

    async def load_into(self, admin: "VLLMAdmin", version: int) -> bool:
        """Receive ``version`` pushed by the trainer (module docstring); from the storage copy when the
        trainer's service is unreachable or does not hold ``version``. Takes over what :meth:`prepare` did
        for ``(admin, version)``, or does it first.

        Returns:
            True when pushed: the engine's ``/finish_weight_update`` named ``version`` too; False when loaded
            from the storage copy (the update sequence names it).

        Raises:
            EngineError: the engine or the trainer failed the push; the message names the engine.
        """
        key = (admin.base_url, version)
        kind, joined = self._prepared.pop(key, (None, None))
        if kind == "error":
            raise joined
        if kind == "joined" and isinstance(joined, _Joined):
            gave_up = await self._trainer_gave_up(joined)
            if gave_up is None:  # the trainer went away after its check: nothing reached the engine's weights
                await self._end_session(admin, key)
                await self._fallback(admin, version, "the trainer's push service stopped answering before the "
                                                     "load began")
                return False
            if gave_up:
                await self._end_session(admin, key)
                joined = None  # the pause outlasted the trainer's wait: join afresh
        if joined is None:
            joined = await self._join(admin, version)
        if isinstance(joined, str):
            await self._fallback(admin, version, joined)
            return False
        await self._transfer(admin, joined)
        return True

    @staticmethod
    async def _trainer_gave_up(joined: "_Joined") -> bool | None:
        """True when the trainer already ended this push (its wait for ``go`` ran out); None when its store
        does not answer."""
        try:
            return bool(await asyncio.to_thread(joined.store.check, [proto.key_status(joined.rid, "sent")]))
        except (RuntimeError, OSError):
            return None

    async def _join(self, admin: "VLLMAdmin", version: int) -> "_Joined | str":
        """Open the engine's update session (backends in ``START_WITH_JOIN``), request the push, have the engine
        join the group, wait for the trainer's check. Returns what the transfer needs (the session open), or
        why ``version`` is to be loaded from the storage copy instead (the session ended again).

        Raises:
            EngineError: the engine is not healthy, did not join, or the trainer refused its model.
        """
        endpoint = self._endpoint()
        if endpoint is None:
            return "no trainer push service has announced itself"
        key = (admin.base_url, version)
        try:
            joined = await self._join_at(admin, version, *endpoint)
        except Exception:  # EngineError, or anything unforeseen: no session is left open behind it
            await self._end_session(admin, key)
            raise
        if isinstance(joined, str):  # the storage copy is loaded instead: no session needed
            await self._end_session(admin, key)
        return joined

    async def _join_at(self, admin: "VLLMAdmin", version: int, host: str, port: int) -> "_Joined | str":
        """:meth:`_join` once the trainer's endpoint is known."""
        try:
            store = await asyncio.to_thread(_store_client, host, port, CONNECT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001
            return f"trainer push service {host}:{port} unreachable ({err})"
        if not await admin.health():  # a dead engine fails here, before the trainer waits for it to join
            raise EngineError(admin.base_url, f"not healthy (GET /health): version {version} not pushed")
        key = (admin.base_url, version)
        if self.backend in self.START_WITH_JOIN and key not in self._sessions:
            # The session's start, beside the pause: it only records the session, so it may run while the engine
            # serves. Sent now, it reaches the engine core while vLLM's pause sleeps 20 ms in the API server (the
            # engine core idle), as a rule after the pause's own utility call and before the join. From here on every
            # path that does not reach the load ends the session (_join; release() when cancelled; load_into
            # when it gives the prepared push up).
            self._sessions[key] = asyncio.ensure_future(admin.start_weight_update())
        workers = self._workers.get(admin.base_url) or await admin.worker_count()
        self._workers[admin.base_url] = workers  # fixed by the spec (TP x DP) for the server's life
        request = proto.PushRequest(group=uuid.uuid4().hex, version=version, engine=admin.base_url,
                                    world_size=1 + workers, timeout_s=self.timeout_s, bucket_bytes=self.bucket_bytes)
        try:
            rid = await asyncio.to_thread(store.add, proto.KEY_REQUEST_COUNT, 1)
            self._posted[key] = (store, rid)  # from here on, an update that ends early tells the trainer (release)
            await asyncio.to_thread(store.set, proto.key_request(rid), request.to_json())
            accepted = await asyncio.to_thread(_wait_json, store, proto.key_status(rid, "accepted"), ACCEPT_TIMEOUT_S)
        except (RuntimeError, OSError, ValueError) as err:  # the trainer went away: nothing started on the engine
            self._posted.pop(key, None)
            return f"trainer push service {host}:{port} stopped answering ({err})"
        try:
            return await self._join_accepted(admin, store, rid, request, host, port, accepted)
        finally:
            if not asyncio.current_task().cancelling():  # a cancelled join leaves its entry to release()
                self._posted.pop(key, None)

    async def _join_accepted(self, admin: "VLLMAdmin", store: Any, rid: int, request: proto.PushRequest,
                             host: str, port: int, accepted: dict[str, Any] | None) -> "_Joined | str":
        if accepted is None or not accepted["ok"]:
            return "trainer push service: " + ("no answer" if accepted is None else accepted["error"])
        url, limit = admin.base_url, request.timeout_s + 30.0
        try:
            await self._before_init(admin, store, request)
        except EngineError:
            raise
        except (RuntimeError, OSError) as err:  # the trainer's store went away: nothing started on the engine
            return f"trainer push service {host}:{port} stopped answering ({err})"
        await admin.init_weight_transfer_engine(self._init_info(request, host, port, accepted), timeout_s=limit)
        try:
            checked = await asyncio.to_thread(_wait_json, store, proto.key_status(rid, "checked"), limit)
        except (RuntimeError, OSError, ValueError) as err:
            raise EngineError(url, f"weight push of version {request.version}: the trainer's push service stopped "
                                   f"answering before any tensor was sent ({err})") from err
        if checked is None or not checked["ok"]:
            raise EngineError(url, "weight push refused before any tensor was sent: "
                                   + ("the trainer did not answer" if checked is None else checked["error"]))
        return _Joined(store, rid, request, proto.update_info(checked["names"], checked["dtype_names"], checked["shapes"]))

    async def _receive(self, admin: "VLLMAdmin", store: Any, rid: int, request: proto.PushRequest,
                       info: dict[str, Any], limit: float) -> dict[str, Any] | None:
        """``POST /update_weights`` (the engine receives every bucket), watching the trainer's "sent" answer
        meanwhile; returns that answer if it came (None if not yet).

        The whole model crosses during the call, so the call alone is bounded like a filesystem reload
        (RELOAD_TIMEOUT_S). Once the trainer has answered (every bucket out, or its send failed) the engine
        gets ``limit`` seconds more (``timeout_s`` + 30: its own receive is bounded by ``timeout_s``), so a
        stopped or hung engine (SIGSTOP, a frozen node: its socket buffers take the buckets and it never
        answers) fails the update within ``limit`` of the trainer's answer instead of after RELOAD_TIMEOUT_S.

        Raises:
            EngineError: the engine answered an error, or did not answer within ``limit`` after the trainer.
        """
        key = proto.key_status(rid, "sent")
        receive = asyncio.ensure_future(admin.update_weights(info, timeout_s=max(limit, RELOAD_TIMEOUT_S)))
        sent: dict[str, Any] | None = None
        answered_at = 0.0
        watching = True  # False once the trainer's store is gone: the engine's own receive then ends it
        try:
            while not receive.done():
                if watching and sent is None:
                    try:
                        if await asyncio.to_thread(store.check, [key]):
                            sent = json.loads(await asyncio.to_thread(store.get, key))
                            answered_at = time.monotonic()
                    except (RuntimeError, OSError, ValueError) as err:  # DistNetworkError: the trainer died
                        log.warning("weight push to %s: the trainer's store stopped answering (%s); waiting for "
                                    "the engine's own receive to end", admin.base_url, err)
                        watching = False
                if sent is not None and time.monotonic() - answered_at > limit:
                    trainer = "sent every bucket" if sent["ok"] else "failed to send"  # its error: the caller adds it
                    raise EngineError(admin.base_url, f"the trainer {trainer} {limit:.0f} s ago and the engine "
                                      "has not answered (stopped or hung?)")
                await asyncio.wait({receive}, timeout=SENT_POLL_S)
            receive.result()
        finally:
            if not receive.done():
                receive.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await receive
        return sent

    # --- what differs per backend (gloo here; NCCL in nccl_push.NcclPushTransport) --------------------------
    def _init_info(self, request: proto.PushRequest, host: str, port: int, accepted: dict[str, Any]) -> dict[str, Any]:
        """The ``POST /init_weight_transfer_engine`` ``init_info`` of this backend's engine
        (:class:`rlrun_runtime.weights.gloo_engine.GlooWeightTransferInitInfo`)."""
        return {"master_address": host, "master_port": port, "rank_offset": 1,
                "world_size": request.world_size, "group": request.group, "timeout_s": request.timeout_s,
                "packed": True, "packed_buffer_size_bytes": request.bucket_bytes}

    async def _before_init(self, admin: "VLLMAdmin", store: Any, request: proto.PushRequest) -> None:
        """Called right before the engine is told to join: say so to the trainer (``KEY_JOINING``), which only
        then starts waiting for the group (gloo: the engine posts what its model expects itself)."""
        await asyncio.to_thread(store.set, proto.group_prefix(request.group) + proto.KEY_JOINING, "1")

    async def _after_finish(self, admin: "VLLMAdmin") -> None:
        """Called after ``/finish_weight_update``. gloo keeps the group until the next init replaces it
        (gloo_engine drops the old one first): no shutdown call, one RPC less per update."""

    async def _transfer(self, admin: "VLLMAdmin", joined: "_Joined") -> None:
        """The second half of the push, on the paused engine: tell the trainer to send, the engine's update
        session (started beside the pause, else now), receive every bucket, finish naming the version.

        Raises:
            EngineError: the trainer or the engine failed; the message names the engine. No session is left
                open: one that received nothing is ended (no weight touched), a failed ``update_weights``
                ended it in the worker, one that received everything is finished.
        """
        store, rid, request, info = joined.store, joined.rid, joined.request, joined.info
        url, limit = admin.base_url, request.timeout_s + 30.0
        started = self._sessions.pop((url, request.version), None)  # the start sent beside the pause, if any
        if started is not None:
            try:
                await started  # answered long ago, as a rule (it went out with the join)
            except EngineError as err:  # no session (or, timed out, an unknown one): nothing is sent
                await self._give_up(store, rid, f"the engine's start_weight_update failed: {err}")
                await self._end_session(admin, (url, request.version), started)
                raise
        try:
            await asyncio.to_thread(store.set, proto.key_go(rid), json.dumps({"ok": True}))
        except (RuntimeError, OSError) as err:
            await self._end_session(admin, (url, request.version), started)
            raise EngineError(url, f"weight push of version {request.version}: the trainer's push service stopped "
                                   f"answering before any tensor was sent ({err})") from err
        if started is None:
            await admin.start_weight_update()  # vLLM's NCCL engine: its layerwise reload starts here, paused
        try:
            sent = await self._receive(admin, store, rid, request, info, limit)
        except EngineError as err:
            try:
                sent = await asyncio.to_thread(_wait_json, store, proto.key_status(rid, "sent"), 5.0)
            except (RuntimeError, OSError, ValueError):  # the trainer's store is gone too
                sent = None
            detail = f"; trainer: {sent['error']}" if sent and sent.get("error") else ""
            raise EngineError(url, f"receiving version {request.version} failed: {err}{detail}") from err
        try:
            if sent is None:
                try:
                    sent = await asyncio.to_thread(_wait_json, store, proto.key_status(rid, "sent"), limit)
                except (RuntimeError, OSError, ValueError) as err:
                    raise EngineError(url, f"version {request.version}: the trainer's push service stopped "
                                           f"answering before it confirmed the push ({err})") from err
            if sent is None or not sent["ok"]:
                raise EngineError(url, "the trainer did not confirm the push: "
                                       + ("no answer" if sent is None else sent["error"]))
        except EngineError:
            # update_weights answered, so the engine's session is open: finish it (without the version) so that
            # the restore's start is not refused, then report the trainer's failure
            with contextlib.suppress(EngineError):
                await admin.finish_weight_update()
            raise
        await admin.finish_weight_update(request.version)
        await self._after_finish(admin)
