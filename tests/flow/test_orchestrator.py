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


def publish(storage: RunStorage, version: int) -> None:
    with atomic_directory(storage.weights(version)) as tmp:
        (tmp / "model.safetensors").write_bytes(b"stand-in")


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
    assert paths(first) == ["/pause?mode=keep", "/collective_rpc", "/update_weight_version",
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
            await orchestrator._http().aclose()

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
            while "/pause?mode=keep" not in paths(engine):
                await asyncio.sleep(0.005)
            during = await orchestrator.generate_group(1, [f"http://{address}"])
            await update
            return before, during
        finally:
            await orchestrator._http().aclose()

    before, during = asyncio.run(scenario())
    order = paths(engine)
    completions = [i for i, path in enumerate(order) if path == "/v1/completions"]
    assert before.policy_version == 0 and completions[0] < order.index("/pause?mode=keep")
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
    assert "/pause?mode=keep" not in paths(engine) and orchestrator.loaded_version == 3

    # once the trainer re-publishes 3, every engine reloads it and generation reopens
    publish(storage, 3)
    asyncio.run(orchestrator.sync_weights_once())
    assert "/collective_rpc" in paths(engine) and orchestrator.weights_stable.is_set()
