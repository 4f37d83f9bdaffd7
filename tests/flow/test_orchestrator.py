"""The orchestrator process and its weight loop against stand-in engines (real HTTP in vLLM's admin API
shape): bad input, weight reconciliation, request shape, version stamping during an update."""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from rlrun_api import constants
from rlrun_api.spec import apply_defaults
from rlrun_api.views import OrchestratorView
from rlrun_runtime.storage import RunStorage, atomic_directory
from vllm_role import LOOPBACK, free_port, role_env, tiny_rlrun, write_config


def orchestrator_view(**algorithm) -> OrchestratorView:
    """The orchestrator's view of the tiny run with ``algorithm`` overrides."""
    return OrchestratorView.from_spec(apply_defaults(tiny_rlrun(**algorithm))["spec"])


@pytest.mark.parametrize("change,env_drop,needle", [
    ({"environment": {"type": "builtin", "name": "sort-words"}}, None, "spec.environment.name"),
    ({}, constants.ENV_INFERENCE_ENDPOINTS, constants.ENV_INFERENCE_ENDPOINTS),
    ({}, constants.ENV_STORAGE_DIR, constants.ENV_STORAGE_DIR),
])
def test_bad_input_exits_2_naming_the_field(tmp_path, change, env_drop, needle):
    rlrun = tiny_rlrun()
    rlrun["spec"].update(change)
    config = write_config(tmp_path / "run.yaml", rlrun)
    env = role_env(tmp_path / "storage", **{constants.ENV_INFERENCE_ENDPOINTS: "127.0.0.1:9",
                                            constants.ENV_METRICS_PORT: str(free_port())})
    if env_drop:
        env.pop(env_drop)
    result = subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "orchestrator", "--config", str(config)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr


# --- weight reconciliation against stand-in engines (real HTTP, vLLM's admin API shape) -----------------


class FakeEngineHandler(http.server.BaseHTTPRequestHandler):
    """Speaks the part of vLLM's admin API the orchestrator uses; records every call."""

    version = "default"
    calls: list[tuple[str, object]] = []

    def _reply(self, payload):
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        assert self.path == "/weight_info", self.path
        self._reply({"weight_version": type(self).version})

    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        payload = json.loads(self.rfile.read(length)) if length else None
        type(self).calls.append((self.path, payload))
        if self.path == "/update_weight_version":
            type(self).version = payload["new_version"]
        if self.path == "/v1/completions":  # n choices; choice i's token is its seed (vLLM: seed + i)
            self._reply({"choices": [{"index": i, "text": f"c{payload['seed'] + i}", "token_ids": [payload["seed"] + i],
                                      "logprobs": {"token_logprobs": [-0.5]}} for i in range(payload["n"])]})
            return
        self._reply({"success": True} if self.path == "/reset_prefix_cache" else {"status": "ok"})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_engines():
    servers = []

    def start(version: str = "default", base: type = FakeEngineHandler):
        handler = type("Engine", (base,), {"version": version, "calls": []})
        server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return handler, f"{LOOPBACK}:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


PAUSE = "/pause?mode=keep&clear_cache=false"  # what the update sends (docs/orchestrator.md: no preemption)


def publish(storage: RunStorage, version: int) -> None:
    """A stand-in version: one whole safetensors file (one F32 tensor ``w`` of 2 values; the transport
    checks the file's structure before any engine is paused)."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    with atomic_directory(storage.weights(version)) as tmp:
        (tmp / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))


def paths(handler) -> list[str]:
    return [call[0] for call in handler.calls]


def test_weight_loop_reconciles_every_engine(tmp_path, fake_engines):
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    storage = RunStorage(tmp_path)
    first, first_address = fake_engines()
    metrics = OrchestratorMetrics(max_steps=5)
    orchestrator = Orchestrator(orchestrator_view(), storage, None, None, [first_address], None,
                                metrics)

    async def sync():
        await orchestrator.sync_weights_once()

    # start: nothing published, the engine reports vLLM's "default": it is only named version 0
    asyncio.run(sync())
    assert paths(first) == ["/update_weight_version"] and first.version == "0"
    assert orchestrator.loaded_version == 0

    # the trainer publishes 1 and 2: the engine loads the newest, version 1 is deleted
    publish(storage, 1)
    publish(storage, 2)
    first.calls.clear()
    asyncio.run(sync())
    assert paths(first) == [PAUSE, "/collective_rpc", "/update_weight_version",
                            "/reset_prefix_cache", "/resume"]
    assert first.calls[1][1] == {"method": "rlrun_reload_weights",
                                 "kwargs": {"weights_path": str(storage.weights(2))}}
    assert first.version == "2" and orchestrator.loaded_version == 2
    assert [p.name for p in storage.weights_dir.iterdir()] == ["step-000002"]
    line = json.loads((storage.orchestrator_state.parent / "weight-updates.jsonl").read_text().splitlines()[-1])
    assert line["version"] == 2 and list(line["latency_ms"]) == [f"http://{first_address}"]
    assert metrics.registry.get_sample_value(constants.METRIC_POLICY_VERSION) == 2

    # nothing new: no admin call at all
    first.calls.clear()
    asyncio.run(sync())
    assert paths(first) == []

    # a pod that joins late (vLLM "default") gets the current version; the up-to-date one is left alone
    second, second_address = fake_engines()
    orchestrator.endpoints = [first_address, second_address]
    asyncio.run(sync())
    assert paths(first) == [] and "/collective_rpc" in paths(second) and second.version == "2"

    # the trainer re-publishes version 2 (resumed from an older checkpoint): both reload
    second.calls.clear()
    publish(storage, 2)
    asyncio.run(sync())
    assert "/collective_rpc" in paths(first) and "/collective_rpc" in paths(second)


class WordTask:
    prompt = "a b"


class ScriptedCompletions(http.server.ThreadingHTTPServer):
    """``POST /v1/completions`` answered with the next status of ``script`` (200: one choice), each call recorded."""

    def __init__(self, script):
        self.script, self.calls = list(script), []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.calls.append(self.path)
                status = server.script.pop(0)
                body = json.dumps({"choices": [{"index": 0, "text": "a"}]} if status == 200 else
                                  {"error": f"scripted {status}"}).encode()
                if status == "not json":
                    status, body = 200, b"<html>a proxy's page</html>"
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("Location", f"http://{LOOPBACK}:{server.server_address[1]}/elsewhere")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        super().__init__((LOOPBACK, 0), Handler)
        self.url = f"http://{LOOPBACK}:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.mark.parametrize("first, second", [([503, 200], [200]), ([302], []), ([404], []), (["not json"], [])])
def test_completions_retry_5xx_on_the_next_engine_and_fail_at_once_on_4xx_or_a_redirect(tmp_path, first, second):
    from rlrun_runtime.orchestrator import Orchestrator, OrchestratorError
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    engines = [ScriptedCompletions(first), ScriptedCompletions(second)]
    orchestrator = Orchestrator(orchestrator_view(), RunStorage(tmp_path), StandInEnv(), StandInTokenizer(),
                                [e.url.removeprefix("http://") for e in engines], None, OrchestratorMetrics(max_steps=5))

    async def complete():
        try:
            return await orchestrator._complete({"n": 1, "prompt": [1]}, [e.url for e in engines])
        finally:
            await orchestrator.aclose()

    try:
        if first[0] == 503:  # retried, and the retry goes to the other engine (round robin, no router)
            assert asyncio.run(complete()) == [{"index": 0, "text": "a"}]
            assert [len(e.calls) for e in engines] == [1, 1]
        else:
            status = 200 if first[0] == "not json" else first[0]
            with pytest.raises(OrchestratorError, match=rf"POST {engines[0].url}/v1/completions: HTTP {status}"):
                asyncio.run(complete())
            assert [e.calls for e in engines] == [["/v1/completions"], []]  # no retry, no redirect followed
    finally:
        for engine in engines:
            engine.shutdown()
            engine.server_close()


def test_a_refused_connection_is_retried_on_the_next_engine(tmp_path):
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    serving = ScriptedCompletions([200])
    closed = f"http://{LOOPBACK}:{free_port()}"  # nothing listens there
    orchestrator = Orchestrator(orchestrator_view(), RunStorage(tmp_path), StandInEnv(), StandInTokenizer(),
                                [closed.removeprefix("http://"), serving.url.removeprefix("http://")], None,
                                OrchestratorMetrics(max_steps=5))

    async def complete():
        try:
            return await orchestrator._complete({"n": 1, "prompt": [1]}, [closed, serving.url])
        finally:
            await orchestrator.aclose()

    try:
        assert asyncio.run(complete()) == [{"index": 0, "text": "a"}] and serving.calls == ["/v1/completions"]
    finally:
        serving.shutdown()
        serving.server_close()


class StandInEnv:
    def task(self, index):
        return WordTask()

    def score(self, task, text):
        return float(text == "c1")


class StandInTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


@pytest.mark.parametrize("disaggregated, expected_n", [(False, [4]), (True, [1, 1, 1, 1])])
def test_a_group_is_one_request_with_n_choices_unless_disaggregated(tmp_path, fake_engines, disaggregated, expected_n):
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    engine, address = fake_engines()
    spec = apply_defaults(tiny_rlrun(rolloutsPerPrompt=4))["spec"]
    spec["inference"]["disaggregation"]["enabled"] = disaggregated
    orchestrator = Orchestrator(OrchestratorView.from_spec(spec), RunStorage(tmp_path), StandInEnv(), StandInTokenizer(), [address], None,
                                OrchestratorMetrics(max_steps=5))
    orchestrator.loaded_version = 7

    async def generate():
        try:
            return await orchestrator.generate_group(3, [f"http://{address}"])
        finally:
            await orchestrator.aclose()

    group = asyncio.run(generate())
    requests = [body for path, body in engine.calls if path == "/v1/completions"]
    assert [body["n"] for body in requests] == expected_n
    seed = min(body["seed"] for body in requests)  # the n: 1 requests arrive in any order
    assert sorted(body["seed"] for body in requests) == list(range(seed, seed + 4, 4 // len(requests)))
    assert all(body["cache_salt"] == "policy-7" and body["prompt"] == [97, 32, 98] for body in requests)
    # the same four samples either way: choice i of seed s is the sample of seed s + i
    assert sorted(c.token_ids[0] for c in group.completions) == [seed, seed + 1, seed + 2, seed + 3]
    assert (group.task_index, group.policy_version, group.prompt_ids) == (3, 7, [97, 32, 98])
    assert len(group.rewards) == 4


class SlowReloadEngine(FakeEngineHandler):
    """A stand-in engine whose reload takes RELOAD_S: the pause -> resume window stays open that long."""

    RELOAD_S = 0.6

    def do_POST(self):  # noqa: N802
        if self.path == "/collective_rpc":
            time.sleep(self.RELOAD_S)
        super().do_POST()


def test_no_request_is_stamped_with_the_old_version_during_a_weight_update(tmp_path, fake_engines):
    """A group started while an update is in flight waits for it, then carries the new version's stamp."""
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    engine, address = fake_engines(base=SlowReloadEngine)
    storage = RunStorage(tmp_path)
    orchestrator = Orchestrator(orchestrator_view(rolloutsPerPrompt=2),
                                storage, StandInEnv(), StandInTokenizer(), [address], None, OrchestratorMetrics(max_steps=5))

    async def scenario():
        try:
            await orchestrator.sync_weights_once()  # names the initial model version 0
            before = await orchestrator.generate_group(0, [f"http://{address}"])  # no update: not held back
            publish(storage, 1)
            update = asyncio.create_task(orchestrator.sync_weights_once())
            while PAUSE not in paths(engine):
                await asyncio.sleep(0.005)
            during = await orchestrator.generate_group(1, [f"http://{address}"])
            await update
            return before, during
        finally:
            await orchestrator.aclose()

    before, during = asyncio.run(scenario())
    order = paths(engine)
    completions = [i for i, path in enumerate(order) if path == "/v1/completions"]
    assert before.policy_version == 0 and completions[0] < order.index(PAUSE)
    # the request of the group started during the update reached the engine only after resume, stamped 1
    assert completions[1] > order.index("/resume"), order
    assert during.policy_version == 1
    assert [body["cache_salt"] for path, body in engine.calls if path == "/v1/completions"] == ["policy-0",
                                                                                                  "policy-1"]


def test_published_versions_going_down_keep_the_loaded_version_until_it_is_republished(tmp_path, fake_engines):
    """A trainer resumed from checkpoint 1 while version 3 is loaded (docs/orchestrator.md, after a resume)."""
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    storage = RunStorage(tmp_path)
    engine, address = fake_engines()
    orchestrator = Orchestrator(orchestrator_view(), storage, None, None, [address], None,
                                OrchestratorMetrics(max_steps=5))
    publish(storage, 3)
    asyncio.run(orchestrator.sync_weights_once())
    assert orchestrator.loaded_version == 3 and engine.version == "3"

    # the resumed trainer re-publishes 2 (older than the loaded 3): the engines keep serving 3, stamped 3
    engine.calls.clear()
    publish(storage, 2)
    asyncio.run(orchestrator.sync_weights_once())
    assert paths(engine) == [] and orchestrator.loaded_version == 3

    # if the loaded version's directory disappears, the update is refused before any engine is paused
    shutil.rmtree(storage.weights(3))
    with pytest.raises(ValueError, match="not a directory"):
        asyncio.run(orchestrator.sync_weights_once())
    assert PAUSE not in paths(engine) and orchestrator.loaded_version == 3

    # once the trainer re-publishes 3, every engine reloads it and generation reopens
    publish(storage, 3)
    asyncio.run(orchestrator.sync_weights_once())
    assert "/collective_rpc" in paths(engine) and orchestrator.weights_stable.is_set()


# --- stalled engines and engines left out of service (issue 11 section 2, items 1-3) ----------------------


class StallingEngine(FakeEngineHandler):
    """Answers GET /health at once, unless ``stall`` is set: then it holds every reply until ``wake`` is set
    (what a SIGSTOPped server does: the connection is accepted, nothing comes back)."""

    stall: threading.Event
    wake: threading.Event

    def do_GET(self):  # noqa: N802
        if type(self).stall.is_set():
            type(self).wake.wait(60)
        if self.path == "/health":
            self._reply({})
            return
        super().do_GET()


def make_orchestrator(storage, address, **kwargs):
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    return Orchestrator(orchestrator_view(), storage, None, None, [address], None, OrchestratorMetrics(max_steps=5),
                        **kwargs)


async def wait_until(condition, timeout_s: float, what: str) -> float:
    """Poll ``condition`` until true; returns when (monotonic). Fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.01)
    return time.monotonic()


def test_a_stalled_engine_is_reported_within_the_bound_and_cleared_when_it_answers(tmp_path, fake_engines, caplog):
    """The watchdog warns (naming the engine and how long) and sets the gauge at most stall_after_s +
    watchdog_poll_s after the engine's last answer, then clears both when it answers again."""
    stall, wake = threading.Event(), threading.Event()
    engine, address = fake_engines(base=type("Stalling", (StallingEngine,), {"stall": stall, "wake": wake}))
    url = f"http://{address}"
    stall_after_s, poll_s = 0.5, 0.05
    orchestrator = make_orchestrator(RunStorage(tmp_path), address, stall_after_s=stall_after_s,
                                     watchdog_poll_s=poll_s)
    gauge = lambda: orchestrator.metrics.registry.get_sample_value(constants.METRIC_STALLED_ENGINES)  # noqa: E731
    warnings = lambda: [r.getMessage() for r in caplog.records if "has not answered" in r.getMessage()]  # noqa: E731

    async def scenario():
        watchdog = asyncio.create_task(orchestrator.watchdog_loop())
        try:
            await wait_until(lambda: gauge() == 0, 10, "first watchdog round")
            # answering engine: no warning however long we watch (three stall periods here)
            quiet_until = time.monotonic() + 3 * stall_after_s
            await wait_until(lambda: time.monotonic() > quiet_until or warnings(), 10, "quiet period")
            assert warnings() == [] and gauge() == 0
            stall.set()
            stalled_at = time.monotonic()
            warned_at = await wait_until(warnings, 30, "a stall warning")
            # bound: the last answer came at most one probe round before the stall began
            assert warned_at - stalled_at <= stall_after_s + 2 * poll_s + 1.0, warned_at - stalled_at
            assert gauge() == 1 and list(orchestrator.stalled) == [url]
            message = warnings()[0]
            assert url in message and "GET /health" in message
            assert float(message.split("for ")[1].split(" s")[0]) >= stall_after_s
            stall.clear()
            wake.set()
            await wait_until(lambda: gauge() == 0, 30, "the stall to clear")
            assert orchestrator.stalled == {}
            assert any(f"engine {url} answers again" in r.getMessage() for r in caplog.records)
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    with caplog.at_level("WARNING", logger="rlrun.orchestrator"):
        asyncio.run(scenario())


def test_a_sigstopped_process_is_reported_stalled_and_cleared_after_sigcont(tmp_path, caplog):
    """A real stopped process (a small HTTP server under SIGSTOP: its socket still accepts, nothing answers)."""
    import os
    import signal

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", LOOPBACK, str(port)],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{LOOPBACK}:{port}"
    orchestrator = make_orchestrator(RunStorage(tmp_path), f"{LOOPBACK}:{port}", stall_after_s=1.0,
                                     watchdog_poll_s=0.1)
    gauge = lambda: orchestrator.metrics.registry.get_sample_value(constants.METRIC_STALLED_ENGINES)  # noqa: E731

    async def scenario():
        watchdog = asyncio.create_task(orchestrator.watchdog_loop())
        try:
            import httpx

            async with httpx.AsyncClient() as client:  # the server is up (any HTTP answer counts)
                deadline = time.monotonic() + 30
                while True:
                    try:
                        await client.get(f"{url}/health", timeout=1)
                        break
                    except httpx.HTTPError:
                        assert time.monotonic() < deadline, "stand-in server did not start"
                        await asyncio.sleep(0.05)
            await wait_until(lambda: gauge() == 0, 10, "first watchdog round")
            os.kill(server.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            warned_at = await wait_until(lambda: gauge() == 1, 30, "a stall report")
            assert warned_at - stopped_at <= 1.0 + 0.2 + 1.5, warned_at - stopped_at
            assert any(url in r.getMessage() and "has not answered" in r.getMessage() for r in caplog.records)
            os.kill(server.pid, signal.SIGCONT)
            await wait_until(lambda: gauge() == 0, 30, "the stall to clear after SIGCONT")
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)

    try:
        with caplog.at_level("WARNING", logger="rlrun.orchestrator"):
            asyncio.run(scenario())
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(timeout=30)


class BrokenLoadEngine(FakeEngineHandler):
    """Every reload fails (HTTP 500) while ``broken`` is set."""

    broken: threading.Event

    def do_POST(self):  # noqa: N802
        if self.path == "/collective_rpc" and type(self).broken.is_set():
            length = int(self.headers.get("content-length") or 0)
            type(self).calls.append((self.path, json.loads(self.rfile.read(length))))
            self.send_response(500)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        super().do_POST()


def test_an_engine_whose_load_and_restore_fail_stays_paused_until_a_later_update_resumes_it(tmp_path, fake_engines):
    broken = threading.Event()
    engine, address = fake_engines(base=type("Broken", (BrokenLoadEngine,), {"broken": broken}))
    storage = RunStorage(tmp_path)
    orchestrator = make_orchestrator(storage, address)
    out_of_service = lambda: orchestrator.metrics.registry.get_sample_value(  # noqa: E731
        constants.METRIC_ENGINES_OUT_OF_SERVICE)
    publish(storage, 1)
    asyncio.run(orchestrator.sync_weights_once())
    assert orchestrator.loaded_version == 1 and out_of_service() == 0

    from rlrun_runtime.vllm_admin import EngineOutOfService

    broken.set()
    publish(storage, 2)
    engine.calls.clear()
    with pytest.raises(EngineOutOfService, match="restoring version 1 failed"):
        asyncio.run(orchestrator.sync_weights_once())
    reloads = [body["kwargs"]["weights_path"] for path, body in engine.calls if path == "/collective_rpc"]
    # the new version, then the previous one (restore), each retried on 5xx; never a resume
    assert reloads[0] == str(storage.weights(2)) and reloads[-1] == str(storage.weights(1))
    assert "/resume" not in paths(engine)
    assert out_of_service() == 1 and orchestrator.out_of_service == {f"http://{address}"}
    assert orchestrator.loaded_version == 1 and not orchestrator.weights_stable.is_set()  # generation held

    # the next round updates it again (even if it had reported the new version) and resumes it
    broken.clear()
    engine.calls.clear()
    asyncio.run(orchestrator.sync_weights_once())
    assert paths(engine)[-1] == "/resume" and engine.version == "2"
    assert out_of_service() == 0 and orchestrator.loaded_version == 2 and orchestrator.weights_stable.is_set()


# --- batches that carry nothing to learn, truncation, broken choices (issue 11 §2) -----------------------


class ShapedEngine(FakeEngineHandler):
    """A stand-in engine that answers /health and shapes its choices like vLLM's: choice i of a request with
    seed s has token s + i and text "c<s + i>"; choices listed in CUT get finish_reason "length" (the others
    "stop"), and those in NULL_IDS come back with ``token_ids: [null]``."""

    CUT: tuple[int, ...] = ()
    NULL_IDS: tuple[int, ...] = ()

    def do_GET(self):  # noqa: N802
        if self.path == "/health":
            self._reply({})
            return
        super().do_GET()

    def do_POST(self):  # noqa: N802
        if self.path != "/v1/completions":
            super().do_POST()
            return
        length = int(self.headers.get("content-length") or 0)
        payload = json.loads(self.rfile.read(length))
        type(self).calls.append((self.path, payload))
        choices = []
        for i in range(payload["n"]):
            token = payload["seed"] + i
            choices.append({"index": i, "text": f"c{token}", "finish_reason": "length" if i in self.CUT else "stop",
                            "token_ids": [None] if i in self.NULL_IDS else [token],
                            "logprobs": {"token_logprobs": [-0.5]}})
        self._reply({"choices": choices})


class ParityEnv(StandInEnv):
    """Reward 1 for an even token, 0 for an odd one: every group of consecutive seeds has signal."""

    def score(self, task, text):
        return float(int(text[1:]) % 2 == 0)


class RaisingEnv(StandInEnv):
    def score(self, task, text):
        raise KeyError("answer")


class LongPromptEnv(StandInEnv):
    class Long:
        prompt = "x" * 200  # 200 tokens with StandInTokenizer: no room under maxModelLen 128

    def task(self, index):
        return self.Long()


def shaped_orchestrator(tmp_path, fake_engines, env, engine_base=ShapedEngine, **algorithm):
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    engine, address = fake_engines(base=engine_base) if fake_engines else (None, "127.0.0.1:9")
    defaults = {"rolloutsPerPrompt": 4, "batchSize": 8, "maxSteps": 10}
    orchestrator = Orchestrator(orchestrator_view(**{**defaults, **algorithm}), RunStorage(tmp_path), env,
                                StandInTokenizer(), [address], None, OrchestratorMetrics(max_steps=10))
    orchestrator.loaded_version = 0
    return orchestrator, engine, address


def run_batch_loop(orchestrator, next_step=1, cursor=0, streak=0):
    async def scenario():
        try:
            await orchestrator.batch_loop(next_step, cursor, streak)
        finally:
            await orchestrator.aclose()

    asyncio.run(scenario())


def test_truncated_and_null_token_id_choices_are_kept_apart_and_counted(tmp_path, fake_engines):
    engine_base = type("Cut0Null1", (ShapedEngine,), {"CUT": (0,), "NULL_IDS": (1,)})
    orchestrator, _, _ = shaped_orchestrator(tmp_path, fake_engines, ParityEnv(), engine_base)

    async def make():
        try:
            return await orchestrator.make_batch(1, 0)
        finally:
            await orchestrator.aclose()

    batch, cursor = asyncio.run(make())  # a null token id used to raise out of make_batch here
    metrics = orchestrator.metrics.registry.get_sample_value
    groups = cursor  # one group per prompt drawn; each lost choice 1 and had choice 0 cut
    assert batch["dropped_bad_token_ids_samples"] == groups and batch["generated_rollouts"] == 4 * groups
    assert metrics("rlrun_orchestrator_dropped_samples_total", {"reason": "bad_token_ids"}) == groups
    assert batch["truncated_rollouts"] == groups == metrics(constants.METRIC_TRUNCATED_ROLLOUTS + "_total")
    assert sorted({s["finish_reason"] for s in batch["samples"]}) == ["length", "stop"]  # keep: trained
    assert len(batch["samples"]) == 6 and all(s["completion_ids"][0] is not None for s in batch["samples"])


def test_truncation_mask_leaves_cut_completions_out_of_the_batch(tmp_path, fake_engines):
    engine_base = type("Cut0", (ShapedEngine,), {"CUT": (0,)})
    orchestrator, _, _ = shaped_orchestrator(tmp_path, fake_engines, ParityEnv(), engine_base, truncation="mask")

    async def make():
        try:
            return await orchestrator.make_batch(1, 0)
        finally:
            await orchestrator.aclose()

    batch, _ = asyncio.run(make())
    assert batch["samples"] and {s["finish_reason"] for s in batch["samples"]} == {"stop"}
    assert batch["dropped_truncated_samples"] == batch["truncated_rollouts"] > 0
    assert orchestrator.metrics.registry.get_sample_value("rlrun_orchestrator_dropped_samples_total",
                                                          {"reason": "truncated"}) == batch["dropped_truncated_samples"]


def test_a_scorer_that_always_raises_fails_the_run_after_max_empty_batches(tmp_path, fake_engines):
    from rlrun_runtime.orchestrator import NoLearningSignalError, Orchestrator

    orchestrator, _, address = shaped_orchestrator(tmp_path, fake_engines, RaisingEnv(), maxEmptyBatches=3,
                                                   maxAsyncLevel=2, maxOffPolicySteps=2)
    storage = orchestrator.storage
    with pytest.raises(NoLearningSignalError) as failure:
        run_batch_loop(orchestrator)
    message = str(failure.value)
    assert message.startswith("3 consecutive batches without a trainable sample (steps 1..3, "
                              "algorithm.maxEmptyBatches 3); environment builtin/reverse-words (seed 0): "
                              "the scorer raised for ")
    assert "(last: KeyError: 'answer')" in message and "groups were dropped as too small" in message
    # batches 1 and 2 were shipped (empty, no-op trainer steps); the third, which hit the limit, was not
    written = [json.loads(storage.rollout_batch(s).read_text()) for s in (1, 2)]
    assert [(b["samples"], b["empty_batch_streak"]) for b in written] == [([], 1), ([], 2)]
    assert written[0]["scorer_errors"] == written[0]["generated_rollouts"] > 0
    assert not storage.rollout_batch(3).exists()
    state = json.loads(storage.orchestrator_state.read_text())
    assert (state["next_step"], state["empty_batch_streak"]) == (3, 2)
    get = orchestrator.metrics.registry.get_sample_value
    assert get(constants.METRIC_EMPTY_BATCH_STREAK) == 3
    assert get(constants.METRIC_SCORER_ERRORS + "_total") == 3 * written[0]["scorer_errors"]

    # a restarted orchestrator (the Job's next pod) resumes the streak and fails after one more batch
    restarted = Orchestrator(orchestrator.view, storage, RaisingEnv(), StandInTokenizer(), [address], None,
                             type(orchestrator.metrics)(max_steps=10))
    restarted.loaded_version = 0
    next_step, cursor = restarted.load_resume_point()
    assert (next_step, restarted.load_empty_batch_streak()) == (3, 2)
    with pytest.raises(NoLearningSignalError, match=r"^3 consecutive batches .*steps 1\.\.3"):
        run_batch_loop(restarted, next_step, cursor, restarted.load_empty_batch_streak())


def test_a_batch_whose_every_prompt_is_too_long_fails_at_once(tmp_path, fake_engines):
    from rlrun_runtime.orchestrator import NoLearningSignalError

    orchestrator, engine, _ = shaped_orchestrator(tmp_path, fake_engines, LongPromptEnv(), maxEmptyBatches=0)
    with pytest.raises(NoLearningSignalError) as failure:
        run_batch_loop(orchestrator)
    prompts = orchestrator.metrics.registry.get_sample_value(constants.METRIC_DROPPED_PROMPTS + "_total",
                                                              {"reason": "too_long"})
    assert prompts >= 2 and str(failure.value) == (
        f"batch step-000001: all {int(prompts)} prompts drawn from environment builtin/reverse-words (seed 0) were "
        "too long for model.maxModelLen 128 (no room left for a completion); nothing can be trained. Shorten the "
        "environment's prompts or raise model.maxModelLen")
    assert engine.calls == [] and not orchestrator.storage.rollout_batch(1).exists()


@pytest.mark.parametrize("limit, max_steps, fails_at", [(3, 10, 3), (3, 2, 2), (1, 10, 1), (0, 2, None)])
def test_empty_batch_limit(tmp_path, limit, max_steps, fails_at):
    """K empty batches in a row fail; a run shorter than K fails at its last step; 0 never fails."""
    from rlrun_runtime.orchestrator import NoLearningSignalError

    orchestrator, _, _ = shaped_orchestrator(tmp_path, None, RaisingEnv(), maxEmptyBatches=limit,
                                             maxSteps=max_steps)
    empty = {"samples": [], "dropped_zero_advantage_groups": 2}
    streak = 0
    for step in range(1, max_steps + 1):
        if step == fails_at:
            with pytest.raises(NoLearningSignalError, match="2 groups had zero advantage"):
                orchestrator.get_empty_batch_streak(step, empty, streak)
            return
        streak = orchestrator.get_empty_batch_streak(step, empty, streak)
        assert streak == step
    assert fails_at is None
    assert orchestrator.get_empty_batch_streak(max_steps + 1, {"samples": [{}]}, streak) == 0  # a sample resets


def test_the_orchestrator_process_exits_3_naming_the_environment_and_rlrun_local_shows_it(tmp_path, fake_engines):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from rlrun_runtime.local import get_role_error

    # A word-level tokenizer directory for AutoTokenizer (written without importing transformers here: the
    # orchestrator process pays that import once)
    model = tmp_path / "model"
    model.mkdir()
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "unk_token": "[UNK]"}))
    (tmp_path / "raising_env.py").write_text(
        "from rlrun_runtime.environments.base import Task\n"
        "class RaisingEnv:\n"
        "    name = 'raising'\n"
        "    def task(self, index):\n"
        "        return Task(index, 'a b', None)\n"
        "    def score(self, task, completion):\n"
        "        raise ValueError('no answer field')\n")
    _, address = fake_engines(base=ShapedEngine)
    rlrun = tiny_rlrun(maxEmptyBatches=2, rolloutsPerPrompt=2, batchSize=4)
    rlrun["spec"]["model"]["name"] = str(model)
    rlrun["spec"]["environment"] = {"type": "python", "name": "raising_env:RaisingEnv"}
    config = write_config(tmp_path / "run.yaml", rlrun)
    env = role_env(tmp_path / "storage", **{constants.ENV_INFERENCE_ENDPOINTS: address,
                                            constants.ENV_METRICS_PORT: str(free_port())})
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    result = subprocess.run([sys.executable, "-m", "rlrun_runtime.cli", "orchestrator", "--config", str(config)],
                            env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 3, result.stderr[-3000:]
    log = tmp_path / "orchestrator.log"
    log.write_text(result.stderr)
    cause = get_role_error(log)  # what `rlrun local` prints as "cause:" under "run ... failed: orchestrator ..."
    assert cause is not None and cause.startswith(
        "rlrun-runtime orchestrator: 2 consecutive batches without a trainable sample (steps 1..2, "
        "algorithm.maxEmptyBatches 2); environment python/raising_env:RaisingEnv (seed 0): the scorer raised for ")
    assert "(last: ValueError: no answer field)" in cause and "Traceback" not in result.stderr


def test_the_failure_reaches_the_termination_message_file_when_there_is_one(tmp_path):
    from rlrun_runtime.orchestrator import write_termination_message

    assert write_termination_message("no such file", str(tmp_path / "absent")) is False
    assert not (tmp_path / "absent").exists()
    path = tmp_path / "termination-log"
    path.write_text("")
    assert write_termination_message("é" * 3000, str(path)) is True  # capped at 4096 bytes, still UTF-8
    text = path.read_text(encoding="utf-8")
    assert text == "é" * 2048 and len(text.encode()) == 4096


def test_the_loop_wait_counters_follow_the_gate_and_the_trainers_metrics(tmp_path, fake_engines):
    """The autoscaler's two wait counters, from the real batch loop against a stand-in engine and a
    stand-in trainer that writes metrics.jsonl lines: the gate's counts while the gate holds batch 3 and
    equals the batch files' gate_wait_seconds; the trainer's counts provisionally while the batch after its
    newest logged step is missing, takes the trainer's own wait_seconds, never decreases, and leaves out
    the lines logged before the orchestrator started."""
    from rlrun_runtime.storage import append_jsonl

    orchestrator, _, _ = shaped_orchestrator(tmp_path, fake_engines, ParityEnv(), maxSteps=3, maxAsyncLevel=1)
    storage, metrics = orchestrator.storage, orchestrator.metrics
    get = metrics.registry.get_sample_value
    data_wait = lambda: get(constants.METRIC_DATA_WAIT_SECONDS + "_total")  # noqa: E731
    gate_wait = lambda: get(constants.METRIC_GATE_WAIT_SECONDS + "_total")  # noqa: E731
    append_jsonl(storage.metrics_file, {"step": 0, "wait_seconds": 50.0})  # before the start: not counted

    async def scenario():
        watcher = asyncio.create_task(orchestrator.trainer_wait_loop(poll_s=0.01))
        batches = asyncio.create_task(orchestrator.batch_loop(1, 0, 0))
        try:
            # the newest line (step 0) says the trainer needs batch 1: provisional wait until it is written
            await wait_until(lambda: orchestrator.trainer_needs == 1, 30, "the history line is read")
            # loaded version 0, maxAsyncLevel 1: batches 1 and 2 go, the gate holds batch 3
            await wait_until(lambda: storage.rollout_batch(2).is_file() and metrics.gate_wait.waiting, 60,
                             "batch 2 written, the gate closed on batch 3")
            assert not metrics.data_wait.waiting  # batch 1 exists: the provisional wait ended there
            provisional = data_wait()
            assert 0 <= provisional < 50.0
            # the trainer logs step 1 (its own wait: 0.25 s): confirmed; it needs batch 2, which exists
            append_jsonl(storage.metrics_file, {"step": 1, "wait_seconds": 0.25})
            await wait_until(lambda: orchestrator.trainer_needs == 2, 30, "the step-1 line is read")
            assert not metrics.data_wait.waiting and data_wait() == pytest.approx(max(provisional, 0.25))
            # the trainer logs step 2: batch 3 is held by the gate, so the trainer waits from now on
            append_jsonl(storage.metrics_file, {"step": 2, "wait_seconds": 0.5})
            await wait_until(lambda: orchestrator.trainer_needs == 3 and metrics.data_wait.waiting, 30,
                             "the step-2 line is read, batch 3 missing")
            first = data_wait(), gate_wait()
            await wait_until(lambda: data_wait() > first[0] and gate_wait() > first[1], 30,
                             "both waits in progress count up between scrapes")
            # version 1 is loaded: the gate opens, batch 3 is written, both waits end
            orchestrator.loaded_version = 1
            orchestrator.version_changed.set()
            await asyncio.wait_for(batches, 60)
            assert not metrics.gate_wait.waiting and not metrics.data_wait.waiting
            ended = data_wait(), gate_wait()
            await asyncio.sleep(0.05)
            assert (data_wait(), gate_wait()) == ended  # flat once nobody waits
            return ended
        finally:
            watcher.cancel()
            batches.cancel()
            await asyncio.gather(watcher, batches, return_exceptions=True)
            await orchestrator.aclose()

    trainer_wait_s, gate_wait_s = asyncio.run(scenario())
    batches = [json.loads(storage.rollout_batch(step).read_text()) for step in (1, 2, 3)]
    # the batch files round to ms; the counter reads the same clock around the same wait
    assert gate_wait_s == pytest.approx(sum(b["gate_wait_seconds"] for b in batches), abs=0.005)
    assert batches[2]["gate_wait_seconds"] > 0
    assert trainer_wait_s >= 0.25 + 0.5 and trainer_wait_s < 50.0
