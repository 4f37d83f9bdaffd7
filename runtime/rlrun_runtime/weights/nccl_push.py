"""``weightSync.transport: nccl``: the push of :mod:`rlrun_runtime.weights.push` over NCCL into vLLM's own NCCL
weight-transfer engine (``--weight-transfer-config {"backend":"nccl"}``), for GPUs on both sides.

What differs from ``gloo`` (docs/weight-transport.md has the whole sequence): the group's rendezvous is an
``ncclUniqueId`` the trainer mints per group and hands the orchestrator in its ``accepted`` answer (vLLM's
``nccl_unique_id_b64`` mode: no second fixed port; NCCL's data ports are ephemeral and the run's NetworkPolicy
admits TCP between its trainer and inference pods); what the engine's model expects comes from rlrun's worker
method (vLLM's NCCL engine posts nothing); vLLM's ``packed_nccl_broadcast_producer`` sends, each bucket copied
to the trainer's GPU as it is packed; both sides drop the group after every update. An engine whose push
failed is restored from the storage copy, and after :data:`FAILURES_BEFORE_STORAGE` failed pushes in a row it
loads every version from there (the run goes on, slower). Never run on GPUs here: vLLM's CUDA build and two
GPUs are needed (NCCL puts one rank per GPU); what is tested on CPU is listed in the docs.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from rlrun_runtime.vllm_admin import EngineError
from rlrun_runtime.weights import push_protocol as proto
from rlrun_runtime.weights.push import PushService, PushTransport, _Held

if TYPE_CHECKING:
    from rlrun_runtime.vllm_admin import VLLMAdmin

log = logging.getLogger(__name__)

KEY_JOINING = proto.KEY_JOINING  # under group_prefix: the orchestrator is about to tell the engine to join
NUM_BUFFERS = 2              # buckets in flight (vLLM's DEFAULT_PACKED_NUM_BUFFERS); both sides must agree
FAILURES_BEFORE_STORAGE = 3  # failed pushes in a row after which an engine loads from the storage copy


def init_info(unique_id_b64: str, world_size: int, bucket_bytes: int) -> dict[str, Any]:
    """The ``POST /init_weight_transfer_engine`` ``init_info`` of vLLM 0.32's NCCL engine
    (``vllm.distributed.weight_transfer.nccl_common.NCCLWeightTransferInitInfo``) in unique-id mode: the
    engine's workers take ranks 1.. after the trainer's rank 0 (pure)."""
    return {"nccl_unique_id_b64": unique_id_b64, "rank_offset": 1, "world_size": world_size, "packed": True,
            "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": NUM_BUFFERS}


def _bounded(target: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``target()`` in a daemon thread, its result within ``timeout_s``.

    NCCL calls block without a timeout of their own (``ncclCommInitRank`` waits for every rank, a broadcast
    for its peers); this bounds the caller's wait. Raises TimeoutError naming ``what`` (the thread is left to
    the caller's abort: :meth:`NcclPushService._send` aborts the communicator, which ends a blocked broadcast;
    an init that never completes keeps its thread, logged), or whatever ``target`` raised."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = target()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            result["error"] = err

    thread = threading.Thread(target=run, name=f"rlrun-nccl-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s:.0f} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class NcclPushService(PushService):
    """The trainer's side over NCCL (module docstring); the request handling is :class:`PushService`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unique_ids: dict[str, bytes] = {}  # group -> the ncclUniqueId minted for it
        self.device: Any = None

    def _accept(self, request: proto.PushRequest) -> dict[str, Any]:
        """Mint the group's ``ncclUniqueId``. Raises RuntimeError when this trainer has no GPU or no NCCL (the
        orchestrator then loads the version from the storage copy)."""
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("weightSync.transport nccl needs a GPU on the trainer (torch.cuda is not available)")
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        self.device = torch.device("cuda", torch.cuda.current_device())
        raw = bytes(NCCLLibrary().ncclGetUniqueId().internal)
        self._unique_ids[request.group] = raw
        return {"nccl_unique_id_b64": base64.b64encode(raw).decode("ascii")}

    def _open_group(self, store: Any, request: proto.PushRequest, fields: dict[str, Any]) -> Any:
        """Join the communicator as rank 0 (vLLM's ``PyNcclCommunicator.from_unique_id_bytes``, whose
        one-element all-reduce the engine's side matches); called once the orchestrator said the engine is
        joining (``PushService._handle``). Raises TimeoutError after ``request.timeout_s``."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

        raw = self._unique_ids.pop(request.group)
        return _bounded(lambda: PyNcclCommunicator.from_unique_id_bytes(raw, 0, request.world_size, self.device),
                        request.timeout_s, f"NCCL init with {request.engine}")

    def _send(self, group: Any, held: _Held, request: proto.PushRequest,
              on_bucket: Callable[[int, int], None] | None) -> int:
        """vLLM's packed producer over ``group``, bounded by ``request.timeout_s`` (on timeout the communicator
        is aborted, which ends the blocked broadcast). Returns the bucket count (vLLM's packing rule, which
        :func:`proto.plan_buckets` mirrors)."""
        import torch
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        device = self.device

        def send() -> None:
            with torch.cuda.device(device):
                packed_nccl_broadcast_producer(
                    iterator=iter(zip(held.names, held.tensors)), group=group, src=0,
                    post_iter_func=lambda item: item[1].to(device), buffer_size_bytes=request.bucket_bytes,
                    num_buffers=NUM_BUFFERS)

        try:
            _bounded(send, request.timeout_s, f"NCCL send to {request.engine}")
        except TimeoutError:
            group.destroy()  # ncclCommAbort: the stuck broadcast returns, the send thread ends
            raise
        count = len(proto.plan_buckets([t.numel() * t.element_size() for t in held.tensors], request.bucket_bytes))
        if on_bucket is not None:
            for index in range(count):
                on_bucket(index, count)
        return count

    def _close_group(self, group: Any) -> None:
        """Destroy the trainer's communicator (vLLM's ``destroy``: an abort, itself bounded to 5 s)."""
        group.destroy()

    def _forget(self, request: proto.PushRequest) -> None:
        """Drop the ``ncclUniqueId`` minted for a push that was given up before its group opened."""
        self._unique_ids.pop(request.group, None)


class NcclPushTransport(PushTransport):
    """``weightSync.transport: nccl`` (module docstring)."""

    name = "nccl"
    backend = "nccl"
    service_cls = NcclPushService

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed_pushes: dict[str, int] = {}  # engine URL -> failed pushes in a row
        self._from_storage_next: set[str] = set()  # engines whose next load (the restore) reads the storage

    def _init_info(self, request: proto.PushRequest, host: str, port: int, accepted: dict[str, Any]) -> dict[str, Any]:
        return init_info(accepted["nccl_unique_id_b64"], request.world_size, request.bucket_bytes)

    async def _before_init(self, admin: "VLLMAdmin", store: Any, request: proto.PushRequest) -> None:
        """Post what the engine's model expects for every engine rank (the trainer checks it before the first
        send), then that the engine is joining."""
        import asyncio

        expected = await admin.expected_weights()
        if not expected:
            raise EngineError(admin.base_url, "reported no expected weights (rlrun's worker extension missing?)")
        prefix = proto.group_prefix(request.group)
        for rank in range(1, request.world_size):
            value = json.dumps(expected[min(rank - 1, len(expected) - 1)])
            await asyncio.to_thread(store.set, prefix + proto.KEY_EXPECTED + str(rank), value)
        await super()._before_init(admin, store, request)  # then: the engine is joining

    async def prepare(self, admin: "VLLMAdmin", version: int) -> None:
        """Nothing ahead of the pause over NCCL: whether a load pushes at all is decided in ``load_into`` (the
        storage copy after failed pushes), and an NCCL join beside a GPU engine still serving is unmeasured."""

    async def _after_finish(self, admin: "VLLMAdmin") -> None:
        """vLLM's NCCL engine replaces its group on the next init without destroying it: shut it down now."""
        await admin.shutdown_weight_transfer_engine()

    async def load_into(self, admin: "VLLMAdmin", version: int) -> bool:
        """Push ``version`` (:meth:`PushTransport.load_into`). The load after a failed push (the update
        sequence's restore of the previous version) reads the storage copy; after
        :data:`FAILURES_BEFORE_STORAGE` failed pushes in a row every load of that engine does. Returns True
        when the push named the version (its finish), False when the storage copy was loaded.

        Raises:
            EngineError: the push failed (counted for the engine), or the engine is not healthy.
        """
        url = admin.base_url
        failures = self.failed_pushes.get(url, 0)
        if url in self._from_storage_next or failures >= FAILURES_BEFORE_STORAGE:
            if not await admin.health():  # a dead or stopped engine fails here, fast
                raise EngineError(url, f"not healthy (GET /health): version {version} not loaded")
            self._from_storage_next.discard(url)
            why = (f"{failures} NCCL pushes to it failed in a row" if failures >= FAILURES_BEFORE_STORAGE
                   else "the last NCCL push to it failed")
            await self._fallback(admin, version, why)
            return False
        try:
            named = await super().load_into(admin, version)
        except EngineError:
            self.failed_pushes[url] = failures + 1
            self._from_storage_next.add(url)
            try:
                await admin.shutdown_weight_transfer_engine()  # best effort: drop the half-used group
            except EngineError:
                pass
            raise
        self.failed_pushes.pop(url, None)
        return bool(named)
