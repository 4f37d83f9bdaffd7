"""The vLLM admin client: retries, timeouts and errors against a scripted HTTP server; the same calls against
real vLLM are in tests/integration/test_vllm_admin_real.py."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time

import pytest

from rlrun_runtime.storage import RunStorage
from rlrun_runtime.vllm_admin import EngineError, VLLMAdmin, parse_version, resolve_engines
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
        assert handler.calls == ["/pause?mode=keep"] * 3

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


def test_failed_reload_still_resumes_and_names_the_engine(scripted_server, tmp_path):
    handler, url = scripted_server
    handler.script[:] = [200, 500]  # pause ok, reload fails (retries=0), then resume ok

    async def body():
        with pytest.raises(EngineError, match="/collective_rpc") as caught:
            storage = RunStorage(tmp_path)
            storage.weights(4).mkdir(parents=True)
            await update_engines([url], 4, FilesystemTransport(storage), retries=0)
        assert url in str(caught.value)

    asyncio.run(body())
    assert handler.calls == ["/pause?mode=keep", "/collective_rpc", "/resume"]


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
