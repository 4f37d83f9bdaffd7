"""The KV hand-off check (runtime/rlrun_runtime/kv_handoff.py): its request bodies, its verdict, and its errors
against a real HTTP server that answers like a server without a KV connector."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Any, Iterator

import pytest

from rlrun_api import constants as c
from rlrun_runtime.kv_handoff import (Handoff, HandoffError, get_decode_body, get_handoff_pairs, get_joined_pairs,
                                      get_prefill_body, send_handoff)


def _as_vllm_parses_it(body: dict[str, Any]) -> Any:
    """The body through vLLM 0.32's own request model (a renamed or misspelt field fails here)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest.model_validate(body)
    assert not (set(body) - set(CompletionRequest.model_fields)), "fields vLLM would ignore"
    return request


def test_the_prefill_request_keeps_its_kv_for_a_remote_decode() -> None:
    body = get_prefill_body("salt-1")
    request = _as_vllm_parses_it(body)
    assert request.kv_transfer_params["do_remote_decode"] is True and request.max_tokens == 1
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert body["kv_transfer_params"]["do_remote_prefill"] is False
    assert (body["max_tokens"], body["cache_salt"], body["model"]) == (1, "salt-1", c.SERVED_MODEL_NAME)


def test_the_decode_request_carries_what_prefill_answered_with_the_same_prompt_and_salt() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]],
              "remote_host": "127.0.0.1", "remote_port": 5600}
    prefill, decode = get_prefill_body("s"), get_decode_body("s", params)
    assert _as_vllm_parses_it(decode).kv_transfer_params == params
    assert decode["kv_transfer_params"] == params
    assert (decode["prompt"], decode["cache_salt"]) == (prefill["prompt"], prefill["cache_salt"])


@pytest.mark.parametrize(("transfers", "failed", "ok"), [
    (1, 0, True), (2, 0, True),
    (0, 0, False),  # decode recomputed the prompt (a refused read is recomputed, not counted)
    (0, 1, False),  # the read failed: recomputed
    (1, 1, True),   # read, while another request's read failed on the same (serving) decode server
])
def test_a_handoff_counts_only_when_decode_read_the_kv_over_nixl(transfers: float, failed: float, ok: bool) -> None:
    assert Handoff("p", "d", 0.5, transfers, failed).ok is ok


class _NoConnector(http.server.BaseHTTPRequestHandler):
    """Answers like a vLLM server without a KV connector: completions carry no kv_transfer_params."""

    def do_GET(self) -> None:  # /metrics, with no NIXL samples
        self._answer(200, b"# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n"
                          b"vllm:num_requests_waiting 0.0\n", "text/plain")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(200, json.dumps({"choices": [{"text": "x"}]}).encode(), "application/json")

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def no_connector() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoConnector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_prefill_server_without_a_kv_connector_is_named(no_connector: str) -> None:
    with pytest.raises(HandoffError, match="without kv_transfer_params"):
        send_handoff(no_connector, no_connector, timeout_s=10)


class _Silent(_NoConnector):
    """Accepts completions and never answers them (a prefill server stuck behind a pause)."""

    def do_POST(self) -> None:
        time.sleep(3)


def test_a_server_that_does_not_answer_is_an_error_after_the_timeout_not_a_hang() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(HandoffError, match="timed out"):
            send_handoff(url, url, timeout_s=0.5)
    finally:
        server.shutdown()
        server.server_close()
    assert time.monotonic() - started < 2.5  # the request's timeout, not the server's 3 s


def test_a_decode_server_that_refuses_connections_is_named(no_connector: str) -> None:
    with socket.socket() as probe:  # a port nothing listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
        with pytest.raises(HandoffError, match=f"{closed}/metrics"):
            send_handoff(no_connector, closed, timeout_s=10)


def test_every_prefill_engine_hands_off_to_every_decode_engine() -> None:
    engines = ["http://d1", "http://p0", "http://d0", "http://p1", "http://d0"]
    assert get_handoff_pairs(["http://p1", "http://p0"], engines) == [
        ("http://p0", "http://d0"), ("http://p0", "http://d1"), ("http://p1", "http://d0"), ("http://p1", "http://d1")]
    assert get_handoff_pairs([], engines) == []
    assert get_handoff_pairs(["http://p0"], ["http://p0"]) == []  # no decode engine yet: nothing to check


@pytest.mark.parametrize("joined, prefill, serving, pairs", [
    ("d9", ["p0", "p1"], ["p0", "p1", "d0"], [("p0", "d9"), ("p1", "d9")]),   # a decode joiner: every prefill
    ("p9", ["p0", "p9"], ["p0", "d0", "d1"], [("p9", "d0"), ("p9", "d1")]),   # a prefill joiner: every decode
    ("d9", ["p0"], ["d0", "d9"], []),                                         # no serving prefill: nothing
    ("p9", ["p9"], ["p9"], []),                                               # itself only
])
def test_a_joined_server_is_paired_with_the_checked_servers_of_the_other_pool(joined, prefill, serving, pairs):
    assert get_joined_pairs(joined, prefill, serving) == pairs
