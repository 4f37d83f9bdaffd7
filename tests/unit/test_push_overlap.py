"""The push's first half (request, the engine's join of the gloo group, the trainer's check) runs alongside the
engine's pause, through the one update sequence, with the trainer's real push service and a stand-in engine
that joins and receives over real gloo as rlrun's engine does (tests/integration/test_push_weights.py has the
same against real vLLM). The stand-in's pause and join run side by side; in vLLM both go through the engine
core's loop one after the other, so what the overlap saves there is measured by benchmarks/weight_push.py."""

from __future__ import annotations

import asyncio
import datetime
import time

import torch
import torch.distributed as dist

from rlrun_api import constants
from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import EngineError
from rlrun_runtime.weights import push_protocol as proto
from rlrun_runtime.weights.push import PushTransport
from rlrun_runtime.weights.update import PauseOrder, update_engine

PAUSE_S = 2.0  # the stand-in engine's pause: far longer than a join on loopback (ms; 130 ms seen on 2 loaded cores)


class _Engine:
    """An engine's admin API as the update sequence and the push use it; ``init_weight_transfer_engine`` and
    ``update_weights`` do what :class:`rlrun_runtime.weights.gloo_engine.GlooWeightTransferEngine` does (join
    the trainer's group as rank 1, receive the buckets), the rest records what was called and when."""

    base_url = "http://10.0.0.9:8000"

    def __init__(self, pause_fails: bool = False, base_url: str | None = None, fail_when=None) -> None:
        self.pause_fails = pause_fails
        self.fail_when = fail_when  # a callable: the pause fails as soon as it returns True
        self.base_url = base_url or self.base_url
        self.calls: list[tuple[str, float]] = []
        self.group = None
        self.received: dict[str, torch.Tensor] = {}
        self.version = "default"

    def _note(self, name: str) -> None:
        self.calls.append((name, time.monotonic()))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def at(self, name: str) -> float:
        return next(t for n, t in self.calls if n == name)

    async def health(self) -> bool:
        self._note("health")
        return True

    async def worker_count(self) -> int:
        return 1

    async def pause(self, mode: str = "keep") -> None:
        self._note("pause")
        if self.fail_when is not None:
            deadline = time.monotonic() + 10.0
            while not self.fail_when():
                assert time.monotonic() < deadline, "the fail condition never held"
                await asyncio.sleep(0.001)
            self._note("paused")
            raise EngineError(self.base_url, "pause failed (test)")
        await asyncio.sleep(PAUSE_S)
        self._note("paused")
        if self.pause_fails:
            raise EngineError(self.base_url, "pause failed (test)")

    async def init_weight_transfer_engine(self, init_info: dict, timeout_s: float) -> None:
        self._note("init")

        def join() -> None:
            store = dist.TCPStore(init_info["master_address"], init_info["master_port"], is_master=False,
                                  timeout=datetime.timedelta(seconds=init_info["timeout_s"]))
            store.set(proto.group_prefix(init_info["group"]) + proto.KEY_EXPECTED + "1",
                      proto.Expected("float32", None).to_json())
            self.group = proto.make_gloo_group(store, init_info["group"], 1, init_info["world_size"],
                                               init_info["timeout_s"], "127.0.0.1")
            self.bucket_bytes = init_info["packed_buffer_size_bytes"]

        await asyncio.to_thread(join)
        self._note("joined")

    async def start_weight_update(self) -> None:
        self._note("start")

    async def update_weights(self, update_info: dict, timeout_s: float) -> None:
        self._note("update")
        dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
        await asyncio.to_thread(proto.receive_buckets, self.group, update_info["names"], dtypes,
                                update_info["shapes"], self.bucket_bytes,
                                lambda weights: self.received.update({n: t.clone() for n, t in weights}))

    async def finish_weight_update(self) -> None:
        self._note("finish")

    async def update_weight_version(self, version) -> None:
        self.version = str(version)

    async def reset_prefix_cache(self) -> bool:
        return True

    async def resume(self) -> None:
        self._note("resume")

    async def weight_info(self) -> str:
        return self.version

    async def reload_weights(self, path: str) -> None:
        self._note("reload")


def _transport(tmp_path, monkeypatch) -> PushTransport:
    monkeypatch.setenv(constants.ENV_WEIGHT_PUSH_PORT, "0")
    monkeypatch.setenv(constants.ENV_MASTER_ADDR, "127.0.0.1")
    return PushTransport(RunStorage(tmp_path / "storage"), timeout_s=10.0, bucket_bytes=4096)


def _publish(tmp_path, transport: PushTransport, version: int) -> dict[str, torch.Tensor]:
    template = tmp_path / "template"
    template.mkdir(exist_ok=True)
    (template / "config.json").write_text("{}")
    generator = torch.Generator().manual_seed(version)
    state = {"a.weight": torch.randn(40, 40, generator=generator), "b.bias": torch.randn(7, generator=generator),
             "c.weight": torch.randn(3, 900, generator=generator)}
    transport.publish(state, version, template)
    return state


def _update_expecting_a_failed_pause(engine: _Engine, transport: PushTransport) -> None:
    """Run the update sequence on ``engine``; it must end with the stand-in's pause failure."""
    try:
        asyncio.run(update_engine(engine, 1, transport, previous=None))
    except EngineError as err:
        assert "pause failed" in str(err)
    else:
        raise AssertionError("the failed pause was not reported")


def test_the_engine_joins_while_it_pauses_and_receives_once_paused(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch)
    try:
        state = _publish(tmp_path, transport, 1)
        engine = _Engine()
        update = asyncio.run(update_engine(engine, 1, transport, previous=None))
        assert update.reported_version == 1 and transport.fallbacks == 0
        assert engine.names()[-4:] == ["start", "update", "finish", "resume"]
        # the join (and the trainer's check) happened inside the pause; the weights only after it
        assert engine.at("pause") <= engine.at("init") and engine.at("joined") < engine.at("paused")
        assert engine.at("paused") <= engine.at("start")
        assert set(engine.received) == set(state)
        for name, tensor in state.items():
            assert torch.equal(engine.received[name], tensor)
        record = next(iter(transport.service.records.values()))
        assert record.finished.wait(10) and record.error is None and record.buckets > 1
        # the trainer sent only once told to: had it sent right after its check, its send would have waited
        # for the engine's receive through the rest of the 2 s pause
        assert record.seconds < PAUSE_S / 2, record.seconds
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_failed_pause_gives_the_prepared_push_up_and_the_trainer_sends_nothing(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch)
    try:
        _publish(tmp_path, transport, 1)
        engine = _Engine(pause_fails=True)
        began = time.monotonic()
        _update_expecting_a_failed_pause(engine, transport)
        assert "start" not in engine.names() and "update" not in engine.names() and engine.names()[-1] == "resume"
        record = next(iter(transport.service.records.values()))
        # told, the trainer ends the push at once (its own bound would be the push timeout + 30 s)
        assert record.finished.wait(5.0), record.phase
        assert record.error is not None and "gave it up" in record.error and record.buckets == 0
        assert time.monotonic() - began < 5.0 + PAUSE_S
        assert not transport._prepared
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_pause_that_fails_while_the_join_is_under_way_still_frees_the_trainer_at_once(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch)
    try:
        _publish(tmp_path, transport, 1)
        # the pause fails as soon as the trainer has the request: the update ends with the join unfinished
        engine = _Engine(fail_when=lambda: bool(transport.service.records))
        _update_expecting_a_failed_pause(engine, transport)
        assert "start" not in engine.names() and engine.names()[-1] == "resume"
        record = next(iter(transport.service.records.values()))
        # its own bound would be the push timeout (10 s) + 30 s
        assert record.finished.wait(8.0), record.phase
        assert record.error is not None and record.buckets == 0
        assert not transport._prepared and not transport._posted
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_decode_engine_joins_only_once_every_prefill_engine_is_paused(tmp_path, monkeypatch):
    """The P/D order: the join is an engine utility call (no engine step while it runs), so a decode server
    must not join before every prefill pause returned, or the KV loads prefill's pause waits for stall."""
    transport = _transport(tmp_path, monkeypatch)
    try:
        _publish(tmp_path, transport, 1)
        prefill, decode = _Engine(base_url="http://10.0.0.1:8000"), _Engine(base_url="http://10.0.0.2:8000")
        order = PauseOrder({prefill.base_url}, {decode.base_url})

        async def one(engine):
            try:
                return await update_engine(engine, 1, transport, previous=None, order=order)
            finally:
                order.done(engine.base_url)

        async def both():
            return await asyncio.gather(one(prefill), one(decode))

        updates = asyncio.run(both())
        assert [u.reported_version for u in updates] == [1, 1] and transport.fallbacks == 0
        assert decode.at("init") >= prefill.at("paused") and decode.at("pause") >= prefill.at("paused")
        assert prefill.at("init") < prefill.at("paused")  # prefill's own join still overlaps its pause
        assert prefill.at("resume") >= decode.at("resume")
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)
