"""The orchestrator: staleness/gating and batch-assembly tables, and a real run against real vLLM (+ router)."""

from __future__ import annotations

import asyncio
import http.server
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlrun_api import constants
from rlrun_runtime.orchestrator import get_resume_point, render_prompt
from rlrun_runtime.rollouts import (Completion, Group, assemble_batch, get_completion_request, get_exact_match_rate,
                                   parse_completion_choice, plan_group_count)
from rlrun_runtime.staleness import is_stale, may_generate, min_version_for_step, staleness
from rlrun_runtime.storage import RunStorage, atomic_directory
from vllm_role import LOOPBACK, free_port, inference_server, role_env, stop_group, tiny_rlrun, write_config

# --- staleness and the async gate ---------------------------------------------------------------------


@pytest.mark.parametrize("step,loaded,async_level,allowed", [
    (1, 0, 0, True),    # the first batch always uses the initial model
    (2, 0, 0, False),   # synchronous: batch 2 waits for version 1
    (2, 1, 0, True),
    (2, 0, 1, True),    # one step ahead: batch 2 with version 0 while step 1 trains
    (3, 0, 1, False),
    (3, 1, 1, True),
    (10, 7, 2, True),   # 10 - 1 - 2 = 7
    (10, 6, 2, False),
])
def test_async_gate(step, loaded, async_level, allowed):
    assert may_generate(step, loaded, async_level) is allowed
    assert min_version_for_step(step, async_level) == step - 1 - async_level


@pytest.mark.parametrize("step,version,max_off,expected_staleness,stale", [
    (1, 0, 0, 0, False),   # on-policy
    (3, 1, 0, 1, True),
    (3, 1, 1, 1, False),
    (5, 1, 2, 3, True),
    (5, 2, 2, 2, False),
])
def test_staleness_definition(step, version, max_off, expected_staleness, stale):
    assert staleness(step, version) == expected_staleness
    assert is_stale(step, version, max_off) is stale


def test_gate_rejects_nonsense():
    with pytest.raises(ValueError):
        min_version_for_step(0, 1)


# --- completions --------------------------------------------------------------------------------------


def choice(ids, logprobs, text="x"):
    return {"text": text, "token_ids": ids, "logprobs": {"token_logprobs": logprobs}}


def test_completion_request_carries_ids_salt_and_sampling():
    body = get_completion_request([1, 2, 3], {"temperature": 0.7, "topP": 1.0}, 12, 4, seed=9)
    assert body["prompt"] == [1, 2, 3] and body["model"] == constants.SERVED_MODEL_NAME
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["n"] == 1
    assert body["cache_salt"] == "policy-4"
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.7, 1.0, 12, 9)



def test_one_request_per_group_asks_for_n_choices():
    body = get_completion_request([1, 2], {"temperature": 1.0, "topP": 0.9}, 8, 3, seed=5, n=8)
    assert (body["n"], body["seed"], body["cache_salt"], body["top_p"]) == (8, 5, "policy-3", 0.9)
    with pytest.raises(ValueError, match="n must be >= 1"):
        get_completion_request([1, 2], {"temperature": 1.0, "topP": 1.0}, 8, 3, n=0)

def test_parse_completion_choice_keeps_server_ids():
    assert parse_completion_choice(choice([5, 0], [-0.5, -1.0], " a")) == Completion([5, 0], [-0.5, -1.0], " a")


@pytest.mark.parametrize("bad", [
    choice([5, 6], [-0.5, float("nan")]),
    choice([5, 6], [-0.5, None]),
    choice([5, 6], [-0.5, float("-inf")]),
    choice([5, 6], [-0.5]),
    choice([], []),
    {"text": "x", "token_ids": [5], "logprobs": None},
])
def test_broken_samples_are_dropped(bad):
    assert parse_completion_choice(bad) is None


def test_missing_token_ids_is_an_error():
    with pytest.raises(ValueError, match="return_token_ids"):
        parse_completion_choice({"text": "x", "logprobs": {"token_logprobs": [-1.0]}})


# --- batch assembly -----------------------------------------------------------------------------------


def group(index, version, rewards):
    completions = [Completion([10 + i, 0], [-0.1, -0.2], f"c{i}") for i in range(len(rewards))]
    return Group(index, [1, 2], "p", version, completions, list(rewards))


def test_batch_of_whole_groups_with_group_baseline():
    groups = [group(0, 0, [1.0, 0.0, 0.5, 0.5]), group(1, 0, [0.2, 0.4, 0.6, 0.8])]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    samples = out.batch["samples"]
    assert len(samples) == 8 and out.leftover == []
    assert [s["advantage"] for s in samples[:4]] == [0.5, -0.5, 0.0, 0.0]
    assert [round(s["advantage"], 9) for s in samples[4:]] == [-0.3, -0.1, 0.1, 0.3]
    assert samples[0] == {"prompt_ids": [1, 2], "completion_ids": [10, 0], "inference_logprobs": [-0.1, -0.2],
                          "reward": 1.0, "advantage": 0.5, "policy_version": 0, "group": 0}
    assert out.batch["policy_versions"] == [0] and out.batch["step"] == 1
    assert out.batch["reward_mean"] == pytest.approx(0.5)


def test_exact_match_rate_counts_full_rewards_only():
    groups = [group(0, 0, [1.0, 1.0, 1.0, 1.0]), group(1, 0, [1.0, 0.99, 0.0, 0.5])]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    assert out.batch["exact_match_rate"] == pytest.approx(5 / 8)  # the dropped all-right group counts too
    assert get_exact_match_rate([]) is None


@pytest.mark.parametrize("missing, group_size, rate, expected", [
    (128, 8, 1.0, 16), (128, 8, 0.8, 20), (128, 8, 0.1, 64), (128, 8, 0.5, 32), (128, 8, 1.7, 16),
    (5, 8, 1.0, 1), (0, 8, 0.5, 0),
    (-3, 8, 1.0, 0), (24, 8, 0.75, 4)])
def test_plan_group_count(missing, group_size, rate, expected):
    assert plan_group_count(missing, group_size, rate) == expected


def test_plan_group_count_rejects_empty_groups():
    with pytest.raises(ValueError, match="group_size"):
        plan_group_count(8, 0, 1.0)


def test_stale_groups_are_dropped_and_counted():
    groups = [group(0, 1, [1, 0]), group(1, 2, [1, 0]), group(2, 4, [0, 1])]
    out = assemble_batch(5, groups, batch_size=8, max_off_policy_steps=2)  # staleness 3, 2, 0
    assert out.dropped_stale_groups == out.batch["dropped_stale_groups"] == 1
    assert [s["group"] for s in out.batch["samples"]] == [1, 1, 2, 2]
    assert out.batch["policy_versions"] == [2, 4]


def test_zero_advantage_groups_are_filtered_but_count_in_the_reward():
    groups = [group(0, 0, [1, 1, 1, 1]), group(1, 0, [0.3, 0.1 + 0.2, 0.3, 0.3]), group(2, 0, [0, 1, 0, 1])]
    out = assemble_batch(1, groups, batch_size=12, max_off_policy_steps=0)
    assert out.dropped_zero_advantage_groups == 2
    assert [s["group"] for s in out.batch["samples"]] == [2, 2, 2, 2]
    assert out.batch["reward_mean"] == pytest.approx((4 + 1.2 + 2) / 12)


def test_groups_that_do_not_fit_are_left_for_the_next_step():
    groups = [group(i, 0, [0, 1]) for i in range(4)]
    out = assemble_batch(1, groups, batch_size=4, max_off_policy_steps=0)
    assert [s["group"] for s in out.batch["samples"]] == [0, 0, 1, 1]
    assert [g.task_index for g in out.leftover] == [2, 3]
    # next step: the leftover is one step staler
    nxt = assemble_batch(2, out.leftover, batch_size=4, max_off_policy_steps=0)
    assert nxt.dropped_stale_groups == 2 and nxt.batch["samples"] == []


def test_nonfinite_rewards_drop_the_sample_not_the_group():
    groups = [group(0, 0, [1.0, math.nan, 0.0]), group(1, 0, [math.nan, 1.0])]
    out = assemble_batch(1, groups, batch_size=8, max_off_policy_steps=0)
    assert [(s["group"], s["reward"], s["advantage"]) for s in out.batch["samples"]] == [(0, 1.0, 0.5), (0, 0.0, -0.5)]
    assert out.dropped_nonfinite_rewards == 2 and out.dropped_small_groups == 1
    assert all(math.isfinite(s["advantage"]) for s in out.batch["samples"])


def test_std_normalisation_option():
    out = assemble_batch(1, [group(0, 0, [0.0, 0.5])], batch_size=2, max_off_policy_steps=0, std_normalize=True)
    assert [round(s["advantage"], 3) for s in out.batch["samples"]] == [-1.0, 1.0]


@pytest.mark.parametrize("state,last,expected", [
    (None, None, (1, 0)),
    ({"next_step": 4, "prompt_cursor": 12}, {"step": 3, "prompt_cursor": 12}, (4, 12)),
    ({"next_step": 4, "prompt_cursor": 12}, {"step": 4, "prompt_cursor": 16}, (5, 16)),  # crash after the batch
    (None, {"step": 2, "prompt_cursor": 8}, (3, 8)),
])
def test_resume_point(state, last, expected):
    assert get_resume_point(state, last) == expected


def test_prompts_render_with_the_chat_template_when_there_is_one(tmp_path):
    from transformers import AutoTokenizer

    from rlrun_runtime.tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "model"))
    ids, text = render_prompt(tokenizer, "reverse: a b\nanswer:")
    assert text == "reverse: a b\nanswer:" and ids == tokenizer.encode(text)
    ids, text = render_prompt(tokenizer, [{"role": "user", "content": "reverse: a b"}])
    assert text == "user: reverse: a b\nassistant:" and ids == tokenizer.encode(text, add_special_tokens=False)


# --- a real orchestrator process against real vLLM and vllm-router -------------------------------------


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://{LOOPBACK}:{port}/metrics", timeout=5).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


class StandInTrainer(threading.Thread):
    """Trains nothing: for each step waits for its batch, checks it, 'trains' for ``train_s`` and publishes
    the initial model as the next policy version. Records what existed at each moment."""

    def __init__(self, storage: RunStorage, steps: range, spec_algorithm: dict, metrics_port: int, train_s: float):
        super().__init__(daemon=True)
        self.storage, self.steps, self.algo = storage, steps, spec_algorithm
        self.metrics_port, self.train_s = metrics_port, train_s
        self.seen: list[dict] = []
        self.error: BaseException | None = None
        self.metrics: list[dict[str, float]] = []

    def run(self):
        try:
            for step in self.steps:
                path = self.storage.rollout_batch(step)
                deadline = time.monotonic() + 300
                while not path.exists():
                    assert time.monotonic() < deadline, f"batch {step} never came"
                    time.sleep(0.05)
                batch = json.loads(path.read_text())
                time.sleep(self.train_s)
                self.seen.append({"step": step, "batch": batch,
                                  "next_batch_ready_before_publish": self.storage.rollout_batch(step + 1).exists(),
                                  "batch_after_next_ready_before_publish": self.storage.rollout_batch(step + 2).exists()})
                self.metrics.append(scrape(self.metrics_port))
                with atomic_directory(self.storage.weights(step)) as tmp:
                    for entry in self.storage.model_dir.iterdir():
                        shutil.copy2(entry, tmp / entry.name)
        except BaseException as err:  # reported by the test
            self.error = err


def run_orchestrator(config: Path, storage: Path, engine_url: str, router_url: str | None, metrics_port: int,
                     trainer: StandInTrainer, log_path: Path) -> int:
    env = role_env(storage, **{constants.ENV_INFERENCE_ENDPOINTS: engine_url.removeprefix("http://"),
                               constants.ENV_METRICS_PORT: str(metrics_port)})
    if router_url:
        env[constants.ENV_ROUTER_URL] = router_url
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlrun_runtime.cli", "orchestrator", "--config", str(config)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        trainer.start()
        return proc.wait(timeout=400)
    finally:
        stop_group(proc)
        trainer.join(timeout=10)


@pytest.fixture
def router(tmp_path):
    """Yield a function starting `rlrun-runtime router` (static discovery) in front of one engine."""
    procs = []

    def start(config: Path, engine_url: str) -> str:
        port, metrics = free_port(), free_port()
        env = role_env(tmp_path, **{constants.ENV_ROUTER_DISCOVERY: "static", constants.ENV_WORKER_URLS: engine_url,
                                    constants.ENV_ROUTER_PORT: str(port), constants.ENV_ROUTER_METRICS_PORT: str(metrics)})
        log = open(tmp_path / "router.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "rlrun_runtime.cli", "router", "--config", str(config)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
        return f"http://{LOOPBACK}:{port}"

    yield start
    for proc in procs:
        stop_group(proc)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_real_run_async_gate_weight_updates_metrics_and_resume(tmp_path, router):
    storage_dir = tmp_path / "storage"
    storage = RunStorage(storage_dir)
    rlrun = tiny_rlrun(maxSteps=3, maxAsyncLevel=1, maxOffPolicySteps=1, batchSize=16, rolloutsPerPrompt=4)
    config = write_config(tmp_path / "run.yaml", rlrun)
    with inference_server(config, storage_dir, tmp_path / "vllm.log") as engine_url:
        router_url = router(config, engine_url)
        port = free_port()
        trainer = StandInTrainer(storage, range(1, 4), rlrun["spec"]["algorithm"], port, train_s=2.0)
        code = run_orchestrator(config, storage_dir, engine_url, router_url, port, trainer,
                                tmp_path / "orchestrator.log")
        log = (tmp_path / "orchestrator.log").read_text()
        assert code == 0, log[-3000:]
        assert trainer.error is None, trainer.error
        assert "policy version 3 loaded on every engine" in log

        # the async gate (maxAsyncLevel 1): batch n+1 was ready while step n trained, batch n+2 was not
        assert [s["next_batch_ready_before_publish"] for s in trainer.seen] == [True, True, False]
        assert not any(s["batch_after_next_ready_before_publish"] for s in trainer.seen)
        for seen in trainer.seen:
            batch, step = seen["batch"], seen["step"]
            assert len(batch["samples"]) == 16 and batch["dropped_stale_groups"] == 0
            assert all(step - 1 - 1 <= v <= step - 1 for v in batch["policy_versions"])
            for sample in batch["samples"]:
                assert len(sample["completion_ids"]) == len(sample["inference_logprobs"]) >= 1
                assert all(lp <= 0 and math.isfinite(lp) for lp in sample["inference_logprobs"])
            assert 0.0 <= batch["reward_mean"] <= 1.0 and batch["generation_seconds"] > 0
        # metrics the operator scrapes, read while the run was going
        assert trainer.metrics[0][constants.METRIC_MAX_STEPS] == 3
        assert trainer.metrics[-1][constants.METRIC_POLICY_VERSION] >= 1
        assert trainer.metrics[-1][constants.METRIC_LAST_REWARD] == pytest.approx(
            json.loads(storage.rollout_batch(3).read_text())["reward_mean"])
        assert trainer.metrics[-1]["rlrun_orchestrator_rollouts_total"] >= 48

        # every engine reports the final version; older weight directories were removed
        assert httpx.get(f"{engine_url}/weight_info").json()["weight_version"] == "3"
        assert sorted(p.name for p in storage.weights_dir.iterdir()) == ["step-000003"]
        state = json.loads(storage.orchestrator_state.read_text())
        assert state == {"next_step": 4, "prompt_cursor": json.loads(storage.rollout_batch(3).read_text())["prompt_cursor"]}
        samples = [json.loads(line) for line in storage.rollout_samples_file.read_text().splitlines()]
        assert {"prompt", "completion", "reward", "policy_version", "step"} <= set(samples[0])

        # a group is one request with n choices (vLLM 0.32): each choice has its own server token ids and
        # logprobs, and choice i is exactly what an n=1 request with seed + i samples
        sampling = {"temperature": 1.0, "topP": 1.0}
        body = get_completion_request([5, 6, 7, 8], sampling, 8, 3, seed=100, n=4)
        choices = sorted(httpx.post(f"{engine_url}/v1/completions", json=body, timeout=60).json()["choices"],
                         key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        for i, group_choice in enumerate(choices):
            single = get_completion_request([5, 6, 7, 8], sampling, 8, 3, seed=100 + i, n=1)
            alone = httpx.post(f"{engine_url}/v1/completions", json=single, timeout=60).json()["choices"][0]
            parsed, expected = parse_completion_choice(group_choice), parse_completion_choice(alone)
            assert parsed is not None and parsed.token_ids == expected.token_ids
            assert parsed.logprobs == pytest.approx(expected.logprobs, abs=1e-5)

        # resume: the same storage, two more steps; batches continue at 4 with the next prompts
        rlrun["spec"]["algorithm"]["maxSteps"] = 5
        write_config(config, rlrun)
        port2 = free_port()
        trainer2 = StandInTrainer(storage, range(4, 6), rlrun["spec"]["algorithm"], port2, train_s=0.2)
        code = run_orchestrator(config, storage_dir, engine_url, router_url, port2, trainer2,
                                tmp_path / "orchestrator2.log")
        log2 = (tmp_path / "orchestrator2.log").read_text()
        assert code == 0, log2[-3000:]
        assert "starting at batch 4, prompt cursor %d" % state["prompt_cursor"] in log2
        batch4 = json.loads(storage.rollout_batch(4).read_text())
        assert min(s["group"] for s in batch4["samples"]) >= state["prompt_cursor"]
        assert httpx.get(f"{engine_url}/weight_info").json()["weight_version"] == "5"


# --- bad input: exit code 2 before anything starts -------------------------------------------------------


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
    from rlrun_api.spec import apply_defaults
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    storage = RunStorage(tmp_path)
    first, first_address = fake_engines()
    metrics = OrchestratorMetrics(max_steps=5)
    orchestrator = Orchestrator(apply_defaults(tiny_rlrun())["spec"], storage, None, None, [first_address], None,
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
    from rlrun_api.spec import apply_defaults
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    engine, address = fake_engines()
    spec = apply_defaults(tiny_rlrun(rolloutsPerPrompt=4))["spec"]
    spec["inference"]["disaggregation"]["enabled"] = disaggregated
    orchestrator = Orchestrator(spec, RunStorage(tmp_path), StandInEnv(), StandInTokenizer(), [address], None,
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
    from rlrun_api.spec import apply_defaults
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    engine, address = fake_engines(base=SlowReloadEngine)
    storage = RunStorage(tmp_path)
    orchestrator = Orchestrator(apply_defaults(tiny_rlrun(rolloutsPerPrompt=2))["spec"], storage, StandInEnv(),
                                StandInTokenizer(), [address], None, OrchestratorMetrics(max_steps=5))

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
    from rlrun_api.spec import apply_defaults
    from rlrun_runtime.orchestrator import Orchestrator
    from rlrun_runtime.orchestrator_metrics import OrchestratorMetrics

    storage = RunStorage(tmp_path)
    engine, address = fake_engines()
    orchestrator = Orchestrator(apply_defaults(tiny_rlrun())["spec"], storage, None, None, [address], None,
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
