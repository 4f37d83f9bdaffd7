"""The vLLM admin client: retries, timeouts and errors against a scripted HTTP server; the same calls against
real vLLM are in tests/integration/test_vllm_admin_real.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import pytest

from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import EngineError, EngineOutOfService, VLLMAdmin, parse_version, resolve_engines
from rlrun_runtime.weights.filesystem import FilesystemTransport
from rlrun_runtime.weights.update import update_engines
from vllm_role import LOOPBACK


@pytest.mark.parametrize("text,version", [("7", 7), ("0", 0), ("default", None), ("", None), ("-1", None),
                                          (" 12 ", 12)])
def test_parse_version(text, version):
    assert parse_version(text) == version


def test_resolve_engines_resolves_names_and_deduplicates():
    urls = resolve_engines("localhost:8000,127.0.0.1:8000, 127.0.0.1:8001")
    assert {"http://127.0.0.1:8000", "http://127.0.0.1:8001"} <= set(urls)
    assert len(urls) == len(set(urls)) and urls == sorted(urls)
    assert resolve_engines(["127.0.0.1:9", "127.0.0.1:9"]) == ["http://127.0.0.1:9"]
    assert resolve_engines("") == []


@pytest.mark.parametrize("bad", ["localhost", "localhost:http", ":80"])
def test_resolve_engines_rejects_non_host_port(bad):
    with pytest.raises(ValueError, match="host:port"):
        resolve_engines(bad)


class ScriptedHandler(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next status of ``script`` (then 200), sleeping ``delay_s`` first."""

    script: list[int] = []
    calls: list[str] = []
    delay_s = 0.0

    def do_POST(self):  # noqa: N802 (http.server naming)
        type(self).calls.append(self.path)
        time.sleep(self.delay_s)
        status = type(self).script.pop(0) if type(self).script else 200
        body = b'{"status": "ok"}' if status == 200 else b'{"error": "scripted"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted_server():
    handler = type("Handler", (ScriptedHandler,), {"script": [], "calls": [], "delay_s": 0.0})
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://{LOOPBACK}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_5xx_is_retried_with_backoff(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.script[:] = [503, 500]
        started = time.monotonic()
        async with VLLMAdmin(url, retries=3, backoff_s=0.05) as admin:
            await admin.resume()
        assert handler.calls == ["/resume"] * 3
        assert time.monotonic() - started >= 0.05 + 0.1  # backoff 0.05 then 0.1

    asyncio.run(body())


def test_retries_are_bounded_and_the_error_names_the_engine(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.script[:] = [503] * 10
        async with VLLMAdmin(url, retries=2, backoff_s=0.01) as admin:
            with pytest.raises(EngineError, match="HTTP 503") as caught:
                await admin.pause()
        assert caught.value.engine == url and url in str(caught.value)
        assert handler.calls == ["/pause?mode=keep&clear_cache=false"] * 3

    asyncio.run(body())


def test_4xx_is_not_retried(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.script[:] = [400]
        async with VLLMAdmin(url, retries=3, backoff_s=0.01) as admin:
            with pytest.raises(EngineError, match="HTTP 400"):
                await admin.update_weight_version(3)
        assert handler.calls == ["/update_weight_version"]

    asyncio.run(body())


def test_timeout_counts_as_a_failed_attempt(scripted_server):
    async def body():
        handler, url = scripted_server
        handler.delay_s = 0.5
        async with VLLMAdmin(url, timeout_s=0.1, retries=1, backoff_s=0.01) as admin:
            with pytest.raises(EngineError, match="Timeout"):
                await admin.resume()
        assert len(handler.calls) == 2

    asyncio.run(body())


def test_unreachable_engine_fails_fast_with_its_name():
    async def body():
        url = f"http://{LOOPBACK}:9"  # discard port: nothing listens
        async with VLLMAdmin(url, retries=1, backoff_s=0.01) as admin:
            assert await admin.health() is False
            with pytest.raises(EngineError, match="ConnectError") as caught:
                await admin.weight_info()
        assert caught.value.engine == url

    asyncio.run(body())


def test_missing_weights_directory_pauses_nothing(scripted_server, tmp_path):
    handler, url = scripted_server
    with pytest.raises(ValueError, match="not a directory"):
        asyncio.run(update_engines([url], 4, FilesystemTransport(RunStorage(tmp_path))))
    assert handler.calls == []


def test_reload_that_times_out_is_never_sent_twice(scripted_server, tmp_path):
    async def body():
        handler, url = scripted_server
        handler.delay_s = 0.5
        async with VLLMAdmin(url, timeout_s=0.1, retries=3, backoff_s=0.01) as admin:
            # the reload has its own long timeout; make it short here through httpx's per-request option
            with pytest.raises(EngineError, match="ReadTimeout"):
                await admin._call("POST", "/collective_rpc", timeout=0.1, retry_on_timeout=False, json={})
        assert handler.calls == ["/collective_rpc"]

    asyncio.run(body())


# --- every step of the update failing in turn (issue 11 section 2, items 1 and 2) -------------------------

PAUSE = "/pause?mode=keep&clear_cache=false"


def write_version(storage: RunStorage, version: int, values: int = 2) -> None:
    """A whole safetensors directory for ``version``: one F32 tensor ``w`` of ``values`` values."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [values], "data_offsets": [0, 4 * values]}}).encode()
    storage.weights(version).mkdir(parents=True, exist_ok=True)
    (storage.weights(version) / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                                                 + bytes(4 * values))


class StandInEngine(http.server.BaseHTTPRequestHandler):
    """vLLM's admin API with a pause state; ``failures`` maps a call to "500" or "timeout" (the reply is held
    until ``release`` is set, longer than the client's timeout). A call is ``/path`` or, for a reload,
    ``/collective_rpc:<weights_path>``; a failed pause or resume does not change the pause state."""

    failures: dict[str, str] = {}
    calls: list[str] = []
    paused = False
    version = "3"
    release: threading.Event

    def do_GET(self):  # noqa: N802
        self._reply(200, {"weight_version": type(self).version} if self.path == "/weight_info"
                    else {"is_paused": type(self).paused})

    def do_POST(self):  # noqa: N802
        cls = type(self)
        length = int(self.headers.get("content-length") or 0)
        payload = json.loads(self.rfile.read(length)) if length else {}
        call = self.path.split("?")[0]
        if call == "/collective_rpc":
            call += ":" + payload["kwargs"]["weights_path"]
        cls.calls.append(call)
        failure = cls.failures.get(call)
        if failure == "timeout":
            cls.release.wait(30)
        if failure is not None:
            self._reply(500, {"error": "stand-in failure"})
            return
        if call == "/pause":
            cls.paused = True
        elif call == "/resume":
            cls.paused = False
        elif call == "/update_weight_version":
            cls.version = payload["new_version"]
        self._reply(200, {"success": True} if call == "/reset_prefix_cache" else {"status": "ok"})

    def _reply(self, status, payload):
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the client gave up (timeout)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    release = threading.Event()
    handler = type("Engine", (StandInEngine,), {"failures": {}, "calls": [], "paused": False, "version": "3",
                                                 "release": release})
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://{LOOPBACK}:{server.server_address[1]}"
    release.set()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("failures,previous,expected_calls,out_of_service,match", [
    # a failed pause (HTTP 500 or no answer): resume is still sent, nothing is loaded
    ({"/pause": "500"}, 3, ["/pause", "/resume"], False, "HTTP 500"),
    ({"/pause": "timeout"}, 3, ["/pause", "/resume"], False, "ReadTimeout"),
    # a failed load: the previous version is loaded again and named before resume
    ({"/collective_rpc:NEW": "500"}, 3, ["/pause", "/collective_rpc:NEW", "/collective_rpc:OLD",
                                           "/update_weight_version", "/resume"], False, "version 3 was restored"),
    # ... and if that fails too (or nothing is known to restore), the engine stays paused: out of service
    ({"/collective_rpc:NEW": "500", "/collective_rpc:OLD": "500"}, 3,
     ["/pause", "/collective_rpc:NEW", "/collective_rpc:OLD"], True, "restoring version 3 failed"),
    ({"/collective_rpc:NEW": "500"}, None, ["/pause", "/collective_rpc:NEW"], True, "no previous version"),
    # version, prefix-cache reset: the new weights are in, resume
    ({"/update_weight_version": "500"}, 3, ["/pause", "/collective_rpc:NEW", "/update_weight_version", "/resume"],
     False, "/update_weight_version"),
    ({"/reset_prefix_cache": "timeout"}, 3, ["/pause", "/collective_rpc:NEW", "/update_weight_version",
                                              "/reset_prefix_cache", "/resume"], False, "/reset_prefix_cache"),
    # resume itself failing: reported out of service (it may still be paused)
    ({"/resume": "500"}, 3, ["/pause", "/collective_rpc:NEW", "/update_weight_version", "/reset_prefix_cache",
                             "/resume"], True, "resume failed"),
    ({"/resume": "timeout"}, 3, ["/pause", "/collective_rpc:NEW", "/update_weight_version", "/reset_prefix_cache",
                                 "/resume"], True, "resume failed"),
])
def test_every_failing_step_leaves_the_engine_resumed_or_out_of_service(stand_in, tmp_path, failures, previous,
                                                                        expected_calls, out_of_service, match):
    handler, url = stand_in
    storage = RunStorage(tmp_path)
    write_version(storage, 3)
    write_version(storage, 4)
    names = {"NEW": str(storage.weights(4)), "OLD": str(storage.weights(3))}

    def named(call: str) -> str:
        return call.replace(":NEW", ":" + names["NEW"]).replace(":OLD", ":" + names["OLD"])

    handler.failures.update({named(call): how for call, how in failures.items()})
    with pytest.raises(EngineError, match=match) as caught:
        asyncio.run(update_engines([url], 4, FilesystemTransport(storage), previous=previous, timeout_s=1.0,
                                   retries=0))
    assert handler.calls == [named(c) for c in expected_calls]
    assert caught.value.engine == url and url in str(caught.value)
    if out_of_service:
        assert isinstance(caught.value, EngineOutOfService) and caught.value.out_of_service == (url,)
        if "/resume" not in expected_calls:
            assert handler.paused is True  # never resumed into weights that are unknown
    else:
        assert not isinstance(caught.value, EngineOutOfService) and caught.value.out_of_service == ()
        assert handler.paused is False
    if "restored" in match:
        assert handler.version == "3"


def test_an_engine_left_out_of_service_is_named_among_several(stand_in, tmp_path):
    """Two engines, one whose load and restore fail: the other is updated; the error lists the paused one."""
    handler, url = stand_in
    other = type("Other", (StandInEngine,), {"failures": {}, "calls": [], "paused": False, "version": "3",
                                             "release": handler.release})
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    other_url = f"http://{LOOPBACK}:{server.server_address[1]}"
    try:
        storage = RunStorage(tmp_path)
        write_version(storage, 3)
        write_version(storage, 4)
        handler.failures.update({f"/collective_rpc:{storage.weights(4)}": "500",
                                 f"/collective_rpc:{storage.weights(3)}": "500"})
        other.failures.update({"/update_weight_version": "500"})
        with pytest.raises(EngineError, match="2 engines failed") as caught:
            asyncio.run(update_engines([url, other_url], 4, FilesystemTransport(storage), previous=3, retries=0))
        assert caught.value.out_of_service == (url,)
        assert handler.paused is True and other.paused is False
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("damage,match", [
    ("truncate", "truncated"),
    ("empty", "no \\*.safetensors file"),
    ("shape", "shape\\(s\\) differ"),
])
def test_a_damaged_or_mismatched_version_pauses_nothing(stand_in, tmp_path, damage, match):
    handler, url = stand_in
    storage = RunStorage(tmp_path)
    write_version(storage, 3)
    if damage == "shape":
        write_version(storage, 4, values=3)
    else:
        write_version(storage, 4)
        weights = storage.weights(4) / "model.safetensors"
        if damage == "truncate":
            weights.write_bytes(weights.read_bytes()[:-1])
        else:
            weights.unlink()
    with pytest.raises(ValueError, match=match):
        asyncio.run(update_engines([url], 4, FilesystemTransport(storage), previous=3))
    assert handler.calls == [] and handler.paused is False


# --- prefill/decode ordering (issue 7 section 1) ------------------------------------------------------------

def start_engine(name: str, timeline: list[tuple[str, str]], release: threading.Event,
                 slow: dict[str, float] | None = None) -> tuple[type, str, http.server.ThreadingHTTPServer]:
    """A stand-in engine that also logs (name, call) into ``timeline``; ``slow`` holds a call for seconds
    before answering (a decode pause waiting for its pending KV loads)."""

    class Logged(StandInEngine):
        def do_POST(self):  # noqa: N802
            call = self.path.split("?")[0]
            time.sleep((slow or {}).get(call, 0.0))
            timeline.append((name, call))
            super().do_POST()

    handler = type(name, (Logged,), {"failures": {}, "calls": [], "paused": False, "version": "3",
                                     "release": release})
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return handler, f"http://{LOOPBACK}:{server.server_address[1]}", server


@pytest.mark.parametrize("failing", [None, "decode-load", "prefill-pause"])
def test_pd_update_pauses_prefill_first_and_resumes_decode_first(tmp_path, failing):
    """Prefill's pause (slow: it waits until decode has read the KV it holds) returns before decode is paused;
    decode resumes before prefill. A failing engine does not hold the other one up."""
    storage = RunStorage(tmp_path)
    write_version(storage, 3)
    write_version(storage, 4)
    timeline: list[tuple[str, str]] = []
    release = threading.Event()
    prefill, prefill_url, prefill_server = start_engine("prefill", timeline, release, slow={"/pause": 0.5})
    decode, decode_url, decode_server = start_engine("decode", timeline, release)
    if failing == "decode-load":  # load and restore fail: decode is left paused, prefill must still resume
        decode.failures.update({f"/collective_rpc:{storage.weights(4)}": "500",
                                f"/collective_rpc:{storage.weights(3)}": "500"})
    elif failing == "prefill-pause":
        prefill.failures.update({"/pause": "500"})
    try:
        run = update_engines([decode_url, prefill_url], 4, FilesystemTransport(storage), previous=3,
                             prefill=[prefill_url], timeout_s=5.0, retries=0)
        if failing is None:
            updates = asyncio.run(run)
            assert {u.engine: u.reported_version for u in updates} == {decode_url: 4, prefill_url: 4}
        else:
            with pytest.raises(EngineError):
                asyncio.run(run)
    finally:
        release.set()
        for server in (prefill_server, decode_server):
            server.shutdown()
            server.server_close()
    order = [entry for entry in timeline if entry[1] in ("/pause", "/resume")]
    # (a failed prefill pause too is over before decode pauses)
    assert order.index(("prefill", "/pause")) < order.index(("decode", "/pause"))
    if failing == "decode-load":
        assert ("decode", "/resume") not in order and decode.paused is True
        assert prefill.paused is False
    else:
        assert order.index(("decode", "/resume")) < order.index(("prefill", "/resume"))
        assert prefill.paused is False and decode.paused is False
