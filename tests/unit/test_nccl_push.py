"""The ``nccl`` push transport on CPU: its contract with vLLM's NCCL engine, the trainer without a GPU, and the
storage fallback after failed pushes. The NCCL send itself needs GPUs (docs/weight-transport.md)."""

from __future__ import annotations

import asyncio
import base64
import os

import pytest
import torch

from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import EngineError
from rlrun_runtime.weights import get_transport
from rlrun_runtime.weights import nccl_push
from rlrun_runtime.weights.nccl_push import NcclPushTransport
from rlrun_runtime.weights.push import PushTransport


def test_init_info_is_what_vllms_nccl_engine_takes():
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCL_UNIQUE_ID_BYTES
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
    from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_NUM_BUFFERS

    raw = os.urandom(NCCL_UNIQUE_ID_BYTES)
    ours = nccl_push.init_info(base64.b64encode(raw).decode(), world_size=3, bucket_bytes=1 << 20)
    info = NCCLWeightTransferInitInfo(**ours)  # vLLM's own parsing of the engine's init_info
    assert info.nccl_unique_id_bytes == raw and info.master_address is None
    assert (info.rank_offset, info.world_size, info.packed, info.packed_buffer_size_bytes) == (1, 3, True, 1 << 20)
    assert info.packed_num_buffers == nccl_push.NUM_BUFFERS == DEFAULT_PACKED_NUM_BUFFERS
    assert worker_init_payload(info) == ours  # what vLLM's own trainer would send, field for field


class _Admin:
    """An engine's admin API as the transport uses it: reloads are recorded; nothing is pushed."""

    base_url = "http://10.0.0.7:8000"

    def __init__(self, healthy: bool = True) -> None:
        self.healthy, self.reloaded, self.shutdowns = healthy, [], 0

    async def health(self) -> bool:
        return self.healthy

    async def worker_count(self) -> int:
        return 1

    async def reload_weights(self, path: str) -> None:
        self.reloaded.append(path)

    async def shutdown_weight_transfer_engine(self) -> None:
        self.shutdowns += 1


def _publish(tmp_path, transport, version: int) -> None:
    template = tmp_path / "template"
    template.mkdir(exist_ok=True)
    (template / "config.json").write_text("{}")
    transport.publish({"w": torch.full((4, 4), float(version))}, version, template)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: a trainer without a GPU")
def test_a_trainer_without_a_gpu_answers_why_and_the_engine_loads_the_storage_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUN_WEIGHT_PUSH_PORT", "0")
    transport = get_transport("nccl", RunStorage(tmp_path / "run"))
    assert isinstance(transport, NcclPushTransport) and transport.backend == "nccl"
    try:
        _publish(tmp_path, transport, 1)
        admin = _Admin()
        assert asyncio.run(transport.load_into(admin, 1)) is False  # the storage copy: the sequence names it
        assert admin.reloaded == [str(transport.path(1))] and transport.fallbacks == 1
        record = transport.service.records[1]
        assert "needs a GPU on the trainer" in record.error and record.phase == "accepted"
        assert transport.failed_pushes == {}  # the trainer declined before anything started: not a failure
    finally:
        transport.close(timeout_s=5, grace_s=0)


def test_after_a_failed_push_the_restore_reads_the_storage_and_three_failures_stay_there(tmp_path, monkeypatch):
    pushes: list[int] = []

    async def failing_push(self, admin, version):
        pushes.append(version)
        raise EngineError(admin.base_url, "NCCL init with the engine did not finish within 5 s")

    monkeypatch.setattr(PushTransport, "load_into", failing_push)
    transport = NcclPushTransport(RunStorage(tmp_path / "run"))
    for version in (1, 2, 3, 4):
        transport.path(version).mkdir(parents=True)
    admin = _Admin()

    async def scenario() -> list[str]:
        outcome = []
        for version, previous in ((2, 1), (3, 1), (4, 1)):
            with pytest.raises(EngineError, match="did not finish"):
                await transport.load_into(admin, version)  # the update's push
            await transport.load_into(admin, previous)      # the update sequence's restore
            outcome.append(admin.reloaded[-1])
        await transport.load_into(admin, 4)                 # after three failures: the storage copy, no push
        outcome.append(admin.reloaded[-1])
        return outcome

    restored = asyncio.run(scenario())
    assert pushes == [2, 3, 4]  # no push after the third failure
    assert restored == [str(transport.path(1))] * 3 + [str(transport.path(4))]
    assert admin.shutdowns == 3 and transport.failed_pushes == {admin.base_url: 3}
    with pytest.raises(EngineError, match="not healthy"):  # a stopped engine is not reloaded (that would hang)
        asyncio.run(_unhealthy(transport))


async def _unhealthy(transport: NcclPushTransport) -> None:
    admin = _Admin(healthy=False)
    transport.failed_pushes[admin.base_url] = nccl_push.FAILURES_BEFORE_STORAGE
    await transport.load_into(admin, 4)


def test_a_push_that_succeeds_again_clears_the_count(tmp_path, monkeypatch):
    results = iter([EngineError("http://10.0.0.7:8000", "broadcast timed out"), None])

    async def push(self, admin, version):
        outcome = next(results)
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(PushTransport, "load_into", push)
    transport = NcclPushTransport(RunStorage(tmp_path / "run"))
    transport.path(1).mkdir(parents=True)
    admin = _Admin()

    async def scenario() -> None:
        with pytest.raises(EngineError):
            await transport.load_into(admin, 2)
        await transport.load_into(admin, 1)  # restore, from the storage
        await transport.load_into(admin, 3)  # pushed

    asyncio.run(scenario())
    assert transport.failed_pushes == {} and admin.reloaded == [str(transport.path(1))]



class _NoModelAdmin(_Admin):
    async def expected_weights(self):  # the engine cannot say what its model expects: the join never starts
        raise EngineError(self.base_url, "expected weights: HTTP 500")


def test_a_push_given_up_before_the_engine_joined_forgets_the_minted_nccl_unique_id(tmp_path, monkeypatch):
    """The trainer mints one ncclUniqueId per accepted push; a push given up before its group opens (here the
    engine fails before it joins, and the trainer's wait for the join ends at its bound) must not leave the
    id behind (one more per failed update, for the trainer's life)."""
    monkeypatch.setenv("RLRUN_WEIGHT_PUSH_PORT", "0")

    def accept(self, request):  # _accept's bookkeeping without a GPU: the id as minted
        self._unique_ids[request.group] = raw = os.urandom(128)
        return {"nccl_unique_id_b64": base64.b64encode(raw).decode()}

    monkeypatch.setattr(nccl_push.NcclPushService, "_accept", accept)
    transport = NcclPushTransport(RunStorage(tmp_path / "run"), timeout_s=2.0)
    try:
        _publish(tmp_path, transport, 1)
        with pytest.raises(EngineError, match="expected weights"):
            asyncio.run(transport.load_into(_NoModelAdmin(), 1))
        record = transport.service.records[1]
        assert record.finished.wait(60), record.phase
        assert "not started" in record.error and transport.service._unique_ids == {}
    finally:
        transport.close(timeout_s=5, grace_s=0)
