"""A real orchestrator process against real vLLM and vllm-router, with a stand-in trainer."""

from __future__ import annotations

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
from rlrun_runtime.rollouts import get_completion_request, parse_completion_choice
from rlrun_runtime.storage import RunStorage, append_jsonl, atomic_directory
from vllm_role import LOOPBACK, free_port, inference_server, role_env, stop_group, tiny_rlrun, write_config

DATA_WAIT = constants.METRIC_DATA_WAIT_SECONDS + "_total"


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://{LOOPBACK}:{port}/metrics", timeout=5).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_when(port: int, condition, timeout_s: float = 60.0) -> dict[str, float]:
    """Scrape until ``condition(metrics)`` holds; fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition(metrics := scrape(port)):
        assert time.monotonic() < deadline, f"metrics never met the condition: {metrics}"
        time.sleep(0.05)
    return metrics


class StandInTrainer(threading.Thread):
    """Trains nothing: for each step waits for its batch, checks it, 'trains' for ``train_s``, publishes
    the initial model as the next policy version and logs its wait in metrics.jsonl (``wait_seconds``, as
    the real trainer does, after the publish). Records what existed at each moment. Its last scrape waits
    until the orchestrator has counted the wait of every line logged before it."""

    def __init__(self, storage: RunStorage, steps: range, spec_algorithm: dict, metrics_port: int, train_s: float):
        super().__init__(daemon=True)
        self.storage, self.steps, self.algo = storage, steps, spec_algorithm
        self.metrics_port, self.train_s = metrics_port, train_s
        self.seen: list[dict] = []
        self.error: BaseException | None = None
        self.metrics: list[dict[str, float]] = []
        self.waits: list[float] = []

    def run(self):
        try:
            for step in self.steps:
                path = self.storage.rollout_batch(step)
                started = time.monotonic()
                deadline = started + 300
                while not path.exists():
                    assert time.monotonic() < deadline, f"batch {step} never came"
                    time.sleep(0.05)
                self.waits.append(time.monotonic() - started)
                batch = json.loads(path.read_text())
                time.sleep(self.train_s)
                self.seen.append({"step": step, "batch": batch,
                                  "next_batch_ready_before_publish": self.storage.rollout_batch(step + 1).exists(),
                                  "batch_after_next_ready_before_publish": self.storage.rollout_batch(step + 2).exists()})
                logged = sum(self.waits[:-1])
                last = step == self.steps[-1]
                self.metrics.append(scrape_when(self.metrics_port, lambda m: m.get(DATA_WAIT, 0) >= logged - 1e-6)
                                    if last else scrape(self.metrics_port))
                with atomic_directory(self.storage.weights(step)) as tmp:
                    for entry in self.storage.model_dir.iterdir():
                        shutil.copy2(entry, tmp / entry.name)
                append_jsonl(self.storage.metrics_file, {"step": step, "wait_seconds": self.waits[-1]})
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
@pytest.mark.router
@pytest.mark.timeout(900)
def test_real_run_async_gate_weight_updates_metrics_and_resume(tmp_path, router):
    storage_dir = tmp_path / "storage"
    storage = RunStorage(storage_dir)
    rlrun = tiny_rlrun(maxSteps=3, maxAsyncLevel=1, maxOffPolicySteps=1, batchSize=16, rolloutsPerPrompt=4)
    config = write_config(tmp_path / "run.yaml", rlrun)
    with inference_server(config, storage_dir, tmp_path / "vllm.log") as engine_url:
        started_at = time.time()
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
            assert len(batch["samples"]) == 16
            # only groups left over from batch n - 1 can be stale at n: new ones pass the gate (staleness <= 1),
            # and batch 2's leftovers of version 0 are stale at step 3 (a version-0 leftover at step 2 is not)
            left_before = trainer.seen[step - 2]["batch"]["leftover_groups"] if step == 3 else 0
            assert 0 <= batch["dropped_stale_groups"] <= left_before, (step, batch["dropped_stale_groups"])
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
        # what the autoscaler reads (read at step 3, after batch 3: no gate wait is left to come)
        loop = trainer.metrics[-1]
        assert loop[constants.METRIC_WEIGHT_UPDATES + "_total"] >= 1  # version 1 was loaded before batch 3
        assert started_at <= loop[constants.METRIC_LAST_RESUME_TIME] <= time.time()
        gate_waits = [json.loads(storage.rollout_batch(s).read_text())["gate_wait_seconds"] for s in (1, 2, 3)]
        assert gate_waits[2] > 0  # batch 3 waited for version 1, which step 1's 2 s of training held back
        assert loop[constants.METRIC_GATE_WAIT_SECONDS + "_total"] == pytest.approx(sum(gate_waits), abs=0.01)
        # the trainer's waits: steps 1 and 2 logged; step 3's wait (done) may be counted provisionally
        waits = trainer.waits
        assert sum(waits[:2]) - 1e-6 <= loop[DATA_WAIT] <= sum(waits) + 0.05, (loop[DATA_WAIT], waits)

        # every engine reports the final version; older weight directories were removed
        assert httpx.get(f"{engine_url}/weight_info").json()["weight_version"] == "3"
        assert sorted(p.name for p in storage.weights_dir.iterdir()) == ["step-000003"]
        state = json.loads(storage.orchestrator_state.read_text())
        assert state == {"next_step": 4, "prompt_cursor": json.loads(storage.rollout_batch(3).read_text())["prompt_cursor"],
                     "empty_batch_streak": 0}
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
        # a new orchestrator counts only the lines logged after it started (not steps 1-3's waits)
        waits = trainer2.waits
        assert waits[0] - 1e-6 <= trainer2.metrics[-1][DATA_WAIT] <= sum(waits) + 0.05, (trainer2.metrics, waits)
        assert "starting at batch 4, prompt cursor %d" % state["prompt_cursor"] in log2
        batch4 = json.loads(storage.rollout_batch(4).read_text())
        assert min(s["group"] for s in batch4["samples"]) >= state["prompt_cursor"]
        assert httpx.get(f"{engine_url}/weight_info").json()["weight_version"] == "5"


# --- bad input: exit code 2 before anything starts -------------------------------------------------------
