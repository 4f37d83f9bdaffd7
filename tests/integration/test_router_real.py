"""The router's rendered probe paths against the real vllm-router (a stand-in worker behind it)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from rlrun_api.spec import apply_defaults
from rlrun_operator.render import render

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
UID = "6f1c2a4e-0000-4000-8000-000000000001"


def _router_deployment() -> dict:
    """The tiny example's rendered router Deployment."""
    rlrun = yaml.safe_load((EXAMPLES / "rlrun-tiny.yaml").read_text())
    rlrun["metadata"].update(namespace="default", uid=UID)
    name = rlrun["metadata"]["name"] + "-router"
    return next(o for o in render(apply_defaults(rlrun)) if o["kind"] == "Deployment" and o["metadata"]["name"] == name)


class _Worker(http.server.BaseHTTPRequestHandler):
    """Stands in for a vLLM server: 200 with an empty JSON object on every GET (/health included)."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


@pytest.mark.router
@pytest.mark.timeout(90)
def test_router_probe_paths_behave_as_rendered_with_the_real_vllm_router():
    """Liveness (/liveness) stays 200 when the only worker dies; readiness (/readiness) turns 503."""
    probes = _router_deployment()["spec"]["template"]["spec"]["containers"][0]
    live, ready = probes["livenessProbe"]["httpGet"]["path"], probes["readinessProbe"]["httpGet"]["path"]
    worker = http.server.HTTPServer(("127.0.0.1", 0), _Worker)
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    port, metrics_port = _free_port(), _free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
         "--worker-urls", f"http://127.0.0.1:{worker.server_address[1]}",
         "--health-check-interval-secs", "1", "--health-failure-threshold", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert _wait_for(lambda: _status(base + ready) == 200, 40), "router never became ready"
        assert _status(base + live) == 200
        worker.shutdown()
        worker.server_close()
        assert _wait_for(lambda: _status(base + ready) == 503, 30), "readiness ignored the dead worker"
        assert _status(base + "/health") == 503  # why /health is not the liveness check
        assert _status(base + live) == 200
    finally:
        router.terminate()
        try:
            router.wait(timeout=10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
        if thread.is_alive():
            worker.shutdown()
