"""A prefill or decode pod that joins a running P/D run (scale-up or a replaced pod), as in a cluster: the
orchestrator's weight loop finds it through the Service (which publishes not-ready pods), leaves it out while
nothing listens yet, loads the current version into it once it does, and the pod's readiness endpoint (the
real ``ReadinessMiddleware``, the readinessProbe the operator renders) says 503 until then and 200 after.

The engines are stand-ins speaking vLLM's admin API over real HTTP (an ASGI app served by uvicorn, with the
middleware applied the way vLLM applies ``--middleware``); the orchestrator, the update sequence, the
filesystem transport and the serving-version record are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rlrun_api import constants as c
from rlrun_api.spec import apply_defaults
from rlrun_api.views import OrchestratorView
from rlrun_runtime.storage import RunStorage, atomic_directory
from rlrun_runtime.vllm_admin import EngineError
from rlrun_runtime.vllm_plugin import ReadinessMiddleware
from rlrun_runtime.weights.update import (ServingRecord, read_serving_record, read_serving_version,
                                          write_serving_version)
from vllm_role import LOOPBACK, free_port, tiny_rlrun

START_S = 30.0  # a stand-in engine's start, on a loaded machine


class StandInEngine:
    """vLLM's admin API as the orchestrator uses it (records every POST), plus ``state.engine_client`` for the
    readiness middleware; ``broken``: ``GET /weight_info`` answers 500."""

    def __init__(self, port: int, version: str = "default"):
        self.port, self.version, self.broken = port, version, False
        self.hang_health = self.stopping = False  # hang_health: GET /health never answers (a stalled engine)
        self.calls: list[str] = []
        self.fail: set[str] = set()  # POST paths answered with HTTP 500
        self.on_pause: Any = None  # called at each POST /pause, its result kept in self.at_pause
        self.at_pause: list[Any] = []
        # KV hand-offs (POST /v1/completions): a prefill request is answered with kv_transfer_params, a decode
        # one counts a NIXL transfer (GET /metrics); a prefill answer waits while ``hold`` is clear
        self.nixl_transfers = 0
        self.hold = threading.Event()
        self.hold.set()
        self.events: list[tuple[str, str]] = []  # shared between engines by the test: (url, what), in order
        app = Starlette(routes=[Route("/health", self.health), Route("/weight_info", self.weight_info),
                                Route("/metrics", self.metrics),
                                Route("/{path:path}", self.post, methods=["POST"])])
        app.add_middleware(ReadinessMiddleware)
        app.state.engine_client = self
        self.server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> "StandInEngine":
        self.thread.start()
        deadline = time.monotonic() + START_S
        while not self.server.started:
            assert time.monotonic() < deadline, f"stand-in engine on {self.port} not up within {START_S} s"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.stopping = True
        self.server.should_exit = True
        self.thread.join(timeout=START_S)

    # the engine client the middleware asks
    async def check_health(self) -> None:
        return None

    async def get_weight_version(self) -> str:
        return self.version

    # vLLM's routes
    async def health(self, request: Request) -> JSONResponse:
        while self.hang_health and not self.stopping:
            await asyncio.sleep(0.05)
        return JSONResponse({})

    async def weight_info(self, request: Request) -> JSONResponse:
        if self.broken:
            return JSONResponse({"error": "broken"}, status_code=500)
        return JSONResponse({"weight_version": self.version})

    async def metrics(self, request: Request) -> Response:
        return Response(f"{c.VLLM_METRIC_NIXL_TRANSFER_SECONDS}_count {self.nixl_transfers}\n", media_type="text/plain")

    async def completion(self, body: dict[str, Any]) -> JSONResponse:
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # prefill: keep the KV for decode, say where it is
            await asyncio.to_thread(self.hold.wait, START_S)
            self.events.append((self.url, "prefilled"))
            return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.url,
                "remote_block_ids": [0], "remote_host": LOOPBACK, "remote_port": self.port}})
        if params.get("do_remote_prefill"):  # decode: read it over "NIXL"
            self.nixl_transfers += 1
            self.events.append((self.url, "decoded"))
        return JSONResponse({"choices": [{"text": "y"}]})

    async def post(self, request: Request) -> JSONResponse:
        path = "/" + request.path_params["path"]
        self.calls.append(path)
        self.events.append((self.url, path))
        if path == "/v1/completions":
            return await self.completion(json.loads(await request.body()))
        if path == "/pause" and self.on_pause is not None:
            self.at_pause.append(self.on_pause())
        body = await request.body()
        if path in self.fail:
            return JSONResponse({"error": f"{path} failed"}, status_code=500)
        if path == "/update_weight_version":
            self.version = json.loads(body)["new_version"]
        return JSONResponse({"success": True} if path == "/reset_prefix_cache" else {"status": "ok"})

    def ready(self) -> int:
        return httpx.get(f"{self.url}{c.INFERENCE_READY_PATH}", timeout=10).status_code


@pytest.fixture
def engines():
    started: list[StandInEngine] = []

    def start(port: int | None = None, version: str = "default") -> StandInEngine:
        engine = StandInEngine(port or free_port(), version).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def publish(storage: RunStorage, version: int) -> None:
    """A stand-in version: one whole safetensors file (one F32 tensor ``w`` of 2 values)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    with atomic_directory(storage.weights(version)) as tmp:
        (tmp / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))


def pd_orchestrator(storage: RunStorage, endpoints: list[str], prefill: list[str], **kwargs):
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    rlrun = tiny_rlrun()
    rlrun["spec"]["inference"]["disaggregation"] = {"enabled": True, "replicas": 2}
    view = OrchestratorView.from_spec(apply_defaults(rlrun)["spec"])
    return Orchestrator(view, storage, None, None, endpoints, None, OrchestratorMetrics(max_steps=5),
                        prefill_endpoints=prefill, **kwargs)


def test_a_joining_decode_pod_is_loaded_before_it_is_ready(tmp_path, monkeypatch, engines):
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))  # where the middleware reads the record
    storage = RunStorage(tmp_path)
    prefill, decode = engines(), engines()
    joining_port = free_port()  # the new decode pod: published by its Service, vLLM not listening yet
    joining_url = f"http://{LOOPBACK}:{joining_port}"
    addresses = [f"{LOOPBACK}:{e.port}" for e in (prefill, decode)] + [f"{LOOPBACK}:{joining_port}"]
    orchestrator = pd_orchestrator(storage, addresses, addresses[:1])
    assert prefill.ready() == 200  # before the first round nothing is recorded: the initial model serves

    # round 1: the two running servers are named version 0, the starting pod is left out, nothing fails
    asyncio.run(orchestrator.sync_weights_once())
    assert prefill.version == decode.version == "0" and orchestrator.loaded_version == 0
    assert orchestrator.not_listening == {joining_url} and read_serving_version(storage) == 0

    # the trainer publishes version 1: both running servers load it (P/D order), the record follows
    publish(storage, 1)
    asyncio.run(orchestrator.sync_weights_once())
    assert prefill.version == decode.version == "1" and read_serving_version(storage) == 1
    assert "/collective_rpc" in prefill.calls and "/collective_rpc" in decode.calls

    # the pod's vLLM now listens, serving the initial model ("default"): not ready, so the router skips it
    joined = engines(joining_port)
    assert joined.ready() == 503
    prefill.calls.clear(), decode.calls.clear()
    joined.on_pause = orchestrator.weights_stable.is_set
    asyncio.run(orchestrator.sync_weights_once())
    assert joined.version == "1" and joined.ready() == 200  # loaded, then ready
    assert joined.at_pause == [True]  # generation went on through the others while it loaded
    assert joined.calls == ["/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]
    assert prefill.calls == decode.calls == []  # the servers already at version 1 are left alone
    assert orchestrator.not_listening == set() and read_serving_version(storage) == 1

    # a newer version: every server moves, and each stays ready through the round (>= the record)
    publish(storage, 2)
    asyncio.run(orchestrator.sync_weights_once())
    assert {e.version for e in (prefill, decode, joined)} == {"2"} and read_serving_version(storage) == 2
    assert {e.ready() for e in (prefill, decode, joined)} == {200}


def test_a_joined_decode_pod_is_ready_only_after_its_first_kv_handoff_which_no_update_overlaps(tmp_path, monkeypatch,
                                                                                              engines):
    """After the start-up check, a decode pod that joins is loaded, then listed KV-pending (503) until the
    orchestrator's hand-off from the serving prefill server was read over "NIXL"; a weight update that comes
    meanwhile waits for the hand-off (the lock), so no pause lands in its middle."""
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    storage = RunStorage(tmp_path)
    prefill, decode = engines(), engines()
    joining_port = free_port()
    joining_url = f"http://{LOOPBACK}:{joining_port}"
    addresses = [f"{LOOPBACK}:{e.port}" for e in (prefill, decode)] + [f"{LOOPBACK}:{joining_port}"]
    orchestrator = pd_orchestrator(storage, addresses, addresses[:1])
    events: list[tuple[str, str]] = []
    prefill.events = decode.events = events

    async def scenario() -> None:
        await orchestrator.check_kv_handoffs([prefill.url, decode.url])  # start-up: the running pair
        assert decode.nixl_transfers == 1 and orchestrator.kv_checked == {prefill.url, decode.url}
        await orchestrator.sync_weights_once()  # version 0 named; the pod still starting is left out
        publish(storage, 1)
        await orchestrator.sync_weights_once()
        assert prefill.version == decode.version == "1"

        joined = engines(joining_port)
        joined.events = events
        prefill.hold.clear()  # the joiner's hand-off waits in prefill until released
        joining = len(events)
        await orchestrator.sync_weights_once()
        assert joined.version == "1" and orchestrator.kv_pending == {joining_url}
        assert read_serving_record(storage).kv_pending == (joining_url,)
        response = await asyncio.to_thread(httpx.get, f"{joined.url}{c.INFERENCE_READY_PATH}", timeout=10)
        assert response.status_code == 503 and "KV hand-off" in response.json()["reason"]
        assert prefill.ready() == decode.ready() == 200  # the serving pods stay ready

        deadline = time.monotonic() + START_S  # the hand-off reached prefill
        while (prefill.url, "/v1/completions") not in events[joining:]:
            assert time.monotonic() < deadline, events
            await asyncio.sleep(0.02)
        publish(storage, 2)
        mark = len(events)
        update = asyncio.create_task(orchestrator.sync_weights_once())  # must wait for the hand-off
        deadline = time.monotonic() + START_S  # until it waits on the lock (or, wrongly, pauses an engine)
        lock = orchestrator._handoff_lock()  # noqa: SLF001 - what the update must wait on
        while not lock._waiters and not [e for e in events[mark:] if e[1] == "/pause"]:  # noqa: SLF001
            assert time.monotonic() < deadline and not update.done(), events
            await asyncio.sleep(0.02)
        assert lock._waiters and not update.done()  # noqa: SLF001 - held back by the hand-off in flight
        prefill.hold.set()
        assert await asyncio.wait_for(update, START_S)
        await asyncio.wait_for(orchestrator.wait_kv_checks(), START_S)
        assert joined.nixl_transfers == 1 and orchestrator.kv_pending == set()
        assert orchestrator.kv_checked == {prefill.url, decode.url, joined.url}
        assert read_serving_record(storage).kv_pending == () and read_serving_version(storage) == 2
        decoded = events.index((joined.url, "decoded"))
        sent = max(i for i, event in enumerate(events[:decoded]) if event == (prefill.url, "/v1/completions"))
        assert not [e for e in events[sent:decoded] if e[1] == "/pause"], events[sent:]  # no pause inside
        assert [e for e in events[decoded:] if e[1] == "/pause"]  # the update came after it
        assert {e.version for e in (prefill, decode, joined)} == {"2"}

    asyncio.run(scenario())
    assert {e.ready() for e in (prefill, decode)} == {200}
    assert httpx.get(f"http://{LOOPBACK}:{joining_port}{c.INFERENCE_READY_PATH}", timeout=10).status_code == 200


def test_a_joiner_whose_first_load_fails_is_checked_once_a_later_round_loads_it(tmp_path, monkeypatch, engines):
    """The joiner is KV-pending from before its load; its first load fails (and its restore: it is left out of
    service), a later round loads it, and its KV check still happens then: it does not stay pending forever."""
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    storage = RunStorage(tmp_path)
    prefill, decode = engines(), engines()
    joining_port = free_port()
    addresses = [f"{LOOPBACK}:{e.port}" for e in (prefill, decode)] + [f"{LOOPBACK}:{joining_port}"]
    orchestrator = pd_orchestrator(storage, addresses, addresses[:1])

    async def scenario() -> None:
        await orchestrator.check_kv_handoffs([prefill.url, decode.url])
        await orchestrator.sync_weights_once()
        publish(storage, 1)
        await orchestrator.sync_weights_once()
        joined = engines(joining_port)
        joined.fail = {"/collective_rpc"}  # its load (and the restore) fail
        with pytest.raises(EngineError):
            await orchestrator.sync_weights_once()
        assert orchestrator.kv_pending == {joined.url} and joined.nixl_transfers == 0
        assert read_serving_record(storage).kv_pending == (joined.url,)
        joined.fail = set()
        assert await orchestrator.sync_weights_once()
        await asyncio.wait_for(orchestrator.wait_kv_checks(), START_S)
        assert joined.version == "1" and joined.nixl_transfers == 1 and orchestrator.kv_pending == set()
        assert read_serving_record(storage) == ServingRecord(1, (), ())

    asyncio.run(scenario())
    assert httpx.get(f"http://{LOOPBACK}:{joining_port}{c.INFERENCE_READY_PATH}", timeout=10).status_code == 200


def test_a_restarted_orchestrator_keeps_the_recorded_version_while_it_loads_a_joiner(tmp_path, monkeypatch, engines):
    """A new orchestrator process (no record of its own yet) marks a joiner KV-pending before loading it: the
    record it writes then keeps the version the pods are ready against, never 0 (a pod serving the initial
    model would pass as ready)."""
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    storage = RunStorage(tmp_path)
    prefill, decode = engines(version="1"), engines(version="1")
    publish(storage, 1)
    write_serving_version(storage, 1)  # the previous orchestrator's record
    joining_port = free_port()
    addresses = [f"{LOOPBACK}:{e.port}" for e in (prefill, decode)] + [f"{LOOPBACK}:{joining_port}"]
    orchestrator = pd_orchestrator(storage, addresses, addresses[:1])
    joined = engines(joining_port)
    seen: list[Any] = []
    joined.on_pause = lambda: read_serving_record(storage)  # the record while the joiner loads

    async def scenario() -> None:
        await orchestrator.check_kv_handoffs([prefill.url, decode.url])
        assert await orchestrator.sync_weights_once()
        await asyncio.wait_for(orchestrator.wait_kv_checks(), START_S)

    asyncio.run(scenario())
    seen = joined.at_pause
    assert seen == [ServingRecord(1, (), (joined.url,))]
    assert joined.version == "1" and joined.nixl_transfers == 1 and read_serving_record(storage) == ServingRecord(1)


def test_which_engines_count_as_joiners(tmp_path):
    """Never checked: a joiner; checked and serving the initial model again after the run served a later
    version (a container restarted at the same address): a joiner again; pending or out of service: not."""
    p, d, j, r, x = (f"http://{LOOPBACK}:{port}" for port in (1, 2, 3, 4, 5))
    orchestrator = pd_orchestrator(RunStorage(tmp_path), [f"{LOOPBACK}:1"], [f"{LOOPBACK}:1"])
    assert orchestrator._joiners([p, d, j], [1, 1, None], [j]) == []  # noqa: SLF001 - before the start-up check
    orchestrator.kv_checked, orchestrator.loaded_version = {p, d, r, x}, 3
    orchestrator.kv_pending, orchestrator.out_of_service = set(), {x}
    engines_, versions = [p, d, j, r, x], [3, 3, None, None, 2]
    assert orchestrator._joiners(engines_, versions, [j, r, x]) == [j, r]  # noqa: SLF001
    assert orchestrator.kv_checked == {p, d, x}
    orchestrator.kv_pending = {j}
    assert orchestrator._joiners(engines_, versions, [j, r]) == [r]  # noqa: SLF001


def test_an_engine_left_paused_by_a_failed_update_is_not_ready_until_a_later_round_resumes_it(tmp_path, monkeypatch,
                                                                                           engines):
    """A decode engine whose load and restore fail is left paused (out of service): the record names it, so its
    readiness turns the router away from it (it would hold every request) while prefill, already at the new
    version, stays ready; the next round updates and resumes it, and it is ready again."""
    monkeypatch.setenv(c.ENV_STORAGE_DIR, str(tmp_path))
    storage = RunStorage(tmp_path)
    prefill, decode = engines(), engines()
    orchestrator = pd_orchestrator(storage, [f"{LOOPBACK}:{e.port}" for e in (prefill, decode)],
                                   [f"{LOOPBACK}:{prefill.port}"])
    asyncio.run(orchestrator.sync_weights_once())  # version 0 named
    publish(storage, 1)
    asyncio.run(orchestrator.sync_weights_once())
    assert (prefill.version, decode.version) == ("1", "1") and read_serving_record(storage).out_of_service == ()

    publish(storage, 2)
    decode.fail = {"/collective_rpc"}  # the load of version 2 and the restore of version 1 both fail
    with pytest.raises(EngineError) as failed:
        asyncio.run(orchestrator.sync_weights_once())
    assert failed.value.out_of_service == (decode.url,) and orchestrator.out_of_service == {decode.url}
    record = read_serving_record(storage)
    assert record is not None and record.version == 1
    assert record.out_of_service == (decode.url,)
    assert (prefill.version, prefill.ready()) == ("2", 200)
    response = httpx.get(f"{decode.url}{c.INFERENCE_READY_PATH}", timeout=10)
    assert response.status_code == 503 and "out of service" in response.json()["reason"]

    decode.fail = set()
    asyncio.run(orchestrator.sync_weights_once())
    assert decode.version == "2" and decode.calls[-1] == "/resume" and orchestrator.out_of_service == set()
    assert read_serving_record(storage).version == 2 and read_serving_record(storage).out_of_service == ()
    assert decode.ready() == prefill.ready() == 200


def test_an_engine_that_listens_but_fails_still_fails_the_round(tmp_path, engines):
    storage = RunStorage(tmp_path)
    good, broken = engines(), engines()
    broken.broken = True
    orchestrator = pd_orchestrator(storage, [f"{LOOPBACK}:{e.port}" for e in (good, broken)], [f"{LOOPBACK}:{good.port}"])
    with pytest.raises(EngineError, match="HTTP 500"):
        asyncio.run(orchestrator.sync_weights_once())
    assert read_serving_version(storage) is None and orchestrator.not_listening == set()


def test_when_no_engine_listens_the_round_fails(tmp_path):
    storage = RunStorage(tmp_path)
    orchestrator = pd_orchestrator(storage, [f"{LOOPBACK}:{free_port()}", f"{LOOPBACK}:{free_port()}"], [])
    with pytest.raises(EngineError):
        asyncio.run(orchestrator.sync_weights_once())
    assert read_serving_version(storage) is None


def test_the_watchdog_reports_a_stalled_engine_but_not_a_pod_still_starting(tmp_path, engines, caplog):
    """Both are watched from the same moment with the same bound: the stalled one (accepts connections, never
    answers /health) is reported, the starting one (nothing listens) is not, then or later."""
    storage = RunStorage(tmp_path)
    stalled = engines()
    starting_port = free_port()
    starting_url = f"http://{LOOPBACK}:{starting_port}"
    orchestrator = pd_orchestrator(storage, [f"{LOOPBACK}:{stalled.port}", f"{LOOPBACK}:{starting_port}"], [],
                                   stall_after_s=0.5, watchdog_poll_s=0.05)

    async def scenario():
        await orchestrator.sync_weights_once()
        assert orchestrator.not_listening == {starting_url}
        stalled.hang_health = True
        watchdog = asyncio.create_task(orchestrator.watchdog_loop())
        try:
            deadline = time.monotonic() + 30
            while stalled.url not in orchestrator.stalled:
                assert time.monotonic() < deadline, "the stalled engine was never reported"
                await asyncio.sleep(0.02)
            assert starting_url not in orchestrator.stalled
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    with caplog.at_level("WARNING", logger="rlrun.orchestrator"):
        asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]
    assert warned and all(m.startswith(f"engine {stalled.url} has") for m in warned)


def test_startup_waits_for_one_engine_per_service_not_for_a_pod_that_never_listens(tmp_path, monkeypatch, engines):
    """A decode Service that publishes a crash-looping pod (nothing ever listens) does not hold the run's start
    once another decode pod is healthy; a Service whose only pod does not listen yet does."""
    from rlrun_runtime import orchestrator as orchestrator_module

    storage = RunStorage(tmp_path)
    prefill, decode = engines(), engines()
    dead = f"http://{LOOPBACK}:{free_port()}"
    services = {"prefill:8000": [prefill.url], "decode:8000": [decode.url, dead], "empty:8000": [dead]}
    monkeypatch.setattr(orchestrator_module, "resolve_engines", lambda items: sorted(
        url for item in items for url in services[item]))
    orch = pd_orchestrator(storage, ["prefill:8000", "decode:8000"], ["prefill:8000"], health_timeout_s=20)
    started = time.monotonic()
    assert asyncio.run(orch.wait_healthy(router=False)) == [prefill.url, decode.url]
    assert time.monotonic() - started < 10
    waiting = pd_orchestrator(storage, ["prefill:8000", "empty:8000"], ["prefill:8000"], health_timeout_s=2)
    with pytest.raises(orchestrator_module.OrchestratorError, match=f"engine {dead} not listening yet"):
        asyncio.run(waiting.wait_healthy(router=False))
