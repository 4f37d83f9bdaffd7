"""Autoscaling in `rlrun local` with real vLLM P/D on CPU: a decode server joins, loads the current weight
version before the router gets it, takes traffic through the router with its KV handed over by prefill (NIXL
transfers counted on it, none failed, no handshake mismatch; its readiness endpoint follows the recorded
serving version), then leaves through the router first.

What runs: the tiny run's prefill (kv_producer) and decode (kv_consumer) servers and its router, as
`rlrun local` plans them with autoscaling on (``get_scalable_plan``), under the real Supervisor; the
orchestrator and trainer are left out, so the test publishes weight version 1 itself and loads it into the
first two servers with the one update sequence (``weights.update.update_engines``, P/D order), as the
orchestrator does. The scaler (``LocalScaler``) then applies "decode 1 -> 2" and "decode 2 -> 1" the way it
applies a Decision of ``decide`` (the decision itself is table-tested in tests/unit/test_local_scaling.py:
on CPU the tiny model never queues on decode long enough for a short test). Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from local_runs import write_run
from rlrun_api import constants as c
from rlrun_api.prometheus import get_samples
from rlrun_runtime.kv_handoff import read_nixl_counts
from rlrun_runtime.local import get_scalable_plan, load_run
from rlrun_runtime.local.membership import parse_server_set
from rlrun_runtime.local.processes import Supervisor
from rlrun_runtime.local.scaler import LocalScaler, weight_version
from rlrun_runtime.local.scaling import SERVING, router_url, server_url
from rlrun_runtime.storage import RunStorage, atomic_directory
from rlrun_runtime.tiny_model import ensure_model
from rlrun_runtime.weights import get_transport
from rlrun_runtime.weights.update import update_engines, write_serving_version

pytestmark = [pytest.mark.vllm, pytest.mark.router, pytest.mark.timeout(900)]
P, D = c.COMPONENT_PREFILL, c.COMPONENT_DECODE
START_DEADLINE_S = 420.0  # two vLLM servers and the router on a loaded 2-core machine (30-90 s each, measured)


def _until(what: str, predicate: Callable[[], Any], timeout_s: float, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _complete(router: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": c.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{router}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _answers(router: str) -> bool:
    """A completion through the router succeeds (False while it or its servers are not up)."""
    try:
        return bool(_complete(router, "warm up")["choices"])
    except (OSError, ValueError, KeyError):
        return False


def _successes(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        samples = get_samples(response.read().decode())
    return sum(v for k, v in samples.items() if k.startswith(c.VLLM_METRIC_REQUEST_SUCCESS))


def _ready(url: str) -> tuple[int, bool]:
    """(HTTP status, "ready" field) of ``GET constants.INFERENCE_READY_PATH`` on one server."""
    try:
        with urllib.request.urlopen(f"{url}{c.INFERENCE_READY_PATH}", timeout=10) as response:
            return response.status, json.loads(response.read())["ready"]
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["ready"]


def test_a_decode_server_joins_at_the_current_version_and_leaves_through_the_router(tmp_path: Path) -> None:
    path = write_run(tmp_path, **{
        "inference.disaggregation": {"enabled": True, "ratio": "1:1", "replicas": 2},
        "router.policy": "round_robin",  # both decode servers get requests, deterministically
        "autoscaling": {"enabled": True, "prefill": {"min": 1, "max": 1}, "decode": {"min": 1, "max": 2},
                        "maxReplicas": 3}})
    out = tmp_path / "out"
    rlrun = load_run(str(path))
    scalable, policy, ports = get_scalable_plan(rlrun, out, os.environ)
    assert (policy.max_replicas, policy.decode.max, len(scalable.pools[D])) == (3, 2, 2)
    storage = RunStorage(out)
    ensure_model(rlrun["spec"]["model"]["name"], storage)
    for file, text in scalable.plan.files.items():
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text)
    prefill0, decode0, decode1 = scalable.pools[P][0], scalable.pools[D][0], scalable.pools[D][1]
    router0 = scalable.router
    assert router0 is not None
    supervisor = Supervisor([prefill0, decode0, router0], grace_seconds=10.0)
    supervisor.start()
    try:
        started = time.monotonic()
        def up() -> bool:
            assert supervisor.check() is None, supervisor.check()
            return _answers(router_url(router0))
        _until("a completion through the router", up, START_DEADLINE_S, poll_s=2.0)
        print(f"prefill, decode and router up in {time.monotonic() - started:.0f} s")

        # version 1, published the way the filesystem transport publishes (atomic weights/step-1), and loaded
        # into the two serving servers by the update sequence (P/D order), as the orchestrator does
        transport = get_transport("filesystem", storage)
        with atomic_directory(storage.weights(1)) as tmp:
            shutil.copytree(storage.model_dir, tmp, dirs_exist_ok=True)
        urls = [server_url(prefill0), server_url(decode0)]
        updates = asyncio.run(update_engines(urls, 1, transport, prefill=[urls[0]]))
        assert sorted(u.reported_version for u in updates) == [1, 1]
        assert [_ready(url) for url in urls] == [(200, True)] * 2  # no serving version recorded yet
        write_serving_version(storage, 1)  # what the orchestrator records after this round

        scaler = LocalScaler(scalable, policy, transport, lambda fn: fn(supervisor), ports, None,
                             out / c.LOCAL_SCALING_FILE)
        assert scaler.current_version() == 1

        # scale-up: decode 1 -> 2
        scaler.apply({P: 1, D: 2})
        new = scaler.servers[decode1.name]
        assert new.phase != SERVING
        joined = time.monotonic()

        def serving() -> bool:
            assert supervisor.check() is None, supervisor.check()
            scaler.advance()
            return scaler.servers[decode1.name].phase == SERVING
        _until(f"{decode1.name} serves", serving, START_DEADLINE_S, poll_s=1.0)
        print(f"{decode1.name} joined in {time.monotonic() - joined:.0f} s: {scaler.notes}")
        assert weight_version(new.url) == 1  # it serves the current version ...
        notes = " | ".join(scaler.notes)
        assert notes.index(f"{decode1.name} loaded version 1") < notes.index(f"router {scaler.router.name} routes")
        # ... and was given to a router only after one KV hand-off from prefill was read over NIXL (a pair's first
        # NIXL connection can take minutes on CPU: kv_handoff's docstring)
        assert notes.index(f"{decode1.name}: KV hand-off read over NIXL") < notes.index(
            f"router {scaler.router.name} routes")
        router1 = router_url(scaler.router)  # ... and was given to a router only after it loaded it
        assert scaler.router.name == f"{router0.name}-g1" and router1 != router_url(router0)
        listed = set(_get_json(f"{router1}/list_workers")["urls"])
        assert listed == {server_url(prefill0), server_url(decode0), new.url}
        servers = parse_server_set((out / c.LOCAL_SERVERS_FILE).read_text())
        assert servers.router == router1 and len(servers.inference) == 3 and servers.prefill == (urls[0].split("//")[1],)
        _until(f"the old router {router0.name} exits", lambda: router0.name in supervisor.exits(), 120)

        before, transfers_before = _successes(new.url), read_nixl_counts(new.url)
        for i in range(6):  # round robin over two decode servers
            t0 = time.monotonic()
            assert _complete(router1, f"prompt number {i}")["choices"][0]["text"] is not None
            print(f"completion {i}: {time.monotonic() - t0:.2f} s", flush=True)
        used = _successes(new.url) - before
        assert used > 0, "the router never used the new decode server"
        # Its KV came from prefill over NIXL: it started from the initial model like prefill (the inference role,
        # get_start_weights) and then loaded version 1 in place, so the handshake's compatibility hash (which
        # covers the --model path) matches; a transfer refused would be recomputed on decode and not counted.
        transfers, failed = read_nixl_counts(new.url)
        print(f"{decode1.name}: {used:.0f} requests, {transfers - transfers_before[0]:.0f} NIXL transfers, "
              f"{failed:.0f} failed")
        assert transfers - transfers_before[0] >= used and failed == 0
        log_text = decode1.log_path.read_text(errors="replace")
        assert "compatibility hash mismatch" not in log_text and "NIXL compatibility check passed" in log_text

        # its readiness endpoint (a cluster's readinessProbe) follows the version the orchestrator records
        assert _ready(new.url) == (200, True)
        write_serving_version(storage, 2)
        assert _ready(new.url) == (503, False) and _ready(server_url(prefill0)) == (503, False)
        write_serving_version(storage, 1)
        assert _ready(new.url) == (200, True)

        # scale-down: decode 2 -> 1 takes the newest decode server out of the router, then stops it
        scaler.apply({P: 1, D: 1})
        assert set(_get_json(f"{router1}/list_workers")["urls"]) == {server_url(prefill0), server_url(decode0)}
        assert len(parse_server_set((out / c.LOCAL_SERVERS_FILE).read_text()).inference) == 2

        def gone() -> bool:
            assert supervisor.check() is None, supervisor.check()  # a retired server's exit fails nothing
            scaler.advance()
            return decode1.name not in scaler.servers
        left = time.monotonic()
        _until(f"{decode1.name} stops", gone, float(c.INFERENCE_TERMINATION_GRACE_SECONDS) + 30, poll_s=1.0)
        print(f"{decode1.name} left in {time.monotonic() - left:.0f} s")
        assert _complete(router1, "after the scale-down")["choices"]
        print(f"after the scale-down: {scaler.notes[-3:]}")
    finally:
        supervisor.stop()
