"""The push's first half (request, the engine's join of the gloo group and the start of its update session, the
trainer's check) runs alongside the engine's pause, through the one update sequence, with the trainer's real
push service and a stand-in engine that joins and receives over real gloo as rlrun's engine does and keeps
vLLM's worker's session rules (tests/integration/test_push_weights.py has the same against real vLLM). After
the pause the push makes only ``update_weights`` and ``finish_weight_update`` (naming the version), and every
path that opened a session without loading ends it. The stand-in's pause and join run side by side; in vLLM
both go through the engine core's loop one after the other, so what the overlap saves there is measured by
benchmarks/weight_push.py."""

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
    the trainer's group as rank 1, receive the buckets), the session calls keep the rules of vLLM's worker
    (``gpu_worker.Worker``: a start while a session is active, an update or finish outside one are refused; a
    failed update ends the session) and of rlrun's engine (weights are touched from the session's first
    update, which must find the engine paused); the rest records what was called and when."""

    base_url = "http://10.0.0.9:8000"

    def __init__(self, pause_fails: bool = False, base_url: str | None = None, fail_when=None,
                 expected_dtype: str = "float32", pause_s: float = PAUSE_S) -> None:
        self.pause_fails = pause_fails
        self.fail_when = fail_when  # a callable: the pause fails as soon as it returns True
        self.base_url = base_url or self.base_url
        self.expected_dtype, self.pause_s = expected_dtype, pause_s
        self.calls: list[tuple[str, float]] = []
        self.group = None
        self.received: dict[str, torch.Tensor] = {}
        self.version = "default"
        self.paused = False
        self.active = False    # vLLM's worker: a weight-update session is open
        self.touched = False   # a weight was touched in the open session (rlrun's engine: from its first update)

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
        await asyncio.sleep(self.pause_s)
        self._note("paused")
        if self.pause_fails:
            raise EngineError(self.base_url, "pause failed (test)")
        self.paused = True

    async def init_weight_transfer_engine(self, init_info: dict, timeout_s: float) -> None:
        self._note("init")

        def join() -> None:
            store = dist.TCPStore(init_info["master_address"], init_info["master_port"], is_master=False,
                                  timeout=datetime.timedelta(seconds=init_info["timeout_s"]))
            store.set(proto.group_prefix(init_info["group"]) + proto.KEY_EXPECTED + "1",
                      proto.Expected(self.expected_dtype, None).to_json())
            self.group = proto.make_gloo_group(store, init_info["group"], 1, init_info["world_size"],
                                               init_info["timeout_s"], "127.0.0.1")
            self.bucket_bytes = init_info["packed_buffer_size_bytes"]

        await asyncio.to_thread(join)
        self._note("joined")

    async def start_weight_update(self) -> None:
        self._note("start")
        if self.active:
            raise EngineError(self.base_url, "HTTP 500: start_weight_update called while a weight update is "
                                             "already active. Call finish_weight_update first.")
        self.active, self.touched = True, False

    async def update_weights(self, update_info: dict, timeout_s: float) -> None:
        self._note("update")
        if not self.active:
            raise EngineError(self.base_url, "HTTP 500: start_weight_update must be called before update_weights.")
        assert self.paused, "weights touched on an engine that is not paused"
        self.touched = True
        dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
        try:
            await asyncio.to_thread(proto.receive_buckets, self.group, update_info["names"], dtypes,
                                    update_info["shapes"], self.bucket_bytes,
                                    lambda weights: self.received.update({n: t.clone() for n, t in weights}))
        except BaseException:
            self.active = False
            raise

    async def finish_weight_update(self, version=None) -> None:
        self._note("finish" if version is None else f"finish:{version}")
        if not self.active:
            raise EngineError(self.base_url, "HTTP 500: finish_weight_update called without a matching "
                                             "start_weight_update.")
        if self.touched:
            assert self.paused, "weights finalized on an engine that is not paused"
        else:
            self._note("finish-empty")
        self.active = False
        if version is not None:
            self.version = str(version)

    async def update_weight_version(self, version) -> None:
        self._note("version")
        self.version = str(version)

    async def reset_prefix_cache(self) -> bool:
        self._note("reset")
        return True

    async def resume(self) -> None:
        self._note("resume")
        self.paused = False

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
        # after the pause: the load, its finish naming the version (no /update_weight_version), reset, resume
        after = engine.names()[engine.names().index("paused") + 1:]
        assert after == ["update", "finish:1", "reset", "resume"], engine.names()
        # the join, the session's start (it touches no weight) and the trainer's check happened inside the
        # pause; the weights only after it
        assert engine.at("pause") <= engine.at("init") and engine.at("joined") < engine.at("paused")
        assert engine.at("pause") <= engine.at("start") < engine.at("paused")
        assert not engine.active and not transport._sessions
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
        assert "update" not in engine.names() and engine.names()[-1] == "resume"
        # the session started beside the pause was ended (touching no weight), before the resume
        assert engine.names()[-3:] == ["finish", "finish-empty", "resume"] and engine.at("start") < engine.at("paused")
        assert not engine.active and not transport._sessions
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
        assert "update" not in engine.names() and engine.names()[-1] == "resume"
        assert not engine.active and not transport._sessions  # a start sent before the cancel was ended
        if "start" in engine.names():
            assert engine.at("finish") > engine.at("start")
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


def test_the_next_update_after_a_failed_pause_is_not_refused_as_already_active(tmp_path, monkeypatch):
    """The session opened beside the pause and ended by release(): the same engine's next update starts a
    session again and loads (vLLM's worker would refuse a second start while the first is open)."""
    transport = _transport(tmp_path, monkeypatch)
    try:
        state = _publish(tmp_path, transport, 1)
        engine = _Engine(pause_fails=True, pause_s=0.5)
        _update_expecting_a_failed_pause(engine, transport)
        engine.pause_fails = False
        update = asyncio.run(update_engine(engine, 1, transport, previous=None))
        assert update.reported_version == 1 and transport.fallbacks == 0
        assert engine.names().count("start") == 2 and not engine.active
        assert all(torch.equal(engine.received[n], t) for n, t in state.items())
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_refused_check_ends_the_session_without_touching_a_weight(tmp_path, monkeypatch):
    """The trainer refuses the engine's model (dtype): the load fails after the pause, nothing was received,
    and the session started beside the pause is ended (no previous version: the engine stays out of service)."""
    transport = _transport(tmp_path, monkeypatch)
    try:
        _publish(tmp_path, transport, 1)
        engine = _Engine(expected_dtype="bfloat16", pause_s=0.5)
        try:
            asyncio.run(update_engine(engine, 1, transport, previous=None))
        except EngineError as err:
            assert "refused before any tensor was sent" in str(err) and "dtype" in str(err)
        else:
            raise AssertionError("the refused check was not reported")
        assert "start" in engine.names() and "finish-empty" in engine.names() and "update" not in engine.names()
        assert not engine.active and not transport._sessions and engine.version == "default"
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_pause_longer_than_the_trainers_wait_ends_the_first_session_before_joining_again(tmp_path, monkeypatch):
    """The trainer stops waiting for ``go`` before the pause returns (its bound, shortened here): the load joins
    afresh, and the first session is ended first, so the second start is not refused."""
    from rlrun_runtime.weights import push

    monkeypatch.setattr(push, "GO_FAST_S", 0.05)
    monkeypatch.setattr(push, "GO_GRACE_S", 0.2 - 10.0)  # the trainer's wait for go: 10 s push timeout - 9.8 s
    transport = _transport(tmp_path, monkeypatch)
    try:
        state = _publish(tmp_path, transport, 1)
        engine = _Engine(pause_s=1.5)
        update = asyncio.run(update_engine(engine, 1, transport, previous=None))
        assert update.reported_version == 1 and transport.fallbacks == 0
        names = engine.names()
        assert names.count("init") == 2 and names.count("start") == 2, names
        assert names.index("finish-empty") < len(names) - 1 - names[::-1].index("start")  # ended, then started
        assert names[-4:] == ["update", "finish:1", "reset", "resume"]
        assert all(torch.equal(engine.received[n], t) for n, t in state.items())
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_cancelled_update_ends_the_session_it_opened(tmp_path, monkeypatch):
    transport = _transport(tmp_path, monkeypatch)
    try:
        _publish(tmp_path, transport, 1)
        engine = _Engine()

        async def cancel_once_started():
            task = asyncio.ensure_future(update_engine(engine, 1, transport, previous=None))
            while "start" not in engine.names():
                await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.wait({task})
            assert task.cancelled()

        asyncio.run(cancel_once_started())
        # resumed (update_engine's cancel path) and the session ended (release, after it: it touches no weight)
        assert "update" not in engine.names() and "resume" in engine.names()
        assert not engine.active and not transport._sessions and "finish-empty" in engine.names()
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


def test_a_backend_whose_start_touches_weights_starts_only_on_the_paused_engine(tmp_path, monkeypatch):
    """vLLM's NCCL engine starts its layerwise reload in start_weight_update: a push over a backend outside
    ``START_WITH_JOIN`` sends the start after the pause, with the load."""

    class _MovesWeightsAtStart(PushTransport):
        START_WITH_JOIN = frozenset()

    monkeypatch.setenv(constants.ENV_WEIGHT_PUSH_PORT, "0")
    monkeypatch.setenv(constants.ENV_MASTER_ADDR, "127.0.0.1")
    transport = _MovesWeightsAtStart(RunStorage(tmp_path / "storage"), timeout_s=10.0, bucket_bytes=4096)
    try:
        _publish(tmp_path, transport, 1)
        engine = _Engine(pause_s=0.5)
        update = asyncio.run(update_engine(engine, 1, transport, previous=None))
        assert update.reported_version == 1
        after = engine.names()[engine.names().index("paused") + 1:]
        assert after == ["start", "update", "finish:1", "reset", "resume"], engine.names()
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)


class _HeldFinish(_Engine):
    """Its first ``finish_weight_update`` never answers (cancelled from outside); later ones do."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = True

    async def finish_weight_update(self, version=None) -> None:
        if self.hold:
            self.hold = False
            self._note("finish-held")
            await asyncio.Event().wait()
        await super().finish_weight_update(version)


def test_a_session_whose_ending_was_cancelled_is_still_ended_by_release(tmp_path, monkeypatch):
    """The session's entry stays until its finish was answered: an update cancelled while the finish is in
    flight leaves it to release(), so the next update's start is not refused as already active."""
    transport = _transport(tmp_path, monkeypatch)
    try:
        engine = _HeldFinish()
        key = (engine.base_url, 1)

        async def scenario() -> None:
            transport._sessions[key] = asyncio.ensure_future(engine.start_weight_update())
            ending = asyncio.ensure_future(transport._end_session(engine, key))
            while "finish-held" not in engine.names():
                await asyncio.sleep(0.005)
            ending.cancel()
            await asyncio.wait({ending})
            assert engine.active and key in transport._sessions  # not ended: left to release()
            await transport.release(engine, 1)
            assert not engine.active and key not in transport._sessions and "finish-empty" in engine.names()

        asyncio.run(scenario())
    finally:
        transport.close(timeout_s=0.0, grace_s=0.0)
